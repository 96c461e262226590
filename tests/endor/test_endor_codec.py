"""The Endor codec: bit-exact round trips over shapes, dtypes, sparsities and raw bit patterns (NaN,
-0.0), the bitmap against a literal Algorithm 1, the paper's compression ratio, subset loads by row,
corrupted inputs, and CUDA against CPU."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlm.endor import codec, kernel
from flashlm.endor.codec import (
    SUPPORTED_DTYPES,
    EndorMatrix,
    bitmap_row_bytes,
    compress,
    compressed_nbytes,
    compression_ratio,
    decompress,
    decompress_rows,
    select_rows,
    value_ranges,
)
from flashlm.errors import EndorFormatError, StoreCorruptError

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as same-size integers: compare these with `torch.equal`, so NaN and -0.0 count."""
    return tensor.view(_BITS[tensor.element_size()])


def make_weight(
    seed: int,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    sparsity: float,
    *,
    raw: bool = False,
    zero_row: bool = False,
    full_row: bool = False,
) -> torch.Tensor:
    """A [rows, cols] weight whose elements are zero (all bits) with probability `sparsity`.

    Non-zeros are normal draws in `dtype` (or uniform bytes for integer dtypes), or with `raw` uniform
    random bit patterns, so NaN, inf and -0.0 appear. `zero_row` zeroes row 0; `full_row` makes the
    last row all non-zero.
    """
    g = torch.Generator().manual_seed(seed)
    int_dtype = _BITS[dtype.itemsize]
    if raw or not dtype.is_floating_point:
        random_bytes = torch.randint(0, 256, (rows, cols, dtype.itemsize), generator=g, dtype=torch.uint8)
        pattern = random_bytes.view(int_dtype)[..., 0]
    else:
        pattern = bits(torch.randn(rows, cols, generator=g).to(dtype))
    pattern = torch.where(torch.rand(rows, cols, generator=g) < sparsity, 0, pattern).to(int_dtype)
    if zero_row:
        pattern[0] = 0
    if full_row:
        pattern[-1] = torch.where(pattern[-1] == 0, 1, pattern[-1]).to(int_dtype)
    return pattern.view(dtype)


def half_sparse(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Exactly cols / 2 non-zeros per row at random positions (Wanda's per-output pruning)."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(rows, cols, generator=g).argsort(1) < cols // 2
    if dtype.is_floating_point:
        values = torch.randn(rows, cols, generator=g).to(dtype)
        values = torch.where(values == 0, 1, values).to(dtype)
    else:
        values = torch.randint(1, 128, (rows, cols), generator=g).to(dtype)
    # torch.where, not multiplication: negative values times 0 are -0.0, a non-zero bit pattern.
    return torch.where(keep, values, torch.zeros((), dtype=dtype))


def reference_bitmap(weight: torch.Tensor) -> list[list[int]]:
    """Algorithm 1's binary position array, row by row, packed LSB first: the format's spec, literally."""
    packed = []
    for row in bits(weight).tolist():
        b = [1 if x != 0 else 0 for x in row]
        b += [0] * (-len(b) % 8)
        packed.append([sum(bit << k for k, bit in enumerate(b[i : i + 8])) for i in range(0, len(b), 8)])
    return packed


# ---- the two CPU decompressions: the C kernel and the torch gather -------------------------------

needs_kernel = pytest.mark.skipif(
    kernel.cpu_kernel() is None, reason="no C compiler here: the Endor C kernel is not built"
)


MATRICES = {
    "seed": st.integers(0, 2**31 - 1),
    "rows": st.integers(1, 40),
    "cols": st.integers(1, 70),
    "sparsity": st.floats(0.0, 1.0),
}
"""The random weight matrices the property tests draw (`make_weight`'s arguments)."""


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(
    **MATRICES,
    dtype=st.sampled_from((*DTYPES, torch.float64)),
    empty_tail=st.integers(0, 3),
)
def test_c_kernel_and_torch_gather_agree(seed, rows, cols, dtype, sparsity, empty_tail) -> None:
    """Both paths are bit-exact, also where a row's values end the array (the kernel's checked path)."""
    weight = make_weight(seed, rows, cols, dtype, sparsity, raw=True)
    weight[rows - min(empty_tail, rows) :] = 0
    matrix = compress(weight)
    with patch.object(codec, "cpu_kernel", lambda: None):
        by_torch = decompress(matrix)
    assert torch.equal(bits(decompress(matrix)), bits(weight))
    assert torch.equal(bits(by_torch), bits(weight))


@needs_kernel
def test_c_kernel_splits_large_matrices_over_threads() -> None:
    weight = half_sparse(700, 300, torch.bfloat16)  # above PARALLEL_MIN_ELEMENTS
    weight[-5:] = 0
    assert weight.numel() >= kernel.PARALLEL_MIN_ELEMENTS
    assert torch.equal(bits(decompress(compress(weight))), bits(weight))
    with pytest.raises(EndorFormatError, match="truncated"):
        matrix = compress(weight)
        decompress(EndorMatrix(matrix.bitmap, matrix.values[:-1], matrix.shape))


# ---- round trips ---------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    **MATRICES,
    dtype=st.sampled_from(DTYPES),
    raw=st.booleans(),
    zero_row=st.booleans(),
    full_row=st.booleans(),
)
def test_round_trip_is_bit_exact(seed, rows, cols, dtype, sparsity, raw, zero_row, full_row) -> None:
    weight = make_weight(seed, rows, cols, dtype, sparsity, raw=raw, zero_row=zero_row, full_row=full_row)
    matrix = compress(weight)
    matrix.validate()

    nonzero = bits(weight) != 0
    assert matrix.shape == (rows, cols)
    assert matrix.bitmap.dtype == torch.uint8
    assert matrix.bitmap.shape == (rows, bitmap_row_bytes(cols))
    assert matrix.bitmap.tolist() == reference_bitmap(weight)
    assert matrix.dtype == dtype
    assert matrix.nnz == int(nonzero.sum())
    assert torch.equal(bits(matrix.values), bits(weight)[nonzero])  # row-major, as Algorithm 1 appends
    assert matrix.nbytes == compressed_nbytes(rows, cols, matrix.nnz, dtype)
    assert matrix.dense_nbytes == rows * cols * dtype.itemsize
    assert torch.equal(matrix.row_offsets()[1:], torch.cumsum(nonzero.sum(1), 0))

    assert torch.equal(bits(decompress(matrix)), bits(weight))
    garbage = torch.full((rows, cols), 7, dtype=torch.int8 if dtype == torch.int8 else torch.float32).to(
        dtype
    )
    out = decompress(matrix, out=garbage)
    assert out is garbage
    assert torch.equal(bits(out), bits(weight))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_every_supported_dtype_round_trips(dtype: torch.dtype) -> None:
    weight = make_weight(0, 9, 21, dtype, 0.4, raw=True, zero_row=True, full_row=True)
    assert torch.equal(bits(decompress(compress(weight))), bits(weight))


def test_nan_and_negative_zero_are_non_zeros() -> None:
    weight = torch.tensor([[0.0, -0.0, float("nan"), 1.0]], dtype=torch.bfloat16)
    matrix = compress(weight)
    assert matrix.bitmap.tolist() == [[0b1110]]
    assert matrix.nnz == 3
    assert torch.equal(bits(decompress(matrix)), bits(weight))


def test_bit_order_is_lsb_first() -> None:
    weight = torch.zeros(2, 10, dtype=torch.float16)
    weight[0, 1], weight[0, 8], weight[1, 7] = 1.5, -2.0, 3.0
    matrix = compress(weight)
    assert matrix.bitmap.tolist() == [[0b0000_0010, 0b01], [0b1000_0000, 0]]
    assert matrix.values.tolist() == [1.5, -2.0, 3.0]
    assert matrix.row_offsets().tolist() == [0, 2, 3]


@pytest.mark.parametrize("cols", [1, 7, 8, 13, 64])
def test_table_unpacking_equals_numpy_unpacking(cols: int) -> None:
    """The torch-only unpacking that devices other than the CPU use agrees with numpy's."""
    bitmap = torch.randint(0, 256, (9, codec.bitmap_row_bytes(cols)), dtype=torch.uint8)
    if cols % 8:
        bitmap[:, -1] &= (1 << (cols % 8)) - 1
    assert torch.equal(codec._unpack_by_table(bitmap, cols), codec._unpack(bitmap, cols))


def test_non_contiguous_weight_compresses_in_its_logical_order() -> None:
    weight = make_weight(1, 24, 17, torch.bfloat16, 0.5).t()
    assert not weight.is_contiguous()
    assert torch.equal(bits(decompress(compress(weight))), bits(weight.contiguous()))


def test_empty_matrices() -> None:
    for shape in [(0, 12), (5, 0)]:
        matrix = compress(torch.zeros(shape, dtype=torch.bfloat16))
        matrix.validate()
        assert matrix.nnz == 0 and matrix.ratio == 1.0
        assert decompress(matrix).shape == shape


def test_to_moves_both_tensors_and_stays_compressed() -> None:
    matrix = compress(half_sparse(8, 16, torch.bfloat16))
    moved = matrix.to("cpu")
    assert isinstance(moved, EndorMatrix) and moved.device.type == "cpu"
    assert moved.nbytes == matrix.nbytes and moved.shape == matrix.shape
    assert torch.equal(bits(decompress(moved)), bits(decompress(matrix)))


# ---- compression ratio -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "ratio"), [(torch.bfloat16, 0.5625), (torch.float16, 0.5625), (torch.int8, 0.625)], ids=str
)
def test_half_sparse_matrix_compresses_to_the_papers_ratio(dtype: torch.dtype, ratio: float) -> None:
    """The paper's OPT-66B figure: 50% sparse fp16 goes to 56% of its dense size."""
    matrix = compress(half_sparse(64, 128, dtype))
    assert matrix.nnz == 64 * 64
    assert matrix.ratio == ratio
    assert compression_ratio(0.5, dtype) == ratio


def test_compression_ratio_formula() -> None:
    assert compression_ratio(0.5, torch.float32) == 0.53125
    assert compression_ratio(0.0, torch.bfloat16) == 1.0625  # dense plus the bitmap
    assert compression_ratio(1.0, torch.int8) == 0.125  # the bitmap alone
    with pytest.raises(ValueError, match="sparsity"):
        compression_ratio(1.5, torch.bfloat16)


# ---- subsets of rows -------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    **MATRICES,
    dtype=st.sampled_from(DTYPES),
    picks=st.lists(st.integers(0, 10**6), max_size=50),
)
def test_select_rows_decompresses_to_the_dense_rows(seed, rows, cols, dtype, sparsity, picks) -> None:
    weight = make_weight(seed, rows, cols, dtype, sparsity, raw=True, zero_row=True)
    matrix = compress(weight)
    ids = torch.tensor([p % rows for p in picks], dtype=torch.int64)  # any order, repeats allowed

    bitmap_rows, values = select_rows(matrix, ids)
    assert torch.equal(bitmap_rows, matrix.bitmap[ids])
    assert torch.equal(bits(decompress_rows(bitmap_rows, values, cols)), bits(weight[ids]))

    starts, ends = value_ranges(matrix.bitmap, ids)
    offsets = matrix.row_offsets()
    assert starts.dtype == ends.dtype == torch.int64
    assert torch.equal(starts, offsets[ids]) and torch.equal(ends, offsets[ids + 1])
    assert values.numel() == int((ends - starts).sum())


def test_select_rows_by_int32_ids() -> None:
    weight = half_sparse(12, 20, torch.bfloat16)
    matrix = compress(weight)
    ids = torch.tensor([11, 0, 5], dtype=torch.int32)
    bitmap_rows, values = select_rows(matrix, ids)
    assert torch.equal(bits(decompress_rows(bitmap_rows, values, 20)), bits(weight[ids.long()]))


def test_bad_ids_are_rejected() -> None:
    matrix = compress(half_sparse(4, 16, torch.bfloat16))
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        value_ranges(matrix.bitmap, torch.tensor([4]))
    with pytest.raises(IndexError):
        select_rows(matrix, torch.tensor([-1]))
    with pytest.raises(ValueError, match="integer"):
        value_ranges(matrix.bitmap, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="1-D"):
        select_rows(matrix, torch.tensor([[0]]))


# ---- inconsistent inputs ---------------------------------------------------------------------------


@pytest.fixture
def matrix() -> EndorMatrix:
    return compress(make_weight(3, 6, 13, torch.bfloat16, 0.5, zero_row=True, full_row=True))


def test_format_error_is_a_store_corruption_and_a_value_error() -> None:
    assert issubclass(EndorFormatError, StoreCorruptError)
    assert issubclass(EndorFormatError, ValueError)


def test_truncated_values_are_rejected(matrix: EndorMatrix) -> None:
    short = EndorMatrix(matrix.bitmap, matrix.values[:-1], matrix.shape)
    message = rf"6 rows marks {matrix.nnz} non-zeros but {matrix.nnz - 1} values.*truncated"
    with pytest.raises(EndorFormatError, match=message):
        decompress(short)
    with pytest.raises(EndorFormatError, match=message):
        short.validate()
    with pytest.raises(EndorFormatError, match=message):
        decompress_rows(matrix.bitmap, matrix.values[:-1], 13)


def test_extra_value_is_rejected(matrix: EndorMatrix) -> None:
    values = torch.cat([matrix.values, matrix.values[:1]])
    with pytest.raises(EndorFormatError, match=rf"marks {matrix.nnz} non-zeros but {matrix.nnz + 1} values"):
        decompress(EndorMatrix(matrix.bitmap, values, matrix.shape))


def test_padding_bit_is_rejected(matrix: EndorMatrix) -> None:
    bitmap = matrix.bitmap.clone()
    bitmap[2, -1] |= 0b1000_0000  # column 15 of a 13-column row
    corrupt = EndorMatrix(bitmap, matrix.values, matrix.shape)
    with pytest.raises(EndorFormatError, match=r"past column 13.*row 2"):
        corrupt.validate()
    with pytest.raises(EndorFormatError, match="past column 13"):
        decompress(corrupt)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda m: EndorMatrix(m.bitmap[:-1], m.values, m.shape),  # a row missing
        lambda m: EndorMatrix(torch.cat([m.bitmap, m.bitmap[:, :1]], 1), m.values, m.shape),  # too wide
        lambda m: EndorMatrix(m.bitmap.view(-1), m.values, m.shape),  # flat
        lambda m: EndorMatrix(m.bitmap.to(torch.int16), m.values, m.shape),  # not uint8
        lambda m: EndorMatrix(m.bitmap, m.values, (m.shape[0], m.shape[1] + 8)),  # shape disagrees
        lambda m: EndorMatrix(m.bitmap, m.values[None], m.shape),  # values not 1-D
    ],
    ids=["short", "wide", "flat", "int16", "shape", "2-D values"],
)
def test_wrong_layout_is_rejected(matrix: EndorMatrix, corrupt) -> None:
    bad = corrupt(matrix)
    with pytest.raises(EndorFormatError):
        bad.validate()
    with pytest.raises(EndorFormatError):
        decompress(bad)


def test_bad_out_is_rejected(matrix: EndorMatrix) -> None:
    for out in [torch.empty(6, 14, dtype=torch.bfloat16), torch.empty(6, 13, dtype=torch.float16)]:
        with pytest.raises(ValueError, match="out is"):
            decompress(matrix, out=out)


@pytest.mark.parametrize("shape", [(8,), (2, 3, 4), ()])
def test_compress_needs_a_2d_weight(shape) -> None:
    with pytest.raises(ValueError, match="2-D"):
        compress(torch.ones(shape))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.complex64], ids=str)
def test_unsupported_dtype_is_rejected(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="supported"):
        compress(torch.ones(2, 8, dtype=dtype))


# ---- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.gpu
class TestCuda:
    """The same torch ops on the device give the CPU's bytes."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_compress_and_decompress_match_cpu(self, dtype: torch.dtype) -> None:
        weight = make_weight(5, 96, 333, dtype, 0.5, raw=True, zero_row=True, full_row=True)
        on_cpu = compress(weight)
        on_gpu = compress(weight.cuda())
        assert on_gpu.device.type == "cuda" and on_gpu.values.device.type == "cuda"
        assert torch.equal(on_gpu.bitmap.cpu(), on_cpu.bitmap)
        assert torch.equal(bits(on_gpu.values.cpu()), bits(on_cpu.values))
        on_gpu.validate()

        dense = decompress(on_gpu)
        assert dense.device.type == "cuda"
        assert torch.equal(bits(dense.cpu()), bits(weight))

        moved = decompress(on_cpu, device="cuda")  # compressed bytes cross, decompressed on the device
        assert moved.device.type == "cuda" and torch.equal(bits(moved.cpu()), bits(weight))
        out = torch.empty(96, 333, dtype=dtype, device="cuda")
        assert decompress(on_cpu, device="cuda", out=out) is out

    def test_subsets_and_errors_on_device(self) -> None:
        weight = make_weight(6, 64, 70, torch.bfloat16, 0.5)
        matrix = compress(weight).to("cuda")
        ids = torch.tensor([63, 0, 17, 17], device="cuda")
        offsets = matrix.row_offsets()
        assert offsets.device.type == "cuda"
        assert torch.equal(offsets.cpu(), compress(weight).row_offsets())
        starts, ends = value_ranges(matrix.bitmap, ids)
        assert torch.equal(starts, offsets[ids]) and torch.equal(ends, offsets[ids + 1])
        bitmap_rows, values = select_rows(matrix, ids)
        assert torch.equal(bits(decompress_rows(bitmap_rows, values, 70).cpu()), bits(weight[ids.cpu()]))
        with pytest.raises(EndorFormatError, match="truncated"):
            decompress_rows(matrix.bitmap, matrix.values[:-1], 70)
