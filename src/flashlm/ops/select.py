"""Per-token top-k masks in C (`_select.c`): DIP's selections without a sort.

`torch.topk` on a prompt's scores (200 tokens x 8960 units) costs about as much as the products it
selects for; a radix select over the scores' bits costs a fraction. `topk_mask` returns None where the
C library is unavailable (no compiler, `FLASHLM_C_KERNEL=0`) or the input is not a CPU matrix, and the
caller (`flashlm.methods.masking.magnitude_topk`) computes the same mask with torch.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from .._native import load_library, typed_functions

SOURCE = Path(__file__).with_name("_select.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _functions() -> dict[torch.dtype, Callable] | None:
    library = load_library(SOURCE, "select", openmp=True)
    if library is None:
        return None
    return typed_functions(library, "flashlm_topk", [_P, _I, _I, _I, _P, ctypes.c_float, _I, _P, _I])


def topk_mask(
    x: torch.Tensor, k: int, resident: torch.Tensor | None = None, gamma: float = 1.0
) -> torch.Tensor | None:
    """`[T, n]` bool mask of the `k` largest `|x| * (1 if resident else gamma)` of each row (ties: lowest
    index first), or None where this kernel cannot run."""
    functions = _functions()
    if (
        functions is None
        or x.dim() != 2
        or x.device.type != "cpu"
        or x.dtype not in functions
        or x.stride(1) != 1
        or (resident is not None and (resident.dtype != torch.bool or not resident.is_contiguous()))
    ):
        return None
    tokens, n = x.shape
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}.")
    mask = torch.empty(tokens, n, dtype=torch.bool)
    if tokens:
        functions[x.dtype](
            x.data_ptr(),
            x.stride(0),
            tokens,
            n,
            None if resident is None else resident.data_ptr(),
            float(gamma),
            k,
            mask.data_ptr(),
            n,
        )
    return mask
