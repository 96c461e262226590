"""A fetch's rows on another device: only the rows read cross."""

from __future__ import annotations

import pytest
import torch

from flashlm.engine.runtime import Fetch, copy_rows


@pytest.mark.parametrize(
    "ids",
    [[], [5], [3, 4, 5, 6], [6, 5, 3, 4], [0, 2, 7], [7, 1, 2]],
    ids=["none", "one", "run", "run-unordered", "scattered", "scattered-unordered"],
)
def test_copy_rows_moves_exactly_the_rows_named(ids: list[int]) -> None:
    source = torch.arange(8 * 3, dtype=torch.bfloat16).view(8, 3) + 1
    target = torch.zeros_like(source)
    copy_rows(target, source, torch.tensor(ids, dtype=torch.int64))
    named = torch.zeros(8, dtype=torch.bool)
    named[ids] = True
    assert torch.equal(target[named], source[named])
    assert not target[~named].any()  # the rows not read stay as they were


def test_a_fetch_on_its_own_device_is_itself() -> None:
    fetch = Fetch(torch.tensor([1]), torch.ones(4, 2), 16, 1, 0.0)
    assert fetch.to(torch.device("cpu")) is fetch


@pytest.mark.gpu
def test_a_fetch_moved_to_the_gpu_holds_its_rows_and_zeros_elsewhere() -> None:
    matrix = torch.randn(16, 8).bfloat16()
    ids = torch.tensor([2, 3, 4, 9, 11])
    moved = Fetch(ids, matrix, 0, 0, 0.0).to(torch.device("cuda"))
    assert moved.matrix.device.type == "cuda" and moved.ids.device.type == "cuda"
    assert torch.equal(moved.matrix[ids.cuda()].cpu(), matrix[ids])
    assert moved.matrix.cpu().count_nonzero(1).tolist() == [0, 0, 8, 8, 8, 0, 0, 0, 0, 8, 0, 8, 0, 0, 0, 0]
