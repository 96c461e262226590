"""Replay a recorded `Trace` through the neuron cache under a policy, offline.

Each (layer, kind) gets its own `NeuronCache` of width 0 (residency only: no rows are stored) and
sees the trace's steps in order, exactly as the sparse MLP drives it: `lookup` the step's ids, then
`update` with the misses. What a step reads from flash is its misses times the unit's bytes. Since
the future is known, Belady's oracle (MIN with bypass) can be replayed too: the floor every online
policy is measured against (DIP §5.1, §6.4).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..cache import NeuronCache, make_policy, read_ahead_block
from ..engine.trace import Trace
from ..errors import ConfigError

REPLAY_POLICIES = ("lru", "lfu", "window", "atu", "belady", "none")
"""Policies `replay` accepts; "none" is no cache at all (capacity 0)."""

_ROUNDING_SLACK = 1e-9
"""So that a fraction such as 0.29 of 100 units gives 29 slots despite 0.29 * 100 < 29 in floats."""


@dataclass
class ReplayResult:
    """What a replay read, step by step, summed over layers and kinds.

    Attributes:
        policy: the replayed policy.
        capacities: slots of each (layer, kind) cache.
        hits, misses: per-step unit counts (int64 arrays of length `num_steps`).
        bytes_read: per-step bytes read from flash (misses × unit bytes).
        missed_ids: with `replay(..., record_misses=True)`, each (layer, kind)'s missed unit ids,
            one sorted int64 array per step; None otherwise.
        uncached_ids: for the kinds of `replay(..., read_ahead=...)`, each (layer, kind)'s units not
            resident before each step, one sorted int64 array per step: what a read of the whole kind
            ahead of the step reads.
    """

    policy: str
    capacities: dict[tuple[int, str], int]
    hits: np.ndarray
    misses: np.ndarray
    bytes_read: np.ndarray
    metadata: dict[str, Any] = field(default_factory=dict)
    missed_ids: dict[tuple[int, str], list[np.ndarray]] | None = None
    uncached_ids: dict[tuple[int, str], list[np.ndarray]] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.hits)

    @property
    def hit_rate(self) -> float:
        """Hits over requested units, all steps, layers and kinds (0.0 when nothing was requested)."""
        requested = int(self.hits.sum() + self.misses.sum())
        return int(self.hits.sum()) / requested if requested else 0.0

    @property
    def bytes_per_step(self) -> float:
        """Mean bytes read from flash per step (0.0 for an empty trace)."""
        return float(self.bytes_read.mean()) if self.num_steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary and per-step series; capacities keyed `"layer/kind"`."""
        return {
            "policy": self.policy,
            "num_steps": self.num_steps,
            "hit_rate": self.hit_rate,
            "bytes_per_step": self.bytes_per_step,
            "total_hits": int(self.hits.sum()),
            "total_misses": int(self.misses.sum()),
            "total_bytes_read": int(self.bytes_read.sum()),
            "capacities": {f"{layer}/{kind}": cap for (layer, kind), cap in self.capacities.items()},
            "hits": self.hits.tolist(),
            "misses": self.misses.tolist(),
            "bytes_read": self.bytes_read.tolist(),
            "metadata": self.metadata,
        }


def _some(keys: list[tuple[int, str]]) -> str:
    return f"{keys[:5]}{'...' if len(keys) > 5 else ''}"


def _capacities(
    trace: Trace, capacity: float | dict[tuple[int, str], int], policy: str
) -> dict[tuple[int, str], int]:
    keys = trace.layer_kinds()
    num_units = trace.num_units
    if policy == "none":
        return dict.fromkeys(keys, 0)
    if isinstance(capacity, dict):
        missing = [key for key in keys if key not in capacity]
        unknown = [key for key in capacity if key not in set(keys)]
        if missing or unknown:
            raise ConfigError(
                "capacity must give every (layer, kind) of the trace, and only those: "
                f"missing {_some(missing)}, unknown {_some(unknown)}."
            )
        for (layer, kind), cap in capacity.items():
            if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= num_units[kind]:
                raise ConfigError(
                    f"capacity[({layer}, {kind!r})] must be an int in 0..{num_units[kind]}, got {cap!r}."
                )
        return {key: capacity[key] for key in keys}
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not 0 <= capacity <= 1:
        raise ConfigError(
            f"capacity must be a fraction in [0, 1] of each layer's units, or a dict of slots per "
            f"(layer, kind); got {capacity!r}."
        )
    return {
        (layer, kind): min(num_units[kind], math.floor(capacity * num_units[kind] + _ROUNDING_SLACK))
        for layer, kind in keys
    }


def _read_ahead_kinds(trace: Trace) -> tuple[str, ...]:
    """The kinds the trace's run read ahead whole, every unit not resident (`FlashRuntime.read_ahead`;
    none in a trace from before they were recorded)."""
    kinds = trace.metadata.get("read_ahead", [])
    if not isinstance(kinds, list) or any(kind not in trace.kinds for kind in kinds):
        raise ConfigError(
            f"The trace's read-ahead kinds {kinds!r} are not a list of its kinds {trace.kinds}: "
            "record the trace again with this flashlm."
        )
    return tuple(kinds)


def replay(
    trace: Trace,
    *,
    capacity: float | dict[tuple[int, str], int],
    policy: str,
    window: int = 5,
    progress: bool = False,
    record_misses: bool = False,
    read_ahead: Collection[str] | None = None,
) -> ReplayResult:
    """Replay `trace` through one neuron cache per (layer, kind) under `policy`.

    Args:
        trace: the recorded unit ids.
        capacity: the fraction of each (layer, kind)'s units that fit (rounded down), or the
            slots of each (layer, kind) as a dict covering all of them. Ignored for `"none"`.
        policy: one of `REPLAY_POLICIES`: "lru", "lfu", "window", "atu" (M2Cache's Adjacent
            Token Update: the previous step's units), "belady" (the offline oracle, given each
            layer's future requests), "none" (no cache: every unit is read every step).
        window: the sliding window in steps, for `"window"`.
        progress: show a progress bar over the (layer, kind) caches.
        record_misses: keep each step's missed ids per (layer, kind) in `ReplayResult.missed_ids`
            (what a read plan needs; off by default, the counts are enough for bytes).
        read_ahead: kinds the run read ahead whole (`FlashRuntime.read_ahead`; None: those the trace's
            metadata names): as there, a cache of one with room for some of its units pins a block of
            them (`read_ahead_block`) before the first step, and each step's units not resident before
            it, which the read ahead reads, are kept in `ReplayResult.uncached_ids`.

    Raises `ConfigError` for an unknown policy, an invalid capacity or malformed read-ahead kinds.
    """
    if policy not in REPLAY_POLICIES:
        raise ConfigError(f"Unknown replay policy {policy!r}. Available: {', '.join(REPLAY_POLICIES)}.")
    read_ahead = _read_ahead_kinds(trace) if read_ahead is None else read_ahead
    capacities = _capacities(trace, capacity, policy)
    unit_bytes = trace.unit_bytes
    hits = np.zeros(trace.num_steps, dtype=np.int64)
    misses = np.zeros(trace.num_steps, dtype=np.int64)
    bytes_read = np.zeros(trace.num_steps, dtype=np.int64)

    missed_ids: dict[tuple[int, str], list[np.ndarray]] | None = {} if record_misses else None
    uncached_ids: dict[tuple[int, str], list[np.ndarray]] = {}
    keys = trace.layer_kinds()
    if progress:
        from tqdm.auto import tqdm

        keys = tqdm(keys, desc=f"replay {policy}", unit="cache")
    for layer, kind in keys:
        n = trace.num_units[kind]
        requests = [ids.to(torch.int64) for ids in trace.requests(layer, kind)]
        if policy == "belady":
            eviction = make_policy("belady", n, requests=requests)
        elif policy == "window":
            eviction = make_policy("window", n, window=window)
        else:
            eviction = make_policy("lru" if policy == "none" else policy, n)
        cache = NeuronCache(n, capacities[(layer, kind)], 0, torch.float16, eviction)
        empty_rows = torch.empty(n, 0, dtype=torch.float16)
        block = read_ahead_block(cache.capacity, n) if kind in read_ahead else None
        if block is not None:
            cache.pin(block, empty_rows)
        step_hits = np.zeros(trace.num_steps, dtype=np.int64)
        step_misses = np.zeros(trace.num_steps, dtype=np.int64)
        step_missed: list[np.ndarray] = []
        step_uncached: list[np.ndarray] | None = [] if kind in read_ahead else None
        every_unit = torch.arange(n)
        for step, ids in enumerate(requests):
            if step_uncached is not None:  # as the runtime asks for them (`FlashRuntime.uncached`)
                step_uncached.append(cache.missing(every_unit).numpy())
            hit_ids, _hit_slots, miss_ids = cache.lookup(ids)
            cache.update(ids, miss_ids, empty_rows[: miss_ids.numel()], step)
            step_hits[step] = hit_ids.numel()
            step_misses[step] = miss_ids.numel()
            if missed_ids is not None:
                step_missed.append(np.sort(miss_ids.numpy().astype(np.int64)))
        if missed_ids is not None:
            missed_ids[(layer, kind)] = step_missed
        if step_uncached is not None:
            uncached_ids[(layer, kind)] = step_uncached
        hits += step_hits
        misses += step_misses
        bytes_read += step_misses * unit_bytes[kind]
    return ReplayResult(
        policy=policy,
        capacities=capacities,
        hits=hits,
        misses=misses,
        bytes_read=bytes_read,
        metadata=trace.metadata,
        missed_ids=missed_ids,
        uncached_ids=uncached_ids,
    )
