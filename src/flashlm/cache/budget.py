"""Split one memory budget into per-layer cache capacities, never allocating past it.

Everything flashlm allocates for streaming is paid from the budget, in this order:

1. the fixed working memory (`overhead_bytes`: the caller's staging buffers, workspaces, I/O buffers
   and a method's resident predictors), without which no token can be computed;
2. each cache's per-unit indices (`slot_of` and the policy's state), whose size depends on the
   layer's unit count but not on its capacity;
3. cache slots (a row plus its `slot_ids` entry). With `read_cost` (bytes a miss of one unit
   moves off the disk, per unit byte), caches whose misses cost more per byte are filled first: a
   cached byte of a SmolLM2 down column (1152 bytes, read as a 4 KiB page) saves about three
   times the disk traffic of a cached byte of a 6 KiB input-column bundle. Caches of equal cost
   share in proportion to their full size (all their units' slots), so every layer can cache the
   same fraction of itself. With `unit_values` (what caching each unit saves: from a unit profile,
   the disk bytes per token), slots go instead to the units of most value per slot byte, across
   every cache, and what has no value is shared by size. A method whose kinds are used at very different rates
   (the predicted neurons' gate rows and the firing ones' up_down rows) needs that.

The byte costs of 2 and 3 come from `NeuronCache.fixed_bytes` / `NeuronCache.slot_bytes`, the same
place that allocates them, so the plan and the measured `nbytes` agree to the byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._utils import format_bytes
from ..errors import BudgetTooSmallError, ConfigError
from .neuron_cache import NeuronCache


@dataclass(frozen=True)
class BudgetPlan:
    """Per-layer capacities and where the budget's bytes go (`total_bytes <= budget_bytes`).

    `cache_bytes` counts the cached rows; `index_bytes` the caches' indices and policy state.
    """

    capacities: list[int]
    overhead_bytes: int
    cache_bytes: int
    index_bytes: int
    total_bytes: int
    budget_bytes: int


def split_budget(
    budget_bytes: int,
    *,
    unit_bytes: Sequence[int],
    num_units: Sequence[int],
    overhead_bytes: int,
    policy: str = "lru",
    cache_units: bool = True,
    read_cost: Sequence[float] | None = None,
    unit_values: Sequence[torch.Tensor] | None = None,
) -> BudgetPlan:
    """Capacities for one cache per entry of `unit_bytes` / `num_units` (bytes per unit row, units).

    `cache_units=False` plans no slots at all (the "no cache" baseline: every unit read every time).
    `read_cost` (one per entry, default all equal) orders the filling; `unit_values` (one vector per
    entry, of what caching each of its units saves) fill by value instead: see the module docstring.

    Raises `BudgetTooSmallError`, naming the minimum, when the budget cannot hold the working
    memory and the caches' indices; `ConfigError` for inconsistent arguments or an unknown policy.
    """
    if len(unit_bytes) != len(num_units):
        raise ConfigError(f"unit_bytes has {len(unit_bytes)} entries but num_units has {len(num_units)}.")
    read_cost = [1.0] * len(unit_bytes) if read_cost is None else list(read_cost)
    if len(read_cost) != len(unit_bytes) or any(c <= 0 for c in read_cost):
        raise ConfigError("read_cost needs one positive entry per cache.")
    if unit_values is not None and [v.numel() for v in unit_values] != list(num_units):
        raise ConfigError("unit_values needs one vector per cache, of its number of units.")
    if any(u <= 0 for u in unit_bytes) or any(n < 0 for n in num_units):
        raise ConfigError("unit_bytes must be positive and num_units non-negative.")
    if budget_bytes < 0 or overhead_bytes < 0:
        raise ConfigError("budget_bytes and overhead_bytes must be non-negative.")

    fixed_bytes = sum(NeuronCache.fixed_bytes(n, policy) for n in num_units)
    minimum = overhead_bytes + fixed_bytes
    if budget_bytes < minimum:
        raise BudgetTooSmallError(
            f"memory_budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is too small: "
            f"streaming needs at least {format_bytes(minimum)} ({minimum} bytes), i.e. "
            f"{format_bytes(overhead_bytes)} of working memory (staging matrices for a layer's "
            f"misses, and a method's predictors) plus {format_bytes(fixed_bytes)} of cache indices, before a "
            f"single unit can be cached. Set a larger memory_budget.",
            minimum_bytes=minimum,
        )

    slot_bytes = [NeuronCache.slot_bytes(u) for u in unit_bytes]
    capacities = [0] * len(num_units)
    spare = budget_bytes - minimum
    if cache_units and unit_values is not None:
        capacities = _most_valuable([v.double() for v in unit_values], slot_bytes, spare)
        spare -= sum(c * s for c, s in zip(capacities, slot_bytes, strict=True))
        unasked = _fill(spare, slot_bytes, [n - c for n, c in zip(num_units, capacities, strict=True)])
        capacities = [c + more for c, more in zip(capacities, unasked, strict=True)]
    elif cache_units:
        for cost in sorted({round(c, 6) for c in read_cost}, reverse=True):
            group = [i for i, c in enumerate(read_cost) if round(c, 6) == cost]
            filled = _fill(spare, [slot_bytes[i] for i in group], [num_units[i] for i in group])
            for i, capacity in zip(group, filled, strict=True):
                capacities[i] = capacity
                spare -= capacity * slot_bytes[i]
    cache_bytes = sum(c * u for c, u in zip(capacities, unit_bytes, strict=True))
    index_bytes = fixed_bytes + sum(
        c * (s - u) for c, s, u in zip(capacities, slot_bytes, unit_bytes, strict=True)
    )
    return BudgetPlan(
        capacities=capacities,
        overhead_bytes=overhead_bytes,
        cache_bytes=cache_bytes,
        index_bytes=index_bytes,
        total_bytes=overhead_bytes + cache_bytes + index_bytes,
        budget_bytes=budget_bytes,
    )


def _fill(spare: int, slot_bytes: Sequence[int], num_units: Sequence[int]) -> list[int]:
    """Buy slots with `spare` bytes: proportional rounds, then one greedy pass for the crumbs.

    Each round shares what is left among the layers not yet full, in proportion to their size;
    a layer that fills up frees its share for the next round. When rounding leaves less than a
    slot per layer, the largest layers take what still fits, so no layer with room could take
    another slot when this returns.
    """
    layers = range(len(num_units))
    capacities = [0] * len(num_units)
    size = [n * s for n, s in zip(num_units, slot_bytes, strict=True)]

    def left() -> int:
        return spare - sum(c * s for c, s in zip(capacities, slot_bytes, strict=True))

    while True:
        open_layers = [i for i in layers if capacities[i] < num_units[i]]
        weight = sum(size[i] for i in open_layers)
        budget = left()
        grew = False
        for i in open_layers:
            add = min(num_units[i] - capacities[i], budget * size[i] // weight // slot_bytes[i])
            capacities[i] += add
            grew = grew or add > 0
        if not grew:
            break

    budget = left()
    for i in sorted(layers, key=lambda i: -size[i]):
        add = min(num_units[i] - capacities[i], budget // slot_bytes[i])
        capacities[i] += add
        budget -= add * slot_bytes[i]
    return capacities


def _most_valuable(values: Sequence[torch.Tensor], slot_bytes: Sequence[int], spare: int) -> list[int]:
    """How many units of each cache a greedy knapsack takes with `spare` bytes: units by value per slot
    byte, across caches, while the running total fits (units of no value are left out). Only the
    counts matter here (each cache then keeps its own most used units), so this sorts once instead of
    building `placement`'s per-unit items: on a 1.5B model's 500k units that took 3 s and 300 MB."""
    per_byte = torch.cat([v / s for v, s in zip(values, slot_bytes, strict=True)])
    owner = torch.cat([torch.full((v.numel(),), i) for i, v in enumerate(values)])
    order = per_byte.argsort(descending=True, stable=True)
    owner = owner[order]
    taken = (torch.tensor(slot_bytes)[owner].cumsum(0) <= spare) & (per_byte[order] > 0)
    return torch.bincount(owner[taken], minlength=len(values)).tolist()
