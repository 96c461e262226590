"""Memory sweeps of the simulator and their plot: latency per token against the DRAM budget (LLM in a
flash Fig. 7) for each cache policy, with the hit rate beside it (the DIP paper's policy comparison,
Fig. 11, when the workload is a recorded trace)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..eval.plotting import save_figure
from .hardware import HardwareProfile
from .simulator import SimulationResult, Workload, simulate


def sweep_memory(
    profile: HardwareProfile,
    workload: Workload,
    dram_sizes: Sequence[float],
    policies: Sequence[str],
    **options,
) -> dict[str, list[SimulationResult]]:
    """`simulate` at every DRAM size for every policy: `{policy: [result per size]}`.

    With a GPU the sizes are the DRAM tier's (GPU memory stays as the profile gives it). `options`
    go to `simulate` (window, warmup, include_compute, dram_policy). A size too small for the
    static allocation raises `ConfigError` from `simulate`, naming what does not fit.
    """
    return {
        policy: [
            simulate(profile.with_overrides(dram_bytes=float(size)), workload, policy=policy, **options)
            for size in dram_sizes
        ]
        for policy in policies
    }


def plot_memory_sweep(
    sweep: dict[str, list[SimulationResult]], dram_sizes: Sequence[float], path: str | Path
) -> Path:
    """Two panels against the DRAM budget: latency per token (total and flash I/O) for each policy, and
    hit rate (with a GPU, the DRAM tier's hit rate of the GPU's misses dashed beside the GPU's)."""
    from matplotlib.figure import Figure

    gb = [size / 1e9 for size in dram_sizes]
    fig = Figure(figsize=(11, 4), layout="constrained")
    latency, hits = fig.subplots(1, 2)
    for policy, results in sweep.items():
        (line,) = latency.plot(gb, [1e3 * r.latency_s for r in results], marker="o", label=f"{policy}: total")
        latency.plot(
            gb, [1e3 * r.io_s for r in results], ls="--", color=line.get_color(), label=f"{policy}: flash I/O"
        )
        hits.plot(gb, [100 * r.hit_rate for r in results], marker="o", color=line.get_color(), label=policy)
        if any(r.allocation.dram_cache_bytes for r in results):
            hits.plot(
                gb,
                [100 * r.dram_hit_rate for r in results],
                ls="--",
                color=line.get_color(),
                label=f"{policy}: DRAM tier",
            )
    first = next(iter(sweep.values()))[0]
    latency.set_title(f"{first.model} on {first.hardware}", fontsize=9)
    latency.set_xlabel("DRAM budget (GB)")
    latency.set_ylabel("latency per token (ms)")
    latency.set_yscale("log")
    latency.legend(fontsize=7)
    hits.set_xlabel("DRAM budget (GB)")
    hits.set_ylabel("MLP cache hit rate (%)")
    hits.legend(fontsize=7)
    return save_figure(fig, path)
