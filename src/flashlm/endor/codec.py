"""The Endor sparse format (Endor paper, §4.1, Algorithms 1 and 2): a pruned 2-D weight as a per-row
packed bitmap of its non-zero positions plus its non-zero values, in the weight's dtype.

    bitmap  uint8 [rows, ceil(cols / 8)]   bit (j % 8) of byte j // 8 (LSB first) is 1 where [i, j] != 0;
                                           the padding bits past `cols` in a row's last byte are 0
    values  1-D, the weight's dtype        the non-zeros in row-major order, popcount(bitmap) of them

Zero is a bit pattern, not a value: an element is zero iff all its bits are, so -0.0 and NaN are kept
as non-zeros and a round trip is bit-exact for any input. Every comparison and scatter therefore runs
on a same-size integer view of the tensor.

Each row's bitmap has a fixed width, so a subset of rows can be moved alone: where a row's values lie
in `values` follows from the bitmap by popcount and cumsum (`value_ranges`), the paper's "minimal
bitmap processing" that pairs the format with activation sparsity.

Everything is vectorized: torch ops (shifts and sums over a `[..., 8]` view, 256-entry tables, a
cumulative sum and a gather) and, on CPU, numpy's C bit unpacking; the CUDA path is the same torch code
run on the device's tensors, with a table lookup for the unpacking.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import EndorFormatError
from .kernel import cpu_kernel

SUPPORTED_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
)
"""Dtypes a weight may have: any whose elements can be viewed as a same-size integer."""

_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensor fields with `==` has no single truth value
class EndorMatrix:
    """One compressed 2-D weight [rows, cols]: `bitmap` uint8 [rows, bitmap_row_bytes(cols)] and
    `values`, its non-zeros in row-major order (1-D, the weight's dtype). See the module docstring.

    Construction does not check consistency (a store builds these as views of a file it already
    checked); call `validate` on untrusted data. `decompress` checks what it needs.
    """

    bitmap: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, int]

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.bitmap.device

    @property
    def nnz(self) -> int:
        return self.values.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of the compressed form: what a load moves."""
        return self.bitmap.numel() + self.values.numel() * self.values.element_size()

    @property
    def dense_nbytes(self) -> int:
        rows, cols = self.shape
        return rows * cols * self.values.element_size()

    @property
    def ratio(self) -> float:
        """Compressed over dense bytes (1.0 for an empty matrix, which compresses to nothing)."""
        return self.nbytes / self.dense_nbytes if self.dense_nbytes else 1.0

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> EndorMatrix:
        """The same matrix with both tensors on `device`, still compressed (decompress there)."""
        return dataclasses.replace(
            self,
            bitmap=self.bitmap.to(device, non_blocking=non_blocking),
            values=self.values.to(device, non_blocking=non_blocking),
        )

    def row_offsets(self) -> torch.Tensor:
        """int64 [rows + 1]: row i's values are `values[offsets[i]:offsets[i + 1]]`; on `bitmap.device`."""
        return _row_offsets(self.bitmap)

    def validate(self) -> None:
        """Raise `EndorFormatError` unless bitmap, values and shape describe one matrix."""
        _check_row_count(self)
        _check_consistent(self.bitmap, self.values, self.shape[1])


def bitmap_row_bytes(cols: int) -> int:
    """Bytes of one row's bitmap: one bit per column, padded to a whole byte."""
    return (cols + 7) // 8


def compressed_nbytes(rows: int, cols: int, nnz: int, dtype: torch.dtype) -> int:
    """Bytes of a compressed [rows, cols] matrix of `dtype` with `nnz` non-zeros."""
    return rows * bitmap_row_bytes(cols) + nnz * dtype.itemsize


def compression_ratio(sparsity: float, dtype: torch.dtype) -> float:
    """Compressed over dense bytes at `sparsity` (fraction of zeros), for cols a multiple of 8: each
    element costs its value's bytes when non-zero plus one bit of bitmap."""
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}.")
    return ((1.0 - sparsity) * dtype.itemsize + 1 / 8) / dtype.itemsize


def compress(weight: torch.Tensor) -> EndorMatrix:
    """Algorithm 1, vectorized: the Endor form of a 2-D `weight`, on `weight`'s device."""
    if weight.dim() != 2:
        raise ValueError(f"Endor compresses 2-D weights; got shape {tuple(weight.shape)}.")
    bits = _bits(weight)
    mask = bits != 0
    rows, cols = weight.shape
    padded = torch.zeros(rows, bitmap_row_bytes(cols) * 8, dtype=torch.uint8, device=weight.device)
    padded[:, :cols] = mask
    shifts, _, _ = _tables(weight.device)
    bitmap = (padded.view(rows, bitmap_row_bytes(cols), 8) << shifts).sum(-1, dtype=torch.uint8)
    return EndorMatrix(bitmap=bitmap, values=bits[mask].view(weight.dtype), shape=(rows, cols))


def decompress(
    matrix: EndorMatrix, *, device: torch.device | str | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Algorithm 2: the dense [rows, cols] weight, on `device` (default: the matrix's).

    The compressed tensors are moved to `device` first, so only compressed bytes cross the bus and the
    decompression runs there. `out`, a preallocated [rows, cols] tensor of the dtype on `device`, is
    filled and returned.
    """
    if device is not None:
        matrix = matrix.to(device)
    _check_row_count(matrix)
    return decompress_rows(matrix.bitmap, matrix.values, matrix.shape[1], out=out)


def decompress_rows(
    bitmap_rows: torch.Tensor, values: torch.Tensor, cols: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Algorithm 2 for some rows: `bitmap_rows` [n, bitmap_row_bytes(cols)] and those rows' values,
    concatenated in order (as `select_rows` returns them) -> dense [n, cols], on their device.

    `out`, if given, is a contiguous [n, cols] tensor of the values' dtype on that device; it is
    filled and returned.

    On the CPU the C kernel of `flashlm.endor.kernel` runs where it could be built; elsewhere, and
    without it, a branch-free torch gather.
    """
    _check_layout(bitmap_rows, values, cols)
    if values.device != bitmap_rows.device:
        raise ValueError(f"bitmap_rows are on {bitmap_rows.device} but values on {values.device}.")
    n = bitmap_rows.shape[0]
    if out is None:
        out = torch.empty(n, cols, dtype=values.dtype, device=values.device)
    elif (
        out.shape != (n, cols)
        or out.dtype != values.dtype
        or out.device != values.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out is a {tuple(out.shape)} {out.dtype} tensor on {out.device}; "
            f"expected a contiguous ({n}, {cols}) {values.dtype} tensor on {values.device}."
        )
    _decompress_into(bitmap_rows, values, cols, out, _Scratch(values.device))
    return out


class Decompressor:
    """Algorithm 2 into caller-owned memory with reused scratch, for a runtime that decompresses every
    layer every token: after the first calls, no call allocates (fresh scratch made in-place
    decompression of SmolLM2 layers ~2x slower than its arithmetic)."""

    def __init__(self, max_numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_numel = max_numel
        self._scratch = _Scratch(self.device)

    @property
    def nbytes(self) -> int:
        """Scratch bytes allocated so far."""
        return self._scratch.nbytes

    def __call__(self, matrix: EndorMatrix, out: torch.Tensor) -> torch.Tensor:
        """Decompress `matrix` (already on this device) into `out`, a contiguous [rows, cols] tensor."""
        rows, cols = matrix.shape
        _check_row_count(matrix)
        _check_layout(matrix.bitmap, matrix.values, cols)
        if out.shape != (rows, cols) or out.dtype != matrix.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous ({rows}, {cols}) {matrix.dtype} tensor.")
        if rows * cols > self.max_numel or matrix.dtype != self.dtype:
            raise ValueError(f"This Decompressor holds {self.max_numel} {self.dtype} elements at most.")
        _decompress_into(matrix.bitmap, matrix.values, cols, out, self._scratch)
        return out


class _Scratch:
    """Buffers that decompression reuses, by name, grown on demand."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None or tensor.numel() < numel or tensor.dtype != dtype:
            tensor = self._tensors[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return tensor[:numel]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


def _decompress_into(
    bitmap: torch.Tensor, values: torch.Tensor, cols: int, out: torch.Tensor, scratch: _Scratch
) -> None:
    """Algorithm 2 into `out` (contiguous), by the C kernel on the CPU where it is available, else by
    a torch gather. Raises `EndorFormatError` when the bitmap and the values disagree, before reading."""
    rows = bitmap.shape[0]
    kernel = cpu_kernel() if values.device.type == "cpu" else None
    if kernel is not None:
        bitmap, values = bitmap.contiguous(), values.contiguous()
        offsets = scratch.get("offsets", rows + 1, torch.int64)
        found = kernel.row_offsets(bitmap, offsets)
        if found != values.numel():
            raise EndorFormatError(_count_mismatch(rows, found, values.numel()))
        kernel.decompress(bitmap, values, offsets, out)
        return
    # Branch-free, as a gather: the running count of set bits numbers each non-zero's value in
    # row-major order (Algorithm 2's k), zeros point at a leading 0 sentinel, and one `index_select`
    # writes every element (~3x faster on CPU than boolean-mask assignment, whose per-element branch
    # a 50%-random mask mispredicts).
    numel = rows * cols
    index = scratch.get("index", numel, torch.int32 if numel < 2**31 else torch.int64)
    padded = scratch.get("padded", values.numel() + 1, _BITS_VIEW[values.element_size()])
    mask = _unpack(bitmap, cols).view(-1)
    torch.cumsum(mask, 0, dtype=index.dtype, out=index)
    found = int(index[-1]) if index.numel() else 0
    if found != values.numel():
        raise EndorFormatError(_count_mismatch(rows, found, values.numel()))
    index.mul_(mask)
    padded[:1] = 0
    padded[1:] = _bits(values)
    torch.index_select(padded, 0, index, out=_bits(out).view(-1))


def select_rows(matrix: EndorMatrix, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed bytes of rows `ids` (any order, repeats allowed): their bitmap rows, and their
    values concatenated in `ids` order. What a subset load moves; `decompress_rows` expands it."""
    ids = _row_ids(ids, matrix.bitmap)
    return matrix.bitmap[ids], matrix.values[value_indices(matrix.bitmap, ids)]


def value_indices(bitmap: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 positions, in the matrix's `values`, of the values of rows `ids`, concatenated in `ids` order."""
    starts, ends = value_ranges(bitmap, ids)
    lengths = ends - starts
    # Selected value k of row r sits at starts[r] + (k - where row r's values begin in the output).
    begins = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum()), device=bitmap.device) + torch.repeat_interleave(
        starts - begins, lengths
    )


def value_ranges(bitmap: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 starts and ends, into the matrix's `values`, of rows `ids`, from the bitmap alone: how a
    store finds the values to read for a subset of rows without reading the others."""
    ids = _row_ids(ids, bitmap)
    offsets = _row_offsets(bitmap)
    return offsets[ids], offsets[ids + 1]


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per device: the bit shifts 0..7 (uint8), the popcount of every byte value (uint8 [256]) and
    every byte value's bits, LSB first (uint8 [256, 8])."""
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    popcount = torch.tensor([bin(byte).count("1") for byte in range(256)], dtype=torch.uint8, device=device)
    bits_of_byte = (torch.arange(256, device=device)[:, None] >> shifts.long()) & 1
    return shifts, popcount, bits_of_byte.to(torch.uint8)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` viewed as the same-size integer dtype, where zero means all bits zero."""
    if tensor.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"Endor cannot hold dtype {tensor.dtype}; supported: {supported}.")
    return tensor.view(_BITS_VIEW[tensor.element_size()])


def _unpack(bitmap: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 0/1 [n, cols], contiguous: the non-zero mask a bitmap encodes (numpy's C unpacking on CPU,
    a byte -> 8 bits table lookup on other devices)."""
    if bitmap.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bitmap.numpy(), axis=1, count=cols, bitorder="little"))
    return _unpack_by_table(bitmap, cols)


def _unpack_by_table(bitmap: torch.Tensor, cols: int) -> torch.Tensor:
    """`_unpack` with torch ops only (the path of devices numpy cannot see)."""
    _, _, bits_of_byte = _tables(bitmap.device)
    bits = bits_of_byte.index_select(0, bitmap.reshape(-1).int())
    return bits.view(bitmap.shape[0], bitmap.shape[1] * 8)[:, :cols].contiguous()


def _row_popcounts(bitmap: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: set bits per bitmap row, by table lookup of each byte."""
    _, popcount, _ = _tables(bitmap.device)
    per_byte = popcount.index_select(0, bitmap.reshape(-1).int()).view(bitmap.shape)
    return per_byte.sum(1, dtype=torch.int64)


def _row_offsets(bitmap: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(bitmap.shape[0] + 1, dtype=torch.int64, device=bitmap.device)
    torch.cumsum(_row_popcounts(bitmap), 0, out=offsets[1:])
    return offsets


def _row_ids(ids: torch.Tensor, bitmap: torch.Tensor) -> torch.Tensor:
    """`ids` as int64 on the bitmap's device, checked to be 1-D row indices (an unchecked negative id
    would silently wrap, and a uint8 one would index as a mask)."""
    if ids.dim() != 1 or ids.dtype not in _INDEX_DTYPES:
        raise ValueError(f"ids must be a 1-D integer tensor; got {ids.dtype} of shape {tuple(ids.shape)}.")
    rows = bitmap.shape[0]
    ids = ids.to(device=bitmap.device, dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError(f"Row ids must be in [0, {rows}); got {int(ids.min())}..{int(ids.max())}.")
    return ids


def _check_row_count(matrix: EndorMatrix) -> None:
    rows, cols = matrix.shape
    if matrix.bitmap.dim() != 2 or matrix.bitmap.shape[0] != rows:
        raise EndorFormatError(
            f"The Endor bitmap has shape {tuple(matrix.bitmap.shape)}; a [{rows}, {cols}] matrix needs "
            f"[{rows}, {bitmap_row_bytes(cols)}]."
        )


def _check_consistent(bitmap: torch.Tensor, values: torch.Tensor, cols: int) -> None:
    """Raise `EndorFormatError` unless `bitmap` rows of `cols` columns and `values` agree."""
    _check_layout(bitmap, values, cols)
    expected = int(_row_popcounts(bitmap).sum())
    if expected != values.numel():
        raise EndorFormatError(_count_mismatch(bitmap.shape[0], expected, values.numel()))


def _check_layout(bitmap: torch.Tensor, values: torch.Tensor, cols: int) -> None:
    """Raise `EndorFormatError` unless `bitmap` is uint8 [rows, bitmap_row_bytes(cols)] with no bit set
    past `cols`, and `values` is 1-D. Cheap: a look at each row's last byte."""
    width = bitmap_row_bytes(cols)
    if bitmap.dtype != torch.uint8 or bitmap.dim() != 2 or bitmap.shape[1] != width:
        raise EndorFormatError(
            f"An Endor bitmap of {cols} columns is uint8 [rows, {width}]; "
            f"got {bitmap.dtype} of shape {tuple(bitmap.shape)}."
        )
    if values.dim() != 1:
        raise EndorFormatError(f"Endor values are 1-D; got shape {tuple(values.shape)}.")
    rows = bitmap.shape[0]
    if cols % 8 and rows:
        padding = (bitmap[:, -1] >> (cols % 8)) != 0
        if bool(padding.any()):
            row = int(padding.nonzero()[0, 0])
            raise EndorFormatError(
                f"The Endor bitmap of {rows} rows has bits set past column {cols} (first in row {row}): "
                "it is corrupted."
            )


def _count_mismatch(rows: int, expected: int, given: int) -> str:
    return (
        f"The Endor bitmap of {rows} rows marks {expected} non-zeros but {given} values were given: "
        f"{'the values are truncated' if given < expected else 'there are extra values'} "
        "or the bitmap is corrupted."
    )
