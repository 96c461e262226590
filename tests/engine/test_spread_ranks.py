from __future__ import annotations

import itertools

import pytest

from flashlm.engine.runtime import spread_ranks


@pytest.mark.parametrize("count", [1, 2, 3, 7, 24, 28, 30, 64])
def test_every_prefix_of_the_fill_order_is_spread_over_the_layers(count: int) -> None:
    """`cache_split="in-order"` fills a kind's caches in this order: whichever number of layers a budget
    reaches, they lie at most twice the mean gap apart (cyclically), so reads a layer ahead stay even."""
    ranks = spread_ranks(count)
    assert sorted(ranks) == list(range(count))
    for reached in range(1, count + 1):
        layers = sorted(layer for layer in range(count) if ranks[layer] < reached)
        gaps = [b - a for a, b in itertools.pairwise(layers)] + [layers[0] + count - layers[-1]]
        assert max(gaps) <= 2 * count / reached
    assert ranks[0] == 0
