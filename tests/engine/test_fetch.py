"""A fetch's rows on another device: only the rows read cross."""

from __future__ import annotations

import pytest
import torch

from flashlm.engine.runtime import WHOLE_COPY_BYTES, Fetch, copy_rows, crosses_whole, run_bounds
from flashlm.store import ALIGNMENT
from flashlm.store.reader import row_matrix


@pytest.mark.parametrize(
    "ids",
    [[], [5], [3, 4, 5, 6], [6, 5, 3, 4], [0, 2, 7], [7, 1, 2]],
    ids=["none", "one", "run", "run-unordered", "scattered", "scattered-unordered"],
)
def test_copy_rows_moves_exactly_the_rows_named(ids: list[int]) -> None:
    source = torch.arange(8 * 3, dtype=torch.bfloat16).view(8, 3) + 1
    target = torch.zeros_like(source)
    ids_tensor = torch.tensor(ids, dtype=torch.int64)
    copy_rows(target, source, ids_tensor, run_bounds(ids_tensor))
    named = torch.zeros(8, dtype=torch.bool)
    named[ids] = True
    assert torch.equal(target[named], source[named])
    assert not target[~named].any()  # the rows not read stay as they were


def test_a_fetch_on_its_own_device_is_itself() -> None:
    fetch = Fetch(torch.tensor([1]), torch.ones(4, 2), 16, 1, 0.0)
    assert fetch.to(torch.device("cpu")) is fetch


@pytest.mark.parametrize(
    ("rows", "ids", "whole"),
    [
        (16, [2, 9], True),  # scattered rows of a small matrix cross with the whole of it
        (16, [2, 3], False),  # a run crosses as one slice
        (4096, [7], False),  # one row of a large matrix crosses alone
        (4096, list(range(1000, 4096)), False),  # a run, however long
        (4096, list(range(0, 4096, 2)), True),  # half the rows, scattered: the whole is cheaper
        (4096, list(range(0, 4096, 3)), False),  # a third, scattered: the rows are
    ],
)
def test_rows_cross_whole_only_where_one_copy_of_the_matrix_is_cheaper(rows, ids, whole) -> None:
    matrix = torch.empty(rows, 1024, dtype=torch.bfloat16)
    assert (matrix.nbytes <= WHOLE_COPY_BYTES) == (rows == 16)
    assert crosses_whole(matrix, torch.tensor(ids), run_bounds(torch.tensor(ids))) == whole
    assert not crosses_whole(matrix, torch.tensor([], dtype=torch.int64), None)


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("whole", [False, True], ids=["rows", "whole"])
def test_a_fetch_moved_to_the_gpu_holds_its_rows(pinned: bool, whole: bool) -> None:
    rows = 16 if whole else 4096
    matrix = row_matrix(rows, 1024, torch.bfloat16, pinned=pinned).copy_(torch.randn(rows, 1024))
    ids = torch.tensor([2, 3, 4, 9, 11])
    moved = Fetch(ids, matrix, 0, 0, 0.0).to(torch.device("cuda"))
    assert moved.matrix.device.type == "cuda" and moved.ids.device.type == "cuda"
    assert torch.equal(moved.matrix[ids.cuda()].cpu(), matrix[ids])
    others = torch.ones(rows, dtype=torch.bool)
    others[ids] = False
    # crossed whole, the other rows are the staging matrix's; crossed alone, zeros
    expected = matrix[others] if whole else torch.zeros_like(matrix[others])
    assert torch.equal(moved.matrix.cpu()[others], expected)


@pytest.mark.gpu
def test_pinned_staging_is_page_aligned_and_its_storage_is_the_whole_block_taken() -> None:
    matrix = row_matrix(1000, 576, torch.bfloat16, pinned=True)
    assert matrix.is_pinned() and matrix.data_ptr() % ALIGNMENT == 0
    taken = matrix.untyped_storage().nbytes()
    assert taken >= matrix.numel() * 2 + ALIGNMENT and taken & (taken - 1) == 0  # a power-of-two block
