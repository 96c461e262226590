"""Hot-neuron placement (PowerInfer §6): the ILP is exact, the greedy fallback feasible and no better."""

from __future__ import annotations

import importlib.util
import itertools
import sys

import numpy as np
import pytest
import torch

import flashlm.cache.placement as placement
from flashlm.cache.placement import place_hot_neurons
from flashlm.errors import ConfigError


def brute_force(freqs: list[np.ndarray], sizes: list[int], budget: int, minimum: list[int]) -> float:
    """The best Σ f over every subset of neurons that fits the budget and the per-layer minimums."""
    neurons = [(layer, f) for layer, fl in enumerate(freqs) for f in fl]
    best = 0.0
    for picked in itertools.product((False, True), repeat=len(neurons)):
        counts = [0] * len(freqs)
        for (layer, _), on in zip(neurons, picked, strict=True):
            counts[layer] += on
        if sum(c * s for c, s in zip(counts, sizes, strict=True)) > budget:
            continue
        if any(0 < c < m for c, m in zip(counts, minimum, strict=True)):
            continue
        best = max(best, sum(f for (_, f), on in zip(neurons, picked, strict=True) if on))
    return best


def random_instance(rng: np.random.Generator) -> tuple[list[np.ndarray], list[int], int, list[int]]:
    layers = int(rng.integers(1, 4))
    freqs = [rng.integers(0, 20, size=int(rng.integers(1, 5))).astype(float) for _ in range(layers)]
    sizes = [int(s) for s in rng.integers(1, 6, size=layers)]
    budget = int(rng.integers(0, sum(len(f) * s for f, s in zip(freqs, sizes, strict=True)) + 2))
    minimum = [int(m) for m in rng.integers(0, 4, size=layers)]
    return freqs, sizes, budget, minimum


def check_feasible(result, freqs, sizes, budget, minimum) -> None:
    assert result.bytes_used == sum(len(h) * s for h, s in zip(result.hot, sizes, strict=True)) <= budget
    for hot, f, m in zip(result.hot, freqs, minimum, strict=True):
        assert hot.dtype == torch.int64 and torch.equal(hot, hot.unique())  # sorted, no repeats
        assert hot.numel() == 0 or (hot.min() >= 0 and hot.max() < len(f))
        assert hot.numel() == 0 or hot.numel() >= m
    assert result.covered == pytest.approx(
        sum(float(f[h.numpy()].sum()) for f, h in zip(freqs, result.hot, strict=True))
    )


def test_ilp_is_optimal_and_greedy_is_feasible_and_never_better() -> None:
    rng = np.random.default_rng(0)
    greedy_short = 0
    for _ in range(30):
        freqs, sizes, budget, minimum = random_instance(rng)
        best = brute_force(freqs, sizes, budget, minimum)
        exact = place_hot_neurons(freqs, sizes, budget, solver="milp", min_neurons=minimum)
        greedy = place_hot_neurons(freqs, sizes, budget, solver="greedy", min_neurons=minimum)
        check_feasible(exact, freqs, sizes, budget, minimum)
        check_feasible(greedy, freqs, sizes, budget, minimum)
        assert exact.covered == best  # integer frequencies: exact equality
        assert exact.optimal and exact.solver == "milp"
        assert greedy.covered <= best and greedy.solver == "greedy" and not greedy.optimal
        greedy_short += greedy.covered < best
    assert greedy_short > 0  # the instances are hard enough for the greedy to miss sometimes


def test_float_frequencies_and_coverage() -> None:
    rng = np.random.default_rng(1)
    freqs = [rng.random(4) ** 3 for _ in range(3)]
    sizes, budget = [3, 2, 4], 14
    best = brute_force(freqs, sizes, budget, [0, 0, 0])
    result = place_hot_neurons([torch.from_numpy(f) for f in freqs], sizes, budget)  # "auto": scipy is here
    assert result.solver == "milp" and result.covered == pytest.approx(best, abs=1e-9)
    total = sum(f.sum() for f in freqs)
    assert result.total == pytest.approx(total) and result.coverage == pytest.approx(best / total)
    assert result.layer_covered == pytest.approx(
        [f[h.numpy()].sum() for f, h in zip(freqs, result.hot, strict=True)]
    )
    assert result.counts == [h.numel() for h in result.hot]


def test_equal_sizes_take_the_most_frequent_neurons() -> None:
    freqs = [torch.tensor([0.9, 0.1, 0.5]), torch.tensor([0.2, 0.8, 0.0, 0.7])]
    for solver in ("milp", "greedy"):
        result = place_hot_neurons(freqs, 100, "300B", solver=solver)
        assert [h.tolist() for h in result.hot] == [[0], [1, 3]]
        assert result.bytes_used == 300 and result.covered == pytest.approx(2.4)
    # a budget for everything pins every neuron that ever fires (never the one at frequency 0)
    result = place_hot_neurons(freqs, 100, 10_000, solver="greedy")
    assert [h.tolist() for h in result.hot] == [[0, 1, 2], [0, 1, 3]] and result.coverage == 1.0
    assert place_hot_neurons(freqs, 100, 0).bytes_used == 0


def test_minimum_per_layer() -> None:
    # Without a minimum, the best two neurons come from both layers; with at least 2 per layer,
    # a layer pins nothing or 2+, so both come from one layer.
    freqs = [torch.tensor([5.0, 4.0, 0.0]), torch.tensor([6.0, 1.0])]
    for solver in ("milp", "greedy"):
        free = place_hot_neurons(freqs, 1, 2, solver=solver)
        assert [h.tolist() for h in free.hot] == [[0], [0]] and free.covered == 11
        chunked = place_hot_neurons(freqs, 1, 2, solver=solver, min_neurons=2)
        assert [h.tolist() for h in chunked.hot] == [[0, 1], []] and chunked.covered == 9
        # a layer with fewer neurons than its minimum is never pinned
        assert place_hot_neurons(freqs, 1, 5, solver=solver, min_neurons=[0, 3]).hot[1].numel() == 0


def test_grouped_ilp_is_feasible_and_no_worse_than_greedy() -> None:
    rng = np.random.default_rng(2)
    freqs = [rng.random(300) ** 4 for _ in range(4)]
    sizes, budget, minimum = [7, 9, 7, 11], 2000, [0, 40, 0, 0]
    greedy = place_hot_neurons(freqs, sizes, budget, solver="greedy", min_neurons=minimum)
    grouped = place_hot_neurons(freqs, sizes, budget, solver="milp", min_neurons=minimum, group_size=16)
    check_feasible(grouped, freqs, sizes, budget, minimum)
    assert grouped.covered >= greedy.covered and not grouped.optimal
    exact = place_hot_neurons(freqs, sizes, budget, solver="milp", min_neurons=minimum, group_size=1)
    assert exact.optimal and exact.covered >= grouped.covered - 1e-9


def test_without_scipy_auto_falls_back_to_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "scipy" or m.startswith("scipy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "scipy", None)  # `import scipy...` now raises ImportError
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    assert not placement.scipy_available()
    # the module itself imports without scipy
    spec = importlib.util.spec_from_file_location(
        "flashlm.cache._placement_without_scipy", placement.__file__
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert not module.scipy_available()
    freqs = [torch.tensor([3.0, 1.0]), torch.tensor([2.0])]
    result = place_hot_neurons(freqs, [2, 1], 3)
    assert result.solver == "greedy" and [h.tolist() for h in result.hot] == [[0], [0]]
    with pytest.raises(ImportError, match="scipy"):
        place_hot_neurons(freqs, [2, 1], 3, solver="milp")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(solver="cplex"),
        dict(group_size=0),
        dict(neuron_bytes=[1]),
        dict(neuron_bytes=0),
        dict(min_neurons=-1),
        dict(budget_bytes="lots"),
        dict(frequencies=[torch.tensor([-1.0])]),
        dict(frequencies=[torch.ones(2, 2)]),
    ],
)
def test_bad_arguments(kwargs: dict) -> None:
    arguments = dict(frequencies=[torch.ones(3), torch.ones(2)], neuron_bytes=4, budget_bytes=10) | kwargs
    with pytest.raises(ConfigError):
        place_hot_neurons(**arguments)
