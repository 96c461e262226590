"""`out += coef @ rows` over unit rows, the product of every "input unit" of the sparse methods.

A DIP input column (`up[:, i] | gate[:, i]`), a down column, the down half of an up-pruning bundle:
each such unit is a row of its store matrix, and the projection sums `coef[t, k] * rows[k]` over the
units kept. As a BLAS call this is the non-transposed product `coef @ rows`, which some CPUs serve
well and others do not: torch's bf16 kernel for it on a CPU without AVX-512 (no oneDNN) runs ~100x
slower than `F.linear` on the same bytes. Transposing the rows first costs more than the product.

So this module keeps the rows as they are (cache slots and staging buffers hold unit rows) and
chooses, by measurement on the machine at hand, between:

- `native`: a C kernel (`_columns.c`) that streams each kept row once, converting bf16/fp16 to
  fp32 as it reads and skipping rows whose coefficients are all zero (PowerInfer's neuron-aware
  operator), its columns split over torch's own OpenMP threads;
- `torch`: `torch.mm` in the rows' dtype;
- `torch-fp32`: the rows converted to fp32, then `torch.addmm` (what a CPU without bf16 units
  does fastest for many tokens).

Each is timed once per (dtype, width, token bucket) when a runtime asks for it
(`ColumnProduct.measure`): one token (decode) and `PREFILL_TOKENS` tokens (a prompt). Accumulation
is in fp32 whatever the path.

The transposed product, kept rows dotted with the tokens (`x @ rows[index].T`: a neuron bundle's gate
and up rows), is `RowProduct`: the same library's row kernel, which reads each row where it lies, or
torch's gather and `F.linear`, measured the same way for one token.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path

import torch

from .._measurements import machine_key, median_seconds, recall, remember
from .._native import load_library, source_digest, typed_functions

SOURCE = Path(__file__).with_name("_columns.c")
PREFILL_TOKENS = 32
"""Token count of the second measured bucket; a product of more than `DECODE_MAX_TOKENS` tokens uses it."""
DECODE_MAX_TOKENS = 4
"""Products of up to this many tokens use the choice measured for one token."""
SAMPLE_ELEMENTS = 1 << 21
"""Elements of the synthetic matrix each candidate is timed on (at least `MIN_SAMPLE_ROWS` rows): a
product long enough (~0.1 ms and up) that timer and scheduler noise do not decide the choice."""
MIN_SAMPLE_ROWS = 64

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _native_functions() -> dict[torch.dtype, Callable] | None:
    library = load_library(SOURCE, "columns", openmp=True)
    if library is None:
        return None
    functions: dict = typed_functions(
        library, "flashlm_columns", [_P, _I, _P, _I, _I, _I, _P, _I, _P, _P, _I, _I]
    )
    for function in functions.values():
        function.restype = _I
    functions["dots"] = typed_functions(library, "flashlm_dots", [_P, _I, _I, _P, _I, _P, _I, _I, _P, _I])
    token_argtypes = [_P, _I, _P, _I, _P, _P, _I, _P, _I, _P, _I]
    functions["token"] = typed_functions(library, "flashlm_token_columns", token_argtypes)
    for function in functions["token"].values():
        function.restype = _I
    library.flashlm_flush.argtypes = [_P, _I]
    library.flashlm_flush.restype = None
    functions["flush"] = library.flashlm_flush
    return functions


def _flush(tensor: torch.Tensor) -> None:
    """Evict `tensor` from the CPU caches (where the native library exists and the CPU allows)."""
    functions = _native_functions()
    if functions is not None:
        functions["flush"](tensor.data_ptr(), tensor.numel() * tensor.element_size())


def _check(
    out: torch.Tensor,
    coef: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor | None,
    coef_ids: torch.Tensor | None,
) -> None:
    if out.dtype != torch.float32 or coef.dtype != torch.float32:
        raise ValueError(f"out and coef must be float32, got {out.dtype} and {coef.dtype}.")
    if rows.dim() != 2 or rows.stride(1) != 1 or coef.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("rows, coef and out must be 2-D with unit column stride.")
    for name, ids in (("index", index), ("coef_ids", coef_ids)):
        if ids is not None and (ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous 1-D int64 tensor.")
    used = rows.shape[0] if index is None else index.shape[0]
    coefficients = coef.shape[1] if coef_ids is None else coef_ids.shape[0]
    if coefficients != used or out.shape != (coef.shape[0], rows.shape[1]):
        raise ValueError(
            f"out {tuple(out.shape)} += coef {tuple(coef.shape)} @ rows {tuple(rows.shape)}: shapes disagree."
        )


def native(
    out: torch.Tensor,
    coef: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor | None = None,
    coef_ids: torch.Tensor | None = None,
) -> None:
    """`out += coef @ rows` with the C kernel (see module docstring), on CPU tensors; `rows[index]`
    with an index and `coef[:, coef_ids]` with coefficient ids, neither gathered."""
    functions = _native_functions()
    if functions is None:
        raise RuntimeError("The native column kernel is not available here (no C compiler, or disabled).")
    _check(out, coef, rows, index, coef_ids)
    tokens = coef.shape[0]
    n = rows.shape[0] if index is None else index.shape[0]
    if n == 0 or tokens == 0:
        return
    status = functions[rows.dtype](
        coef.data_ptr(),
        coef.stride(0),
        None if coef_ids is None else coef_ids.data_ptr(),
        coef.shape[1],
        tokens,
        n,
        rows.data_ptr(),
        rows.stride(0),
        None if index is None else index.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        rows.shape[1],
    )
    if status:
        raise IndexError(f"coef_ids must lie in [0, {coef.shape[1]}).")


def native_dots(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, index: torch.Tensor | None) -> None:
    """`out = x @ rows[index].T` (`out[t, k]` the dot of token t with row `index[k]`) with the C kernel,
    the rows read where they lie; `x` and `out` float32 on the CPU, `rows` with unit column stride."""
    functions = _native_functions()
    if functions is None:
        raise RuntimeError("The native row kernel is not available here (no C compiler, or disabled).")
    n = rows.shape[0] if index is None else index.shape[0]
    if x.dtype != torch.float32 or out.dtype != torch.float32 or out.shape != (x.shape[0], n):
        raise ValueError(f"out {tuple(out.shape)} = x {tuple(x.shape)} @ {n} rows: float32, shapes agreeing.")
    if x.shape[1] != rows.shape[1] or rows.stride(1) != 1 or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and rows must have the same width and unit column stride.")
    if index is not None and (index.dtype != torch.int64 or index.dim() != 1 or not index.is_contiguous()):
        raise ValueError("index must be a contiguous 1-D int64 tensor.")
    functions["dots"][rows.dtype](
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        rows.data_ptr(),
        rows.stride(0),
        None if index is None else index.data_ptr(),
        n,
        rows.shape[1],
        out.data_ptr(),
        out.stride(0),
    )


_TOKEN_START, _TOKEN_ROUND, _TOKEN_GLU = 1, 2, 4
"""`flashlm_token_columns`' modes (`_columns.c`)."""


class TokenColumns:
    """A decode token's column product `coef @ rows` over a stage's rows, rounded to the rows' dtype, in the C
    kernel: one call over the cached rows, made before the read of the others is waited for, and one over
    the rows read (`_columns.c`, `flashlm_token_columns`), where torch's path runs five to seven operators.
    With `glu`, the result is DIP's first stage, `up * silu(gate)` of the product's two halves, rounded
    as torch rounds it.

    Sums into a float32 accumulator it reuses; the GLU's `[1, width / 2]` result is a buffer it reuses too,
    valid until its next call (the runtime keeps one per column kind, shared by the layers, as `TopUnits`).
    """

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        self.width = width
        self.dtype = dtype
        self.accumulator = torch.empty(width, dtype=torch.float32)
        self.glu = torch.empty(1, width // 2, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.accumulator, self.glu))

    def serves(self, coef: torch.Tensor, rows: torch.Tensor) -> bool:
        """Whether this call can compute `coef @ rows` (one token, rows of its dtype and width, on the CPU,
        the C library built); the caller takes torch's path where it cannot."""
        return (
            coef.shape[0] == 1
            and rows.dtype == self.dtype
            and rows.shape[1] == self.width
            and rows.is_cpu
            and _native_functions() is not None
        )

    def add(
        self,
        coef: torch.Tensor,
        rows: torch.Tensor,
        ids: torch.Tensor,
        index: torch.Tensor | None = None,
        *,
        start: bool,
    ) -> None:
        """Add `coef[:, ids[k]] * rows[k]` (or `rows[index[k]]`) over k to the sum (zeroed first if
        `start`)."""
        self._call(coef, rows, ids, index, _TOKEN_START if start else 0)

    def result(
        self,
        coef: torch.Tensor,
        rows: torch.Tensor,
        ids: torch.Tensor,
        index: torch.Tensor | None = None,
        *,
        start: bool,
        glu: bool,
    ) -> torch.Tensor:
        """`add`, then the sum rounded to the rows' dtype, `[1, width]` (a new tensor), or with `glu` its
        GLU (the reused buffer)."""
        out = self.glu if glu else torch.empty(1, self.width, dtype=self.dtype)
        mode = (_TOKEN_START if start else 0) | (_TOKEN_GLU if glu else _TOKEN_ROUND)
        self._call(coef, rows, ids, index, mode, out)
        return out

    def _call(
        self,
        coef: torch.Tensor,
        rows: torch.Tensor,
        ids: torch.Tensor,
        index: torch.Tensor | None,
        mode: int,
        out: torch.Tensor | None = None,
    ) -> None:
        if coef.dtype != torch.float32 or rows.dtype != self.dtype or rows.stride(1) != 1:
            raise ValueError(f"coef must be float32 and rows {self.dtype} with unit column stride.")
        status = _native_functions()["token"][self.dtype](
            coef.data_ptr(),
            coef.shape[1],
            rows.data_ptr(),
            rows.stride(0),
            None if index is None else index.data_ptr(),
            ids.data_ptr(),
            ids.shape[0],
            self.accumulator.data_ptr(),
            self.width,
            None if out is None else out.data_ptr(),
            mode,
        )
        if status:
            raise IndexError(f"unit ids must lie in [0, {coef.shape[1]}).")


def torch_mm(out: torch.Tensor, coef: torch.Tensor, rows: torch.Tensor) -> None:
    """`out += coef @ rows` with torch's matmul in the rows' dtype (rows gathered already)."""
    out += torch.mm(coef.to(rows.dtype), rows)


FP32_CHUNK_ROWS = 256
"""Rows converted to fp32 at a time, so the conversion's scratch stays small next to the budget."""


def torch_fp32(out: torch.Tensor, coef: torch.Tensor, rows: torch.Tensor) -> None:
    """`out += coef @ rows` with the rows converted to fp32 first, `FP32_CHUNK_ROWS` at a time."""
    for first in range(0, rows.shape[0], FP32_CHUNK_ROWS):
        last = first + FP32_CHUNK_ROWS
        out.addmm_(coef[:, first:last], rows[first:last].float())


@dataclasses.dataclass(frozen=True)
class ColumnProduct:
    """The measured choice of implementation for one (rows dtype, width): one for a decode step's few
    tokens, one for a prompt's many. Call it as `product(out, coef, rows)` (`out += coef @ rows`)."""

    decode: str
    prefill: str
    timings_ms: dict[str, dict[str, float]]

    def __call__(
        self,
        out: torch.Tensor,
        coef: torch.Tensor,
        rows: torch.Tensor,
        index: torch.Tensor | None = None,
        coef_ids: torch.Tensor | None = None,
    ) -> None:
        """`out += coef @ rows`, or `coef[:, coef_ids] @ rows[index]` (the native kernel reads the
        indexed rows and coefficients where they lie; torch's paths gather them first)."""
        if (coef.shape[1] if coef_ids is None else coef_ids.shape[0]) == 0:
            return
        name = self.decode if coef.shape[0] <= DECODE_MAX_TOKENS else self.prefill
        if rows.device.type != "cpu":  # the native kernel is the CPU's; torch's run anywhere
            name = "torch" if name == "native" else name
            index = None if index is None else index.to(rows.device)
            coef_ids = None if coef_ids is None else coef_ids.to(rows.device)
        if name == "native":
            native(out, coef, rows, index, coef_ids)
            return
        coef = coef if coef_ids is None else coef[:, coef_ids]
        _run(name, out, coef, rows if index is None else rows.index_select(0, index))

    @classmethod
    def measure(cls, dtype: torch.dtype, width: int, density: float = 1.0) -> ColumnProduct:
        """Time every implementation available on a synthetic `[rows, width]` matrix whose rows
        have a nonzero coefficient with probability `density` (the share of units a method keeps: the
        native kernel skips the others, torch's products do not). Memoized per 5% of density, and
        remembered in flashlm's cache per machine (`MEASUREMENTS`): later loads reuse the choice."""
        return _measure(dtype, width, torch.get_num_threads(), round(min(max(density, 0.05), 1.0) * 20) / 20)


@dataclasses.dataclass(frozen=True)
class RowProduct:
    """The measured choice of implementation for a few tokens' dots with kept unit rows,
    `x @ rows[index].T` (a bundle's gate and up rows: the input side of PowerInfer's neuron-aware
    operator): `native` reads each row where it lies (`_columns.c`), `torch` gathers the rows and
    calls `F.linear`. A prompt's many tokens always take `torch` (one matrix product). Call it as
    `product(x, rows, index)`; the result is `[T, n]` in `x`'s dtype, rounded as `F.linear` rounds."""

    decode: str
    timings_ms: dict[str, float]

    def __call__(
        self, x: torch.Tensor, rows: torch.Tensor, index: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.decode == "native" and x.shape[0] <= DECODE_MAX_TOKENS and rows.device.type == "cpu":
            n = rows.shape[0] if index is None else index.shape[0]
            out = torch.empty(x.shape[0], n, dtype=torch.float32)  # whatever the default dtype
            native_dots(out, x.float(), rows, index)
            return out.to(x.dtype)
        if index is None:
            return torch.nn.functional.linear(x, rows)
        return torch.nn.functional.linear(x, rows.index_select(0, index.to(rows.device)))

    @classmethod
    def measure(cls, dtype: torch.dtype, width: int, rows: int) -> RowProduct:
        """Time both for one token's dots with about `rows` kept rows of `width` (what one call of the
        method computes: the call's size decides, as torch's product has a fixed cost the native kernel
        does not), the rows scattered in a matrix twice as wide and evicted from the CPU caches first;
        memoized and remembered per machine as `ColumnProduct.measure` is, per power of two of rows."""
        bucket = 1 << max(0, round(math.log2(max(rows, 1))))
        return _measure_rows(dtype, width, bucket, torch.get_num_threads())


ROW_MEASUREMENTS = "row_products.json"
"""File in flashlm's cache that remembers each machine's `RowProduct` choices (see `MEASUREMENTS`)."""


@functools.cache
def _measure_rows(dtype: torch.dtype, width: int, rows: int, threads: int) -> RowProduct:
    key = f"{_machine_key(dtype, width, threads, 1.0)}|rows={rows}"
    if (known := recall(ROW_MEASUREMENTS, key, RowProduct)) is not None:
        return known
    generator = torch.Generator().manual_seed(0)
    # The kept rows, every other one of a matrix, each a slice of a row twice as wide (a bundle's half).
    matrix = torch.randn(2 * rows, 2 * width, generator=generator, dtype=torch.float32).to(dtype)
    kept, index = matrix[:, :width], torch.arange(0, 2 * rows, 2)
    x = torch.randn(1, width, generator=generator, dtype=torch.float32).to(dtype)
    candidates = {"torch": lambda: RowProduct("torch", {})(x, kept, index)}
    if _native_functions() is not None:
        candidates["native"] = lambda: RowProduct("native", {})(x, kept, index)
    timings = {name: 1e3 * _time(run, repeats=21, cold=matrix) for name, run in candidates.items()}
    product = RowProduct(min(timings, key=timings.get), timings)
    remember(ROW_MEASUREMENTS, key, dataclasses.asdict(product))
    return product


FP32_SLOT_MARGIN = 1.25
"""How much faster float32 rows must multiply for a cache to hold them (`slot_dtype`)."""


def slot_dtype(dtype: torch.dtype, width: int) -> torch.dtype:
    """The dtype a cache of column units of `width` should hold its rows in: the store's `dtype`, or
    float32 when rows converted once (on admission) multiply faster here than rows converted as they
    are read — which a CPU without bf16 arithmetic might do, though a one-token product reads every
    byte once and fp32 rows are twice the bytes. Timed once per (dtype, width) on one token's product;
    float32 must win by `FP32_SLOT_MARGIN`, since it halves the units the same budget caches (a median
    of 7 short runs on a busy machine flips either way)."""
    return _slot_dtype(dtype, width, torch.get_num_threads())


@functools.cache
def _slot_dtype(dtype: torch.dtype, width: int, threads: int) -> torch.dtype:
    if dtype == torch.float32:
        return dtype
    generator = torch.Generator().manual_seed(0)
    sample_rows = _sample_rows(width)
    rows = torch.randn(sample_rows, width, generator=generator, dtype=torch.float32)
    coef = torch.randn(1, sample_rows, generator=generator, dtype=torch.float32)
    out = torch.zeros(1, width, dtype=torch.float32)
    name = "native" if _native_functions() is not None else "torch"
    stored = _time(functools.partial(_run, name, out, coef, rows.to(dtype)), cold=rows.to(dtype))
    converted = _time(functools.partial(_run, name, out, coef, rows), cold=rows)
    return torch.float32 if converted * FP32_SLOT_MARGIN < stored else dtype


def _run(name: str, out: torch.Tensor, coef: torch.Tensor, rows: torch.Tensor) -> None:
    if name == "native":
        native(out, coef, rows)
    elif name == "torch":
        torch_mm(out, coef, rows)
    else:
        torch_fp32(out, coef, rows)


MEASUREMENTS = "column_products.json"
"""File in flashlm's cache that remembers each machine's measured choices: the implementations round
differently (torch's bf16 product rounds the coefficients to bf16), so a choice re-measured at every
load could differ between runs, and with it a sparse method's tokens."""


def _machine_key(dtype: torch.dtype, width: int, threads: int, density: float) -> str:
    """What a measurement depends on: the machine, the native kernel (a changed one is measured
    again), the problem."""
    native = f"native-{source_digest(SOURCE)[:12]}" if _native_functions() is not None else "no-native"
    return "|".join([machine_key(), native, str(dtype), str(width), str(threads), f"{density:.2f}"])


@functools.cache
def _measure(dtype: torch.dtype, width: int, threads: int, density: float) -> ColumnProduct:
    """`ColumnProduct.measure`, memoized per torch thread count too, and remembered per machine."""
    key = _machine_key(dtype, width, threads, density)
    if (known := recall(MEASUREMENTS, key, ColumnProduct)) is not None:
        return known
    candidates = (
        ["native", "torch", "torch-fp32"] if _native_functions() is not None else ["torch", "torch-fp32"]
    )
    generator = torch.Generator().manual_seed(0)
    sample_rows = _sample_rows(width)
    # Explicit dtypes: this runs while transformers builds a model under another default dtype.
    rows = torch.randn(sample_rows, width, generator=generator, dtype=torch.float32).to(dtype)
    timings: dict[str, dict[str, float]] = {}
    best: dict[str, str] = {}
    for bucket, tokens in (("decode", 1), ("prefill", PREFILL_TOKENS)):
        coef = torch.randn(tokens, sample_rows, generator=generator, dtype=torch.float32)
        coef *= torch.rand(sample_rows, generator=generator, dtype=torch.float32) < density
        out = torch.zeros(tokens, width, dtype=torch.float32)
        timings[bucket] = {}
        for name in candidates:
            call = functools.partial(_run, name, out, coef, rows)
            # One token's product reads rows the CPU caches no longer hold; a prompt's reuses them.
            timings[bucket][name] = 1e3 * _time(call, cold=rows if tokens == 1 else None)
        best[bucket] = min(timings[bucket], key=timings[bucket].get)
    product = ColumnProduct(best["decode"], best["prefill"], timings)
    remember(MEASUREMENTS, key, dataclasses.asdict(product))
    return product


def _sample_rows(width: int) -> int:
    return max(MIN_SAMPLE_ROWS, SAMPLE_ELEMENTS // max(width, 1))


def _time(run: Callable[[], None], repeats: int = 7, cold: torch.Tensor | None = None) -> float:
    """Median seconds of `run` after one warm-up call; `cold` is evicted from the CPU caches first."""
    return median_seconds(run, repeats, None if cold is None else functools.partial(_flush, cold))
