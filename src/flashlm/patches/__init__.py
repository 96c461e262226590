"""The modules that replace a model's MLPs (one class per `FlashConfig.method`) and their selection."""

from .base import FlashMLP, method_class, register_method
from .sparse import (
    CATSMLP,
    DIPMLP,
    GatePruningMLP,
    GLUPruningMLP,
    SparseMLP,
    UpPruningMLP,
    build_sparse_mlp,
    reads_ahead,
)
from .streaming import StreamingMLP

__all__ = [
    "CATSMLP",
    "DIPMLP",
    "FlashMLP",
    "GLUPruningMLP",
    "GatePruningMLP",
    "SparseMLP",
    "StreamingMLP",
    "UpPruningMLP",
    "build_sparse_mlp",
    "method_class",
    "reads_ahead",
    "register_method",
]
