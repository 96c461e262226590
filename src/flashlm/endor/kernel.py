"""A C kernel for Endor decompression on the CPU, built on first use with the system C compiler.

The torch gather in `codec.py` is the reference and the fallback. On a 2-core machine it spends
~1.6 ns per element (SmolLM2's 106 M decoder weights: ~200 ms per token), which makes decompression,
not the disk, the bottleneck of CPU offloading (as the Endor paper found with CPU decompression).
`_decompress.c` does one branch-free pass per row with one dependent add per 8 elements, split over
`torch.get_num_threads()` threads (ctypes releases the GIL): about 4x faster here.

The shared library is built once by `flashlm._native.load_library`. Without a compiler, or with
`FLASHLM_C_KERNEL=0`, `cpu_kernel()` returns None and the torch path runs; `decompression_path()`
says which is in use.
"""

from __future__ import annotations

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import torch

from .._native import load_library

SOURCE = Path(__file__).with_name("_decompress.c")
PARALLEL_MIN_ELEMENTS = 1 << 16
"""Below this many elements one thread decompresses alone (a thread hand-off costs more)."""
_P, _I = ctypes.c_void_p, ctypes.c_int64


class CpuKernel:
    """The loaded library: `row_offsets` and `decompress` over contiguous CPU tensors."""

    def __init__(self, library: ctypes.CDLL, threads: int) -> None:
        self._lib = library
        library.endor_init.argtypes = []
        library.endor_row_offsets.argtypes = [_P, _I, _I, _P]
        library.endor_row_offsets.restype = _I
        self._decompress = {}
        for size in (1, 2, 4, 8):
            function = getattr(library, f"endor_decompress_{size * 8}")
            function.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I]
            function.restype = None
            self._decompress[size] = function
        library.endor_init()
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="flashlm-endor") if threads > 1 else None

    def row_offsets(self, bitmap: torch.Tensor, offsets: torch.Tensor) -> int:
        """Fill `offsets` (int64 [rows + 1]) with where each row's values start; return the total."""
        rows, row_bytes = bitmap.shape
        return self._lib.endor_row_offsets(bitmap.data_ptr(), rows, row_bytes, offsets.data_ptr())

    def decompress(
        self, bitmap: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Fill `out` ([rows, cols]) from `bitmap`, `values` and `offsets` from `row_offsets`."""
        rows, cols = out.shape
        function = self._decompress[values.element_size()]
        args = (
            bitmap.data_ptr(),
            values.data_ptr(),
            offsets.data_ptr(),
            out.data_ptr(),
            rows,
            cols,
            bitmap.shape[1],
        )
        if self._pool is None or rows * cols < PARALLEL_MIN_ELEMENTS or rows < self.threads:
            function(*args, 0, rows)
            return
        bounds = [rows * part // self.threads for part in range(self.threads + 1)]
        futures = [self._pool.submit(function, *args, first, last) for first, last in pairwise(bounds)]
        for future in futures:
            future.result()


@functools.cache
def cpu_kernel() -> CpuKernel | None:
    """The C kernel, compiled and loaded on first call; None where it cannot be (logged once)."""
    library = load_library(SOURCE, "endor-decompress")
    if library is None:
        return None
    return CpuKernel(library, threads=max(1, torch.get_num_threads()))


def decompression_path() -> str:
    """Which CPU decompression runs: the C kernel (with its threads) or torch ops."""
    kernel = cpu_kernel()
    return f"C kernel, {kernel.threads} threads" if kernel is not None else "torch ops"
