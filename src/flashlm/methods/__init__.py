"""The methods: the modules that replace a model's MLPs or linears, one class per `FlashConfig.method`
(registered in `METHODS`), with their selection and calibration, and the `Replacer` of each family
that puts them into a model. Importing this package registers them all."""

from .base import (
    METHODS,
    MethodModule,
    Replacer,
    Target,
    flashlm_modules,
    method_class,
    register_method,
    runtime_of,
)
from .dense import StreamingMLP
from .endor import EndorLinear
from .mlp import FlashMLP, module_class, streaming_mlps
from .predictor import PredictorMLP
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
    "MethodModule",
    "PredictorMLP",
    "Replacer",
    "SparseMLP",
    "StreamingMLP",
    "Target",
    "UpPruningMLP",
    "build_sparse_mlp",
    "flashlm_modules",
    "method_class",
    "method_specs",
    "module_class",
    "parse_method_spec",
    "reads_ahead",
    "register_method",
    "runtime_of",
    "streaming_mlps",
]
