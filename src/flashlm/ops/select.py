"""Per-token top-k masks in C (`_select.c`): DIP's selections without a sort.

`torch.topk` on a prompt's scores (200 tokens x 8960 units) costs about as much as the products it
selects for; a radix select over the scores' bits costs a fraction. `topk_mask` returns None where the
C library is unavailable (no compiler, `FLASHLM_C_KERNEL=0`) or the input is not a CPU matrix, and the
caller (`flashlm.methods.masking.magnitude_topk`) computes the same mask with torch.

`TopUnits` is the same selection for one token, fused with what a decode step's stage does next
(its unit ids, their cache lookup, the masked coefficients) into buffers it owns: one call where a
stage ran about ten tensor operators, each of which can cost tens of microseconds in a decode step
(the products between them leave the CPU's caches and TLBs cold; part of that start-up cost then
falls on the next operator instead: README, `benchmarks/per_token_path.py`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from .._native import load_library, typed_functions

SOURCE = Path(__file__).with_name("_select.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _functions() -> dict[str, dict[torch.dtype, Callable]] | None:
    """The library's typed functions by name (`topk`, `units`) and element type; None where unbuilt."""
    library = load_library(SOURCE, "select", openmp=True)
    if library is None:
        return None
    functions = typed_functions(library, "flashlm_topk", [_P, _I, _I, _I, _P, ctypes.c_float, _I, _P, _I])
    units = typed_functions(
        library, "flashlm_top_units", [_P, _I, _P, _P, ctypes.c_float, _I, _P, _P, _P, _P, _P, _P, _I, _P]
    )
    for function in units.values():
        function.restype = _I
    return {"topk": functions, "units": units}


def topk_mask(
    x: torch.Tensor, k: int, resident: torch.Tensor | None = None, gamma: float = 1.0
) -> torch.Tensor | None:
    """`[T, n]` bool mask of the `k` largest `|x| * (1 if resident else gamma)` of each row (ties: lowest
    index first), or None where this kernel cannot run."""
    library = _functions()
    functions = None if library is None else library["topk"]
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


class Units(NamedTuple):
    """What `TopUnits` found for one token (views of its buffers)."""

    mask: torch.Tensor
    """`[1, num_units]` bool: the selection."""
    coef: torch.Tensor
    """`[1, num_units]` fp32: the input where the mask keeps it, else 0."""
    ids: torch.Tensor
    """The kept unit ids, ascending."""
    misses: torch.Tensor
    """Those of them not in the cache, ascending."""
    unread: torch.Tensor | None
    """Those of the misses not read by other means either (`also_resident`), ascending: a view of the
    caller's `unread_into` (None without it)."""


class TopUnits:
    """One token's magnitude top-k over `num_units` units, with its lookup in a cache, in one C call
    (`flashlm_top_units`), into buffers of its own that each call reuses (`nbytes` of them).

    What a call returns are views of those buffers, valid until the next call (the runtime keeps two
    sets per unit kind, which the layers take in turn: `FlashRuntime.selection_units`).
    """

    def __init__(self, num_units: int) -> None:
        self.num_units = num_units
        self.mask = torch.empty(1, num_units, dtype=torch.bool)
        self.coef = torch.empty(1, num_units, dtype=torch.float32)
        self.ids = torch.empty(num_units, dtype=torch.int64)
        self.miss_ids = torch.empty(num_units, dtype=torch.int64)
        self._missed = ctypes.c_int64()
        self._unread = ctypes.c_int64()
        self._pointers = (
            self.mask.data_ptr(),
            self.coef.data_ptr(),
            self.ids.data_ptr(),
            self.miss_ids.data_ptr(),
            ctypes.addressof(self._missed),
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.mask, self.coef, self.ids, self.miss_ids))

    def __call__(
        self,
        x: torch.Tensor,
        k: int,
        slot_of: torch.Tensor,
        gamma: float = 1.0,
        also_resident: torch.Tensor | None = None,
        unread_into: torch.Tensor | None = None,
    ) -> Units | None:
        """`Units` for the one token `x` (`[1, num_units]` on the CPU): the mask of the `k` largest
        `|x| * (1 if resident else gamma)` (as `topk_mask`), a unit resident where `slot_of >= 0` or
        `also_resident` (a bool mask of `num_units`: units read by other means, a guess) is set; `x` where
        the mask is set and 0 elsewhere (fp32); the kept unit ids; those with `slot_of < 0`; and, written
        into `unread_into` (a contiguous int64 CPU vector), those of them not `also_resident`. None where
        the C library or this input cannot serve (the caller then takes the general path)."""
        library = _functions()
        function = None if library is None else library["units"].get(x.dtype)
        if function is None or not x.is_cpu or x.shape != self.mask.shape or x.stride(1) != 1:
            return None
        if not 0 <= k <= self.num_units:
            raise ValueError(f"k must be in [0, {self.num_units}], got {k}.")
        if slot_of.shape != (self.num_units,) or slot_of.dtype != torch.int64 or not slot_of.is_cpu:
            raise ValueError(f"slot_of must be a CPU int64 vector of {self.num_units} slots.")
        also = None
        if also_resident is not None:
            if also_resident.dtype != torch.bool or also_resident.numel() != self.num_units:
                raise ValueError(f"also_resident must be a bool mask of {self.num_units} units.")
            if not (also_resident.is_cpu and also_resident.is_contiguous()):
                return None
            also = also_resident.data_ptr()
        if unread_into is not None and not (
            unread_into.dtype == torch.int64
            and unread_into.dim() == 1
            and unread_into.is_cpu
            and unread_into.is_contiguous()
        ):
            raise ValueError("unread_into must be a contiguous 1-D int64 CPU tensor.")
        mask, coef, ids, miss_ids, missed = self._pointers
        kept = function(
            x.data_ptr(),
            self.num_units,
            slot_of.data_ptr(),
            also,
            gamma,
            k,
            mask,
            coef,
            ids,
            miss_ids,
            missed,
            None if unread_into is None else unread_into.data_ptr(),
            0 if unread_into is None else unread_into.numel(),
            ctypes.addressof(self._unread),
        )
        unread = None
        if unread_into is not None:
            if self._unread.value < 0:
                raise ValueError(
                    f"unread_into holds {unread_into.numel()} ids, fewer than the units left to read."
                )
            unread = unread_into[: self._unread.value]
        return Units(self.mask, self.coef, self.ids[:kept], self.miss_ids[: self._missed.value], unread)
