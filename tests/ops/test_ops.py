"""The C operators: the column product (`flashlm.ops.columns`), every implementation against a float64
reference, the native kernel's zero skipping, strides and determinism, and the measured choices; the
row dot products (`RowProduct`) likewise; the per-token top-k masks (`flashlm.ops.select`) against a
tie-stable sort."""

from __future__ import annotations

import json

import pytest
import torch

from flashlm.methods.masking import cache_aware_scores, magnitude_topk, topk_mask, union_ids
from flashlm.ops import columns, select
from flashlm.ops.columns import ColumnProduct, RowProduct, native, native_dots, slot_dtype

needs_native = pytest.mark.skipif(
    columns._native_functions() is None, reason="no C compiler here: the native column kernel is not built"
)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def operands(tokens: int, n: int, width: int, dtype: torch.dtype, *, pad: int = 5, zero_rows: int = 0):
    """(out, coef, rows): rows a strided view (row stride width + pad), the first `zero_rows` rows'
    coefficients zero for every token."""
    g = torch.Generator().manual_seed(tokens * 1000 + n)
    rows = torch.randn(n, width + pad, generator=g).to(dtype)[:, :width]
    coef = torch.randn(tokens, n, generator=g)
    coef[:, :zero_rows] = 0
    out = torch.randn(tokens, width, generator=g)
    return out, coef, rows


def reference(out, coef, rows) -> torch.Tensor:
    return (out.double() + coef.double() @ rows.double()).float()


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "n", "width"),
    [(1, 37, 100), (1, 300, 1000), (1, 40, 4000), (3, 300, 1000), (40, 64, 17), (1, 0, 8)],
)
@pytest.mark.exactness
def test_native_matches_the_reference(dtype, tokens, n, width) -> None:
    """Small products on one thread; one token's over short rows split by rows (1 x 300 x 1000), over
    long ones by columns (1 x 40 x 4000), as are several tokens' (3 x 300 x 1000) (`_columns.c`)."""
    out, coef, rows = operands(tokens, n, width, dtype, zero_rows=n // 3)
    expected = reference(out, coef, rows)
    native(out, coef, rows)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@needs_native
def test_native_skips_rows_whose_coefficients_are_all_zero() -> None:
    """A row of NaNs with zero coefficients never reaches the output: it is not read."""
    out, coef, rows = operands(2, 50, 64, torch.float32, zero_rows=10)
    rows[3] = float("nan")
    expected = reference(out, coef[:, 10:], rows[10:])
    native(out, coef, rows)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.parametrize(
    ("tokens", "width"), [(1, 1024), (1, 4096), (3, 1024)], ids=["by-rows", "by-columns", "tokens"]
)
@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.exactness
def test_native_is_the_same_on_any_number_of_threads(tokens, width, indexed) -> None:
    """Bit-identical on 1, 2 and 3 threads, whichever way the product is split between them: one
    token's over short rows by rows (in two fixed halves), others by columns (each output summed over
    its rows in order); with the rows and the coefficients read by index or not."""
    out, coef, rows = operands(tokens, 2048, width, torch.bfloat16, zero_rows=100)
    index = coef_ids = None
    if indexed:
        index = torch.randperm(2048, generator=torch.Generator().manual_seed(3))[:1500].sort().values
        coef_ids = index.flip(0).contiguous()  # unit index[k]'s coefficient is coef[:, coef_ids[k]]

    def run() -> torch.Tensor:
        target = out.clone()
        native(target, coef, rows, index, coef_ids)
        return target

    results = on_thread_counts(run)
    assert all(torch.equal(results[0], r) for r in results[1:])
    used_coef = coef if coef_ids is None else coef[:, coef_ids]
    used_rows = rows if index is None else rows[index]
    torch.testing.assert_close(results[0], reference(out, used_coef, used_rows), rtol=1e-5, atol=1e-4)


def on_thread_counts(run) -> list[torch.Tensor]:
    """`run()`'s results with torch's thread team (which the kernels share) of 1, 2 and 3 threads."""
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(run())
    finally:
        torch.set_num_threads(threads)
    return results


@needs_native
def test_native_rejects_operands_it_cannot_read() -> None:
    out, coef, rows = operands(1, 8, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        native(out.bfloat16(), coef, rows)
    with pytest.raises(ValueError, match="unit column stride"):
        native(out, coef, rows.T.contiguous().T)
    with pytest.raises(ValueError, match="shapes disagree"):
        native(out, coef[:, :4], rows)


@pytest.mark.parametrize("name", ["torch", "torch-fp32"])
def test_torch_paths_match_the_reference(name) -> None:
    out, coef, rows = operands(3, 700, 50, torch.bfloat16)  # 700 rows: several fp32 chunks
    expected = reference(out, coef, rows)
    columns._run(name, out, coef, rows)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-1)  # torch's bf16 path rounds coef


def test_measure_picks_a_timed_implementation_for_each_bucket() -> None:
    product = ColumnProduct.measure(torch.bfloat16, 96, density=0.5)
    for bucket in ("decode", "prefill"):
        timings = product.timings_ms[bucket]
        chosen = getattr(product, bucket)
        assert chosen in timings and timings[chosen] == min(timings.values())
    out, coef, rows = operands(2, 40, 96, torch.bfloat16)
    expected = reference(out, coef, rows)
    product(out, coef, rows)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-1)


def test_without_the_native_kernel_torch_is_measured_alone(monkeypatch) -> None:
    monkeypatch.setattr(columns, "_native_functions", lambda: None)
    columns._measure.cache_clear()
    try:
        product = ColumnProduct.measure(torch.bfloat16, 80)
        assert set(product.timings_ms["decode"]) == {"torch", "torch-fp32"}
    finally:
        columns._measure.cache_clear()


def test_measured_choice_is_remembered_per_machine(monkeypatch, tmp_path) -> None:
    """A later load (a new process: the memo is cleared) reuses the choice without timing anything; a
    damaged file is measured again and rewritten."""
    monkeypatch.setenv("FLASHLM_CACHE", str(tmp_path))
    columns._measure.cache_clear()
    try:
        first = ColumnProduct.measure(torch.bfloat16, 72, density=0.4)
        path = tmp_path / "measurements" / columns.MEASUREMENTS
        assert path.is_file()
        columns._measure.cache_clear()
        with monkeypatch.context() as m:
            m.setattr(columns, "_time", lambda *args, **kwargs: pytest.fail("measured again"))
            assert ColumnProduct.measure(torch.bfloat16, 72, density=0.4) == first
        if columns._native_functions() is not None:  # a changed kernel is measured again
            with monkeypatch.context() as m:
                m.setattr(columns, "source_digest", lambda source: "another kernel")
                columns._measure.cache_clear()
                ColumnProduct.measure(torch.bfloat16, 72, density=0.4)
            assert len(json.loads(path.read_text())) == 2
        path.write_text("{not json")
        columns._measure.cache_clear()
        assert ColumnProduct.measure(torch.bfloat16, 72, density=0.4).decode in first.timings_ms["decode"]
        assert len(json.loads(path.read_text())) == 1
    finally:
        columns._measure.cache_clear()


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("read", [True, False], ids=["cached-and-read", "cached-only"])
@pytest.mark.exactness
def test_token_columns_round_the_kernels_sum_and_compute_the_glu(dtype, read) -> None:
    """A decode stage in C (`TokenColumns`): the cached rows by their unit ids, then the rows read, in
    place; the column kernel's sum rounded as `.to(dtype)` rounds it, exactly; and the GLU of its halves,
    `up * silu(gate)` as torch computes it on the rounded halves, up to the last bit of SiLU's exp."""
    units, width = 200, 96
    g = torch.Generator().manual_seed(7)
    matrix = torch.randn(units, width, generator=g).to(dtype)  # a staging matrix: unit i at row i
    order = torch.randperm(units, generator=g)
    cached_ids, read_ids = order[:120], order[120:].sort().values
    cached_rows = matrix[cached_ids].clone()  # cache slots, in slot order
    coef = torch.randn(1, units, generator=g) * (torch.rand(1, units, generator=g) < 0.6)
    expected = torch.zeros(1, width)
    native(expected, coef, cached_rows, None, cached_ids)
    if read:
        native(expected, coef, matrix, read_ids, read_ids)
    rounded, half = expected.to(dtype), width // 2
    token = columns.TokenColumns(width, dtype)
    for glu in (False, True, False):  # each call starts its sum afresh
        if read:
            token.add(coef, cached_rows, cached_ids, start=True)
            out = token.result(coef, matrix, read_ids, read_ids, start=False, glu=glu)
        else:
            out = token.result(coef, cached_rows, cached_ids, start=True, glu=glu)
        if not glu:
            assert torch.equal(out, rounded)
            continue
        reference = rounded[:, :half] * torch.nn.functional.silu(rounded[:, half:])
        assert out.shape == reference.shape and out.dtype == dtype
        torch.testing.assert_close(out, reference, rtol=torch.finfo(dtype).eps, atol=1e-6)
        if dtype != torch.float32:  # each step rounded as torch rounds it: the rest agrees bit for bit
            assert (out != reference).float().mean() < 0.02


@needs_native
def test_token_columns_serve_one_token_of_their_dtype_and_reject_bad_ids() -> None:
    token = columns.TokenColumns(8, torch.bfloat16)
    rows = torch.randn(4, 8).bfloat16()
    assert token.serves(torch.randn(1, 4), rows)
    assert not token.serves(torch.randn(2, 4), rows)  # two tokens: torch's path
    assert not token.serves(torch.randn(1, 4), rows.float())
    with pytest.raises(IndexError, match="unit ids"):
        token.result(torch.randn(1, 4), rows, torch.tensor([0, 1, 2, 4]), start=True, glu=False)


def test_slot_dtype_is_the_stores_or_float32() -> None:
    assert slot_dtype(torch.float32, 64) == torch.float32
    assert slot_dtype(torch.bfloat16, 64) in (torch.bfloat16, torch.float32)


# ---- per-token top-k masks (flashlm.ops.select) ----------------------------------------------------

needs_select = pytest.mark.skipif(
    select._functions() is None, reason="no C compiler here: the selection kernel is not built"
)


def reference_topk(x: torch.Tensor, k: int, resident: torch.Tensor | None, gamma: float) -> torch.Tensor:
    """The k largest |x| * weight of each row by `masking.topk_mask` (ties to the lowest index)."""
    scores = x.float().abs() * (1.0 if resident is None else torch.where(resident, 1.0, gamma))
    return topk_mask(scores, k)


@needs_select
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "n", "k"), [(1, 1536, 922), (7, 300, 1), (5, 64, 64), (3, 40, 0), (2, 9, 4)]
)
@pytest.mark.parametrize("gamma", [1.0, 0.2, 0.0])
@pytest.mark.exactness
def test_topk_mask_is_the_tie_stable_top_k(dtype, tokens, n, k, gamma) -> None:
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(tokens, n, generator=g).to(dtype)
    x[:, : n // 4] = x[:, n // 4 : 2 * (n // 4)]  # plenty of exact ties
    resident = None if gamma == 1 else torch.rand(n, generator=g) < 0.5
    mask = select.topk_mask(x, k, resident, gamma)
    assert torch.equal(mask, reference_topk(x, k, resident, gamma))
    assert bool((mask.sum(-1) == k).all())


@needs_select
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(1536, 922), (300, 1), (64, 64), (40, 0)])
@pytest.mark.parametrize("gamma", [1.0, 0.2, 0.0])
@pytest.mark.exactness
def test_top_units_is_the_selection_its_ids_lookup_and_coefficients(dtype, n, k, gamma) -> None:
    """One call gives what `topk_mask`, `union_ids`, a cache lookup and `(x * mask).float()` give, step
    after step in the same buffers."""
    top_units = select.TopUnits(n)
    g = torch.Generator().manual_seed(n + k)
    for _ in range(3):
        x = torch.randn(1, n, generator=g).to(dtype)
        x[:, : n // 4] = x[:, n // 4 : 2 * (n // 4)]  # plenty of exact ties
        slot_of = torch.where(torch.rand(n, generator=g) < 0.5, torch.arange(n), -1)
        resident = slot_of >= 0
        mask, coef, ids, miss_ids, unread = top_units(x, k, slot_of, gamma)
        assert unread is None  # not asked for
        expected = reference_topk(x, k, None if gamma == 1 else resident, gamma)
        assert torch.equal(mask, expected)
        assert torch.equal(ids, union_ids(expected))
        assert torch.equal(miss_ids, ids[~resident[ids]])
        assert torch.equal(coef, (x * expected).float())


@needs_select
@pytest.mark.parametrize("gamma", [1.0, 0.2])
@pytest.mark.exactness
def test_top_units_count_also_resident_units_as_resident_but_not_as_hits(gamma) -> None:
    """Units read by other means (a guess) weigh as resident in the selection; the misses are still the
    kept units the cache lacks, and those the other means did not read either are written where asked
    (after a guess's own ids, in its buffer), never past the room given."""
    n, k = 300, 120
    top_units = select.TopUnits(n)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, n, generator=g).bfloat16()
    slot_of = torch.where(torch.rand(n, generator=g) < 0.3, torch.arange(n), -1)
    also = torch.rand(n, generator=g) < 0.3
    span = torch.full((n,), -7)
    mask, coef, ids, miss_ids, unread = top_units(x, k, slot_of, gamma, also, span[5:])
    expected = reference_topk(x, k, None if gamma == 1 else (slot_of >= 0) | also, gamma)
    assert torch.equal(mask, expected)
    assert torch.equal(ids, union_ids(expected))
    assert torch.equal(miss_ids, ids[slot_of[ids] < 0])
    assert torch.equal(coef, (x * expected).float())
    expected_unread = miss_ids[~also[miss_ids]]
    assert 0 < expected_unread.numel() < miss_ids.numel()
    assert torch.equal(unread, expected_unread)
    assert unread.data_ptr() == span[5:].data_ptr()
    assert torch.equal(span[:5], torch.full((5,), -7))
    assert torch.equal(span[5 + unread.numel() :], torch.full((n - 5 - unread.numel(),), -7))
    room = torch.full((expected_unread.numel(),), -7)
    with pytest.raises(ValueError, match="fewer than the units left to read"):
        top_units(x, k, slot_of, gamma, also, room[:-1])
    assert torch.equal(room[-1:], torch.tensor([-7]))  # nothing written past the room given
    with pytest.raises(ValueError, match="also_resident"):
        top_units(x, k, slot_of, gamma, also[:10])
    with pytest.raises(ValueError, match="unread_into"):
        top_units(x, k, slot_of, gamma, also, span[::2])


@needs_select
def test_top_units_declines_what_it_cannot_serve_and_rejects_bad_arguments() -> None:
    top_units = select.TopUnits(8)
    slot_of = torch.full((8,), -1)
    assert top_units(torch.randn(2, 8), 3, slot_of) is None  # two tokens: the general path
    assert top_units(torch.randn(1, 16)[:, ::2], 3, slot_of) is None  # strided
    assert top_units(torch.randn(1, 8).to(torch.int32), 3, slot_of) is None
    with pytest.raises(ValueError, match="k must be"):
        top_units(torch.randn(1, 8), 9, slot_of)
    with pytest.raises(ValueError, match="slot_of"):
        top_units(torch.randn(1, 8), 3, slot_of[:4])


@needs_select
def test_magnitude_topk_is_equation_10s_selection_without_ties() -> None:
    """Leaving out eq. 10's division by max|x| keeps the same units (distinct fp32 magnitudes)."""
    x = torch.randn(4, 500, generator=torch.Generator().manual_seed(2))
    resident = torch.rand(500, generator=torch.Generator().manual_seed(3)) < 0.3
    expected = topk_mask(cache_aware_scores(x, resident, 0.2), 123)
    assert torch.equal(magnitude_topk(x, 123, resident, 0.2), expected)


@pytest.mark.parametrize("gamma", [1.0, 0.5, 0.0])
def test_magnitude_topk_is_the_same_without_the_c_kernel(monkeypatch, gamma) -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).bfloat16()  # bf16: ties
    resident = torch.rand(64, generator=torch.Generator().manual_seed(5)) < 0.5
    fast = magnitude_topk(x, 20, resident, gamma)
    monkeypatch.setattr(select, "_functions", lambda: None)
    assert torch.equal(magnitude_topk(x, 20, resident, gamma), fast)


@needs_native
@pytest.mark.parametrize("name", ["native", "torch", "torch-fp32"])
def test_indexed_rows_are_read_where_they_lie(name) -> None:
    """`coef @ rows[index]`: the native kernel reads the indexed rows in place, torch gathers them."""
    out, coef, rows = operands(2, 200, 96, torch.bfloat16)
    index = torch.nonzero(torch.rand(200, generator=torch.Generator().manual_seed(7)) < 0.4).squeeze(1)
    coef = coef[:, : index.numel()].contiguous()
    expected = reference(out, coef, rows[index])
    product = ColumnProduct(decode=name, prefill=name, timings_ms={})
    product(out, coef, rows, index)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-1)


@needs_native
@pytest.mark.parametrize("name", ["native", "torch", "torch-fp32"])
@pytest.mark.parametrize("indexed_rows", [False, True])
def test_coefficients_are_read_by_unit_id(name, indexed_rows) -> None:
    """`coef[:, coef_ids] @ rows[index]`: a layer's coefficients by unit id, never gathered by the kernel."""
    g = torch.Generator().manual_seed(11)
    out, coef, rows = operands(2, 300, 64, torch.bfloat16)
    units = torch.nonzero(torch.rand(300, generator=g) < 0.3).squeeze(1)  # the units this part holds
    coef[:, units[::4]] = 0  # some of them kept by no token: skipped
    index = units if indexed_rows else None
    part = rows if indexed_rows else rows[units].contiguous()
    expected = reference(out, coef[:, units], rows[units])
    product = ColumnProduct(decode=name, prefill=name, timings_ms={})
    product(out, coef, part, index, units)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-1)


@needs_native
def test_coefficient_ids_outside_the_coefficients_are_refused() -> None:
    out, coef, rows = operands(1, 8, 16, torch.float32)
    with pytest.raises(IndexError, match="coef_ids"):
        native(out, coef, rows, coef_ids=torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]))
    with pytest.raises(ValueError, match="shapes disagree"):
        native(out, coef, rows, coef_ids=torch.tensor([0, 1]))


# ---- row dot products ------------------------------------------------------------------------------


def row_operands(tokens: int, n: int, width: int, dtype: torch.dtype):
    """(x, rows, index): rows a slice of wider rows (as a bundle's gate half is), index unsorted with a
    repeat."""
    g = torch.Generator().manual_seed(tokens * 1000 + n + width)
    rows = torch.randn(n, 3 * width, generator=g).to(dtype)[:, width : 2 * width]
    x = torch.randn(tokens, width, generator=g)
    index = torch.randint(0, max(n, 1), (max(n - 3, 0),), generator=g)
    return x, rows, index


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "n", "width"), [(1, 37, 100), (3, 300, 1000), (2, 64, 17), (1, 0, 8)])
@pytest.mark.exactness
def test_native_dots_match_the_reference(dtype, tokens, n, width) -> None:
    x, rows, index = row_operands(tokens, n, width, dtype)
    out = torch.full((tokens, index.numel()), float("nan"))
    native_dots(out, x, rows, index)
    expected = (x.double() @ rows[index].double().T).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    whole = torch.empty(tokens, n)
    native_dots(whole, x, rows, None)
    torch.testing.assert_close(whole, (x.double() @ rows.double().T).float(), rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.exactness
def test_native_dots_are_the_same_on_any_number_of_threads() -> None:
    x, rows, index = row_operands(1, 4096, 512, torch.bfloat16)

    def run() -> torch.Tensor:
        out = torch.empty(1, index.numel())
        native_dots(out, x, rows, index)
        return out

    results = on_thread_counts(run)
    assert all(torch.equal(results[0], r) for r in results[1:])


@needs_native
def test_native_dots_reject_operands_they_cannot_read() -> None:
    x, rows, index = row_operands(1, 8, 16, torch.bfloat16)
    out = torch.empty(1, index.numel())
    with pytest.raises(ValueError, match="float32"):
        native_dots(out, x.bfloat16(), rows, index)
    with pytest.raises(ValueError, match="shapes agreeing"):
        native_dots(out[:, :2], x, rows, index)
    with pytest.raises(ValueError, match="unit column stride"):
        native_dots(out, x, rows.T.contiguous().T, index)
    with pytest.raises(ValueError, match="int64"):
        native_dots(out, x, rows, index.int())


@pytest.mark.parametrize("name", [pytest.param("native", marks=needs_native), "torch"])
@pytest.mark.parametrize("tokens", [1, 40])  # a prompt's tokens always take torch's product
def test_row_product_rounds_as_f_linear_does(name, tokens) -> None:
    x, rows, index = row_operands(tokens, 200, 96, torch.bfloat16)
    x = x.bfloat16()
    result = RowProduct(name, {})(x, rows, index)
    assert result.dtype == torch.bfloat16 and result.shape == (tokens, index.numel())
    expected = torch.nn.functional.linear(x, rows[index])  # fp32 sums, rounded once to bf16
    torch.testing.assert_close(result, expected, rtol=1e-2, atol=1e-2)


def test_row_product_measure_picks_the_faster_and_remembers_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FLASHLM_CACHE", str(tmp_path))
    columns._measure_rows.cache_clear()
    try:
        product = RowProduct.measure(torch.bfloat16, 64, 100)
        expected = {"torch", "native"} if columns._native_functions() is not None else {"torch"}
        assert set(product.timings_ms) == expected
        assert product.timings_ms[product.decode] == min(product.timings_ms.values())
        columns._measure_rows.cache_clear()
        monkeypatch.setattr(columns, "_time", lambda *args, **kwargs: pytest.fail("measured again"))
        assert RowProduct.measure(torch.bfloat16, 64, 100) == product
    finally:
        columns._measure_rows.cache_clear()
