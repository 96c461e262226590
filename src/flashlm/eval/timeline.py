"""Plots of offloaded decoding from `flashlm.eval.decode` results: the timeline of one decode step (the
Endor paper's Figs. 3 and 5) and each decoder layer's time per token (its Fig. 6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .plotting import save_figure

PHASE_COLORS = {"read": "tab:red", "move": "tab:orange", "decompress": "tab:purple", "compute": "tab:green"}
PLACEMENT_COLORS = {"device": "tab:olive", "cpu": "tab:blue", "disk": "tab:brown"}


def layer_placement_of(result: dict[str, Any]) -> list[str]:
    """Where each decoder layer of a decode result lived: Endor's placement, or Accelerate's map."""
    if "placement" in result:
        return result["placement"]
    layers = len(result["layer_ms"])
    memory = result.get("memory_layers", layers)
    return ["cpu" if index < memory else "disk" for index in range(layers)]


def plot_step_timelines(results: list[dict[str, Any]], path: str | Path) -> Path:
    """One panel per result: its last decode step on a shared time axis (ms).

    Endor runs get a lane per phase — the reads on the I/O thread, decompression and compute on the
    execution device — so overlap shows; other runs get one lane of decoder layers coloured by
    where the layer's weights live.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(11, 1.3 + 1.1 * len(results)), layout="constrained")
    axes = fig.subplots(len(results), 1, sharex=True, squeeze=False)
    for ax, result in zip(axes[:, 0], results, strict=True):
        if "last_step_events" in result:
            lanes = ["read", "decompress", "compute"] + (["move"] if result.get("move_ms", 0) > 0.05 else [])
            for lane, phase in enumerate(lanes):
                spans = [(s, e - s) for p, _, _, s, e in result["last_step_events"] if p == phase]
                ax.broken_barh(spans, (lane - 0.4, 0.8), color=PHASE_COLORS[phase])
            ax.set_yticks(range(len(lanes)), lanes)
        else:
            placement = layer_placement_of(result)
            for index, start, end in result["last_step_layers"]:
                ax.broken_barh(
                    [(start, end - start)],
                    (-0.4, 0.8),
                    color=PLACEMENT_COLORS[placement[index]],
                    edgecolor="white",
                    linewidth=0.3,
                )
            ax.set_yticks([0], ["layers"])
        ax.set_title(
            f"{result['config']}: {1e3 / result['decode_tok_s']:.0f} ms per token", fontsize=9, loc="left"
        )
    axes[-1, 0].set_xlabel("ms from the start of the decode step")
    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items()]
    handles += [Patch(color=c, label=f"layer in {p}") for p, c in PLACEMENT_COLORS.items()]
    fig.legend(handles=handles, loc="outside upper right", fontsize=7, ncol=4)
    return save_figure(fig, path)


def plot_layer_times(results: list[dict[str, Any]], path: str | Path) -> Path:
    """Each decoder layer's mean time per decode step, per result; markers say where the layer lives."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    markers = {"device": "^", "cpu": "o", "disk": "s"}
    for result in results:
        placement = layer_placement_of(result)
        (line,) = ax.plot(result["layer_ms"], label=result["config"], alpha=0.7)
        for where, marker in markers.items():
            xs = [i for i, p in enumerate(placement) if p == where]
            ax.scatter(xs, [result["layer_ms"][i] for i in xs], marker=marker, color=line.get_color(), s=14)
    ax.set_xlabel("decoder layer (o: in memory, s: on disk, ^: on the device)")
    ax.set_ylabel("ms per decode step")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
