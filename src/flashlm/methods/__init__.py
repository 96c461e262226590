"""The methods: the modules that replace a model's MLPs or linears, one class per `FlashConfig.method`
(registered in `METHODS`), with their selection and calibration. Importing this package registers them all."""

from .base import METHODS, FlashMLP, method_class, register_method
from .dense import StreamingMLP
from .endor import EndorLinear
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
from .specs import method_specs, parse_method_spec

__all__ = [
    "CATSMLP",
    "DIPMLP",
    "METHODS",
    "EndorLinear",
    "FlashMLP",
    "GLUPruningMLP",
    "GatePruningMLP",
    "SparseMLP",
    "StreamingMLP",
    "UpPruningMLP",
    "build_sparse_mlp",
    "method_class",
    "method_specs",
    "parse_method_spec",
    "reads_ahead",
    "register_method",
]
