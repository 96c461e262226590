"""Per-step, per-layer I/O, cache and timing counters of a patched model (LLM in a flash, Table 3),
for every method.

A *step* is one forward pass of the model: a prefill step covers the prompt's tokens, a decode
step one new token (per sequence). `StatsRecorder` collects rows (one per (step, layer), or per
linear for Endor) in flat arrays, and timeline events where a method records them; `FlashStats` is
the read-only snapshot `flashlm.stats(model)` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._utils import format_bytes

COUNTER_FIELDS = (
    "tokens",
    "bytes_read",
    "reads",
    "hits",
    "misses",
    "evictions",
    "used_bytes",
    "dense_bytes",
    "moved_bytes",
)
"""`used_bytes` are the weight bytes the step's tokens used (each token counted apart, everything
a method must read included); `dense_bytes` what the dense weights would use for the same tokens.
Their ratio is the achieved density. `moved_bytes`: compressed bytes moved to the execution device
(Endor)."""
TIME_FIELDS = (
    "select_s",
    "lookup_s",
    "submit_s",
    "io_s",
    "io_busy_s",
    "update_s",
    "move_s",
    "decompress_s",
    "compute_s",
)
"""Where a layer's time went, each span counted once: `select_s` choosing the units (the method's
masks), `lookup_s` finding the misses (0 where one call does both: a decode step's top-k selection,
`flashlm.ops.select.TopUnits`), `submit_s` handing reads to the reader, `io_s` waiting for
reads (what I/O adds to latency), `update_s` admission and eviction, `move_s` copying to the
execution device and `decompress_s` expanding compressed weights (Endor), `compute_s` the products.
`io_busy_s` is how long those reads took on the background reader, mostly overlapped with earlier
work (not part of the layer's time)."""
PHASES = ("read", "move", "decompress", "compute")
"""Phases of the timeline events a method may record: `(phase, layer, linear, start, end)`."""
CACHE_FIELDS = ("lookup_s", "submit_s", "update_s")
"""The cache's bookkeeping (LLM in a flash Table 3's "memory management"): summed as `cache_s`."""
DERIVED_FIELDS = ("cache_s",)
FIELDS = ("step", "layer", *COUNTER_FIELDS, *TIME_FIELDS)
_VALUE_FIELDS = FIELDS[2:]


@dataclass
class StageTimes:
    """A forward's times and read counts, summed over its stages (the `StatsRecorder.record` fields a
    method accumulates as it goes)."""

    select_s: float = 0.0
    lookup_s: float = 0.0
    submit_s: float = 0.0
    io_s: float = 0.0
    update_s: float = 0.0
    compute_s: float = 0.0
    io_busy_s: float = 0.0
    bytes_read: int = 0
    reads: int = 0
    used_bytes: int = 0


class StatsRecorder:
    """Appends one row per (step, layer); cheap enough for the decode hot path."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.events: list[tuple[str, int, int, float, float]] = []
        self.step = -1

    def begin_step(self) -> None:
        self.step += 1

    def record(self, layer: int, **values: float) -> None:
        """One (step, layer) row: every counter and time of `FIELDS` by name (times default to 0)."""
        self.rows.append((self.step, layer, *(values.get(name, 0.0) for name in _VALUE_FIELDS)))

    def reset(self) -> None:
        self.rows.clear()
        self.events.clear()
        self.step = -1

    def snapshot(
        self,
        *,
        io_mode: str,
        resident_bytes: int,
        budget_bytes: int,
        placement: tuple[str, ...] = (),
        decompression: str = "",
        hot_set: dict[str, float] | None = None,
    ) -> FlashStats:
        table = np.array(self.rows, dtype=np.float64).reshape(-1, len(FIELDS))
        return FlashStats(
            table=table,
            io_mode=io_mode,
            resident_bytes=resident_bytes,
            budget_bytes=budget_bytes,
            events=tuple(self.events),
            placement=placement,
            decompression=decompression,
            hot_set=hot_set or {},
        )


@dataclass(frozen=True)
class FlashStats:
    """Counters of a patched model since the last reset.

    `table` has one row per (step, layer) (per linear for Endor) and the columns in `FIELDS`.
    `io_mode` says whether reads bypassed the page cache ("direct") or not ("buffered: <why>").
    `resident_bytes` is what the caches and I/O buffers really allocated; `budget_bytes` the budget
    they were sized from. Endor also gives `events` (`(phase, layer, linear, start, end)` with a
    phase of `PHASES`), each layer's `placement` ("device", "cpu" or "disk") and its `decompression`
    path. With a pinned hot set (`FlashConfig.hot_share`), `hot_set` gives its `units`, `bytes` and the
    share of the profiled unit uses it covers (`profiled_uses`).
    """

    table: np.ndarray
    io_mode: str
    resident_bytes: int
    budget_bytes: int
    events: tuple[tuple[str, int, int, float, float], ...] = ()
    placement: tuple[str, ...] = ()
    decompression: str = ""
    hot_set: dict[str, float] = field(default_factory=dict)
    _columns: dict[str, int] = field(default_factory=lambda: {name: i for i, name in enumerate(FIELDS)})

    def column(self, name: str) -> np.ndarray:
        return self.table[:, self._columns[name]]

    @property
    def num_steps(self) -> int:
        return int(np.unique(self.column("step")).size)

    def per_step(self) -> list[dict[str, float]]:
        """Counters and times summed over layers, one dict per step; `tokens` is the step's token count."""
        steps = self.column("step").astype(int)
        out = []
        for step in np.unique(steps):
            rows = self.table[steps == step]
            entry = {"step": int(step)}
            for name in COUNTER_FIELDS[1:] + TIME_FIELDS:
                entry[name] = float(rows[:, self._columns[name]].sum())
            entry["cache_s"] = sum(entry[name] for name in CACHE_FIELDS)
            entry["tokens"] = float(rows[0, self._columns["tokens"]])
            out.append(entry)
        return out

    def per_layer(self) -> list[dict[str, Any]]:
        """Counters and times summed over steps, one dict per layer (with its `placement`, if any)."""
        layers = self.column("layer").astype(int)
        out = []
        for layer in np.unique(layers):
            entry: dict[str, Any] = {"layer": int(layer)}
            if self.placement:
                entry["placement"] = self.placement[layer]
            for name in COUNTER_FIELDS[1:] + TIME_FIELDS:
                entry[name] = float(self.table[layers == layer, self._columns[name]].sum())
            entry["cache_s"] = sum(entry[name] for name in CACHE_FIELDS)
            out.append(entry)
        return out

    def totals(self, *, decode_only: bool = False) -> dict[str, float]:
        """Sums over steps and layers, with per-step means and the hit rate.

        `decode_only` keeps the steps that processed one token per sequence: the per-token figures
        of decoding, without the prompt's prefill step.
        """
        steps = self.per_step()
        if decode_only and steps:
            first_tokens = steps[-1]["tokens"]
            steps = [s for s in steps if s["tokens"] == first_tokens and s["step"] != steps[0]["step"]]
        total: dict[str, Any] = {
            name: sum(s[name] for s in steps) for name in COUNTER_FIELDS[1:] + TIME_FIELDS + DERIVED_FIELDS
        }
        total["steps"] = len(steps)
        lookups = total["hits"] + total["misses"]
        total["hit_rate"] = total["hits"] / lookups if lookups else float("nan")
        total["density"] = (
            total["used_bytes"] / total["dense_bytes"] if total["dense_bytes"] else float("nan")
        )
        for name in ("bytes_read", "reads", "moved_bytes", "dense_bytes", *TIME_FIELDS, *DERIVED_FIELDS):
            total[f"{name}_per_step"] = total[name] / len(steps) if steps else float("nan")
        return total

    def density(self, *, decode_only: bool = False) -> float:
        """Achieved MLP density: weight bytes used per token over the dense MLP's (NaN with no steps)."""
        return self.totals(decode_only=decode_only)["density"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "io_mode": self.io_mode,
            "resident_bytes": self.resident_bytes,
            "budget_bytes": self.budget_bytes,
            "placement": list(self.placement),
            "decompression": self.decompression,
            "hot_set": self.hot_set,
            "totals": self.totals(),
            "decode": self.totals(decode_only=True),
            "per_step": self.per_step(),
            "per_layer": self.per_layer(),
        }

    def summary(self) -> str:
        """One paragraph: per decode step bytes, reads, hit rate and the I/O / cache / compute split
        (for Endor: where the layers are, and the read / move / decompress / compute split)."""
        t = self.totals(decode_only=True)
        if not t["steps"]:
            t = self.totals()
        ms = {name: 1e3 * t[f"{name}_per_step"] for name in TIME_FIELDS + DERIVED_FIELDS}
        if self.placement:
            counts = {where: self.placement.count(where) for where in ("device", "cpu", "disk")}
            return (
                f"{t['steps']} steps | layers: {counts['device']} device, {counts['cpu']} memory "
                f"(compressed), {counts['disk']} disk (compressed) | per step: "
                f"{format_bytes(t['bytes_read_per_step'])} read, {format_bytes(t['moved_bytes_per_step'])} "
                f"moved compressed for {format_bytes(t['dense_bytes_per_step'])} dense | read wait "
                f"{ms['io_s']:.1f} ms, move {ms['move_s']:.1f} ms, decompress {ms['decompress_s']:.1f} ms, "
                f"compute {ms['compute_s']:.1f} ms | reads {self.io_mode}, decompression by "
                f"{self.decompression} | resident {format_bytes(self.resident_bytes)} of "
                f"{format_bytes(self.budget_bytes)} budget"
            )
        hot = self.hot_set
        pinned = (
            f" | hot set {hot['units']:.0f} units ({format_bytes(hot['bytes'])}), "
            f"{hot['profiled_uses']:.1%} of the profiled uses"
            if hot
            else ""
        )
        return (
            f"{t['steps']} steps | MLP density {t['density']:.1%} | per step: "
            f"{format_bytes(t['bytes_read_per_step'])} read in "
            f"{t['reads_per_step']:.0f} reads, hit rate {t['hit_rate']:.1%} | "
            f"select {ms['select_s']:.1f} ms, "
            f"cache {ms['cache_s']:.1f} ms (lookup {ms['lookup_s']:.1f}, submit {ms['submit_s']:.1f}, "
            f"update {ms['update_s']:.1f}), I/O wait {ms['io_s']:.1f} ms (reads took {ms['io_busy_s']:.1f} "
            f"ms, overlapped), compute {ms['compute_s']:.1f} ms | "
            f"reads {self.io_mode} | resident {format_bytes(self.resident_bytes)} "
            f"of {format_bytes(self.budget_bytes)} budget{pinned}"
        )

    def __str__(self) -> str:
        return self.summary()
