"""Hot/cold neuron placement under a memory budget (PowerInfer §6).

An offline profile (`flashlm.predictors.activation_frequency`) gives each neuron's activation
frequency f_n: the share of tokens that need it. Pinning neuron n in memory saves a read every time
it fires, so the expected activations covered by a pinned set is Σ f_n over it — PowerInfer's
neuron impact metric (its eq. 1) and objective (eq. 2). Placement maximizes it subject to the
memory constraint (eq. 6, here `<=`: the budget may be used to the byte):

    maximize  Σ_n f_n a_n   subject to   Σ_n bytes_n a_n <= budget,   a_n ∈ {0, 1}

and, optionally, PowerInfer's per-layer minimum (eqs. 4, 7, 8): a layer pins either no neuron or at
least C_l of them (`min_neurons`), modelled with one binary y_l per layer:
Σ_{n∈l} a_n >= C_l y_l and Σ_{n∈l} a_n <= N_l y_l. In PowerInfer, C_l is where GPU compute beats the
cost of one CPU–GPU synchronization (eq. 4, from profiled bandwidths and T_sync); here it is left
to the caller (a minimum chunk worth a separate resident matrix), since flashlm has no such
measured cost model yet.

Solvers: `"milp"` solves the integer program with `scipy.optimize.milp` (HiGHS, relative gap 0);
`"greedy"` sorts neurons across layers by frequency per byte and takes them while they fit, a
layer's first C_l neurons as one block (so the minimum holds); `"auto"` uses the ILP when scipy is
importable. scipy is optional (`pip install 'flashlm[training]'`): this module imports it only when
the ILP runs. Every neuron of a layer has the same size, so a layer's best choice is always a
prefix of its neurons sorted by frequency; the ILP is told so (a_i >= a_{i+1}), which removes the
symmetric solutions that slow branch-and-bound down. Beyond `ILP_MAX_ITEMS` neurons the ILP places
groups of neurons of similar frequency (PowerInfer §6.3.3 groups 64), then the budget the groups
left is filled neuron by neuron, and the greedy placement is kept if it is better: the ILP is exact
(`Placement.optimal`) only on instances it can take neuron by neuron.

Left out of PowerInfer's formulation: the CPU side of eq. 6 (flashlm's "cold" units live on the SSD,
not in a second bounded memory) and the per-unit compute-time terms of eqs. 4–5, which only serve
to derive C_l.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from .._utils import parse_bytes
from ..errors import ConfigError

logger = logging.getLogger(__name__)

Solver = Literal["auto", "milp", "greedy"]

ILP_MAX_ITEMS = 2048
"""Placement items (neurons, or groups of them) the ILP is given at most when `group_size` is None.
HiGHS proves optimality on a few thousand items in seconds, but can run for minutes on the tens of
thousands of neurons of a small model (the knapsack's many near-equal items defeat its bounds)."""


@dataclass(frozen=True)
class Placement:
    """Which neurons to pin per layer, and what that buys.

    `hot[l]` holds layer l's pinned neuron indices (sorted int64). `covered` is Σ f over them,
    `total` Σ f over every neuron; `coverage` their ratio, the expected share of activations served
    from memory. `solver` names what produced it, `optimal` whether the ILP proved it optimal.
    """

    hot: list[torch.Tensor]
    bytes_used: int
    budget_bytes: int
    covered: float
    total: float
    layer_covered: list[float]
    solver: str
    optimal: bool

    @property
    def coverage(self) -> float:
        return self.covered / self.total if self.total > 0 else 0.0

    @property
    def counts(self) -> list[int]:
        """Pinned neurons per layer."""
        return [h.numel() for h in self.hot]


@dataclass
class _Items:
    """Placement items (single neurons, or groups of them): flat arrays over all layers."""

    layer: np.ndarray  # int64, layer of each item
    value: np.ndarray  # float64, Σ f of its neurons
    size: np.ndarray  # int64, bytes
    count: np.ndarray  # int64, neurons
    members: list[np.ndarray]  # neuron indices of each item


def _as_vector(f: torch.Tensor | np.ndarray | Sequence[float], layer: int) -> np.ndarray:
    if isinstance(f, torch.Tensor):
        f = f.detach().cpu().double().numpy()
    vector = np.asarray(f, dtype=np.float64)
    if vector.ndim != 1:
        raise ConfigError(f"Layer {layer}'s frequencies must be a vector, got shape {vector.shape}.")
    if not np.all(np.isfinite(vector)) or np.any(vector < 0):
        raise ConfigError(f"Layer {layer}'s frequencies must be finite and non-negative.")
    return vector


def _per_layer(value: int | Sequence[int], layers: int, name: str) -> list[int]:
    values = [value] * layers if isinstance(value, int) else list(value)
    if len(values) != layers or any(
        isinstance(v, bool) or not isinstance(v, int | np.integer) for v in values
    ):
        raise ConfigError(f"{name} needs an integer or one integer per layer ({layers}).")
    return [int(v) for v in values]


def _items(frequencies: list[np.ndarray], neuron_bytes: list[int], group_size: int) -> _Items:
    layer, value, size, count, members = [], [], [], [], []
    for index, (f, nbytes) in enumerate(zip(frequencies, neuron_bytes, strict=True)):
        order = np.argsort(-f, kind="stable")  # most frequent first, ties by index
        for start in range(0, len(order), group_size):
            group = order[start : start + group_size]
            layer.append(index)
            value.append(float(f[group].sum()))
            size.append(nbytes * len(group))
            count.append(len(group))
            members.append(group)
    return _Items(
        layer=np.asarray(layer, dtype=np.int64),
        value=np.asarray(value, dtype=np.float64),
        size=np.asarray(size, dtype=np.int64),
        count=np.asarray(count, dtype=np.int64),
        members=members,
    )


def _greedy(
    items: _Items,
    budget: int,
    min_neurons: list[int],
    num_layers: int,
    start: np.ndarray | None = None,
) -> np.ndarray:
    """Take items by value per byte while they fit, from the feasible choice `start` (default none).

    In a layer with nothing pinned yet, the leading items up to C_l neurons form one block: it comes
    first among its layer's candidates (its value per byte is the highest: items are sorted), and
    the layer's other items are only taken once it is.
    """
    chosen = np.zeros(len(items.value), dtype=bool) if start is None else start.copy()
    left = budget - int(items.size[chosen].sum())
    # candidates: (value, bytes, item indices, layer, is a block, position in its layer)
    candidates: list[tuple[float, int, list[int], int, bool, int]] = []
    blocked = set()
    for layer in range(num_layers):
        in_layer = items.layer == layer
        indices = np.flatnonzero(in_layer & ~chosen).tolist()
        first = 0
        if min_neurons[layer] > 1 and not chosen[in_layer].any():
            running = 0
            while first < len(indices) and running < min_neurons[layer]:
                running += int(items.count[indices[first]])
                first += 1
            if running < min_neurons[layer]:
                continue  # the layer has fewer than C_l neurons: it cannot be pinned at all
            block = indices[:first]
            candidates.append(
                (float(items.value[block].sum()), int(items.size[block].sum()), block, layer, True, 0)
            )
            blocked.add(layer)
        for position, i in enumerate(indices[first:], start=1):
            candidates.append((float(items.value[i]), int(items.size[i]), [i], layer, False, position))
    candidates.sort(key=lambda c: (-c[0] / c[1], c[3], c[5]))
    for value, size, members, layer, is_block, _ in candidates:
        if size > left or value <= 0 or (not is_block and layer in blocked):
            continue  # too big, covers nothing, or its layer's minimum block was not taken
        chosen[members] = True
        left -= size
        blocked.discard(layer)
    return chosen


def _milp(
    items: _Items, budget: int, min_neurons: list[int], num_layers: int, time_limit: float | None
) -> tuple[np.ndarray | None, bool]:
    """The ILP of the module docstring; returns (chosen items or None, proven optimal)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    n = len(items.value)
    constrained = [layer for layer in range(num_layers) if min_neurons[layer] > 1]
    columns = n + len(constrained)
    rows, cols, data = [np.zeros(n, dtype=np.int64)], [np.arange(n)], [items.size.astype(np.float64)]
    lower, upper = [-np.inf], [float(budget)]
    for k, layer in enumerate(constrained):
        members = np.flatnonzero(items.layer == layer)
        counts = items.count[members].astype(np.float64)
        y = n + k
        # Σ count a - C_l y >= 0   and   Σ count a - N_l y <= 0
        for bound_row, coefficient, low, high in (
            (1 + 2 * k, -float(min_neurons[layer]), 0.0, np.inf),
            (2 + 2 * k, -float(counts.sum()), -np.inf, 0.0),
        ):
            rows.append(np.full(len(members) + 1, bound_row, dtype=np.int64))
            cols.append(np.append(members, y))
            data.append(np.append(counts, coefficient))
            lower.append(low)
            upper.append(high)
    # Within a layer the items are sorted by value and (but for a smaller last group) equally large,
    # so an optimal choice is a prefix: a_i >= a_{i+1}. Saying so removes the symmetric solutions
    # that otherwise keep branch-and-bound from proving optimality on large layers.
    next_row = len(lower)
    for layer in range(num_layers):
        members = np.flatnonzero(items.layer == layer)
        if len(members) > 1 and items.count[members[-1]] != items.count[members[0]]:
            members = members[:-1]  # a smaller last group may rightly be taken out of order
        if len(members) < 2:
            continue
        chain = np.arange(len(members) - 1)
        rows.append(np.repeat(next_row + chain, 2))
        cols.append(np.stack([members[:-1], members[1:]], axis=1).reshape(-1))
        data.append(np.tile([1.0, -1.0], len(chain)))
        lower.extend([0.0] * len(chain))
        upper.extend([np.inf] * len(chain))
        next_row += len(chain)
    matrix = coo_array(
        (np.concatenate(data), (np.concatenate(rows), np.concatenate(cols))), shape=(len(lower), columns)
    ).tocsr()
    objective = np.concatenate([-items.value, np.zeros(len(constrained))])
    options: dict[str, float] = {"mip_rel_gap": 0.0}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    result = milp(
        objective,
        constraints=LinearConstraint(matrix, np.asarray(lower), np.asarray(upper)),
        integrality=np.ones(columns),
        bounds=Bounds(0, 1),
        options=options,
    )
    if result.x is None:
        logger.warning(
            "flashlm: the placement ILP found no solution (%s); using the greedy placement.", result.message
        )
        return None, False
    return result.x[:n] > 0.5, bool(result.status == 0)


def _feasible(
    chosen: np.ndarray, items: _Items, budget: int, min_neurons: list[int], num_layers: int
) -> bool:
    if int(items.size[chosen].sum()) > budget:
        return False
    for layer in range(num_layers):
        pinned = int(items.count[chosen & (items.layer == layer)].sum())
        if 0 < pinned < min_neurons[layer]:
            return False
    return True


def scipy_available() -> bool:
    """Whether `scipy.optimize.milp` can be imported (the ILP solver)."""
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        return False
    return True


def _auto_group_size(total_neurons: int) -> int:
    return max(1, math.ceil(total_neurons / ILP_MAX_ITEMS))


def place_hot_neurons(
    frequencies: Sequence[torch.Tensor | np.ndarray | Sequence[float]],
    neuron_bytes: int | Sequence[int],
    budget_bytes: int | str,
    *,
    solver: Solver = "auto",
    min_neurons: int | Sequence[int] = 0,
    group_size: int | None = None,
    time_limit: float | None = 60.0,
) -> Placement:
    """Choose the hot neurons of every layer to pin within `budget_bytes` (see the module docstring).

    Args:
        frequencies: per layer, each neuron's activation frequency (any non-negative weights: counts
            work as well).
        neuron_bytes: bytes one neuron of a layer occupies when pinned (one int, or one per layer).
        budget_bytes: bytes available for pinned neurons (an int, or a size such as "512MB").
        solver: "milp" (needs scipy), "greedy", or "auto" (milp when scipy is importable).
        min_neurons: PowerInfer's C_l: a layer pins no neuron or at least this many (int or per layer).
        group_size: the ILP places each layer's neurons in groups of this many, by frequency
            (PowerInfer's batching); 1 is exact. None: 1 up to `ILP_MAX_ITEMS` neurons in all, else
            the least size that brings the groups down to that many.
        time_limit: seconds the ILP may run (HiGHS checks it between steps, so it may overrun a
            little); a solution it has not proven optimal is kept only where it beats the greedy one.

    Raises `ConfigError` for inconsistent arguments and `ImportError` for solver="milp" without scipy.
    """
    if solver not in ("auto", "milp", "greedy"):
        raise ConfigError(f"Unknown placement solver {solver!r}: use 'auto', 'milp' or 'greedy'.")
    if group_size is not None and (
        isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
    ):
        raise ConfigError(f"group_size must be a positive integer or None, got {group_size!r}.")
    vectors = [_as_vector(f, layer) for layer, f in enumerate(frequencies)]
    num_layers = len(vectors)
    sizes = _per_layer(neuron_bytes, num_layers, "neuron_bytes")
    if any(s <= 0 for s in sizes):
        raise ConfigError("neuron_bytes must be positive.")
    minimum = _per_layer(min_neurons, num_layers, "min_neurons")
    if any(m < 0 for m in minimum):
        raise ConfigError("min_neurons must be non-negative.")
    budget = parse_bytes(budget_bytes)
    if solver == "milp" and not scipy_available():
        raise ImportError(
            "solver='milp' needs scipy (scipy.optimize.milp): pip install scipy (or 'flashlm[training]'), "
            "or use solver='greedy'."
        )
    use_milp = solver == "milp" or (solver == "auto" and scipy_available())

    neurons = _items(vectors, sizes, 1)
    greedy = _greedy(neurons, budget, minimum, num_layers)
    chosen, used, optimal = greedy, "greedy", False
    if use_milp and len(neurons.value):
        group = group_size or _auto_group_size(len(neurons.value))
        items = neurons if group == 1 else _items(vectors, sizes, group)
        solution, proven = _milp(items, budget, minimum, num_layers, time_limit)
        if solution is not None and not _feasible(solution, items, budget, minimum, num_layers):
            logger.warning("flashlm: the placement ILP's rounded solution is infeasible; using greedy.")
            solution = None
        if solution is not None:
            # Items are layer by layer, each layer's sorted by frequency: group j of a layer is its
            # neurons j*group .. (j+1)*group - 1 in that order, so repeating expands groups to neurons.
            solution = np.repeat(solution, items.count)
            optimal = proven and group == 1
            if not optimal:  # fill what the groups left of the budget, neuron by neuron
                solution = _greedy(neurons, budget, minimum, num_layers, start=solution)
            if optimal or neurons.value[solution].sum() >= neurons.value[greedy].sum():
                chosen, used = solution, "milp"

    hot, layer_covered = [], []
    for layer in range(num_layers):
        picked = np.flatnonzero(chosen & (neurons.layer == layer))
        indices = np.sort(np.concatenate([neurons.members[i] for i in picked])) if len(picked) else []
        hot.append(torch.as_tensor(indices, dtype=torch.int64))
        layer_covered.append(float(vectors[layer][hot[-1].numpy()].sum()))
    return Placement(
        hot=hot,
        bytes_used=sum(len(h) * s for h, s in zip(hot, sizes, strict=True)),
        budget_bytes=budget,
        covered=math.fsum(layer_covered),
        total=math.fsum(float(v.sum()) for v in vectors),
        layer_covered=layer_covered,
        solver=used,
        optimal=optimal,
    )
