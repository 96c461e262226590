"""Perplexity over corpora × methods × densities, as a CSV and the DIP paper's Fig. 8 plot.

`sweep(...)` evaluates each configuration (a fresh model per configuration: the caches start cold
every time), appends a row to `out_dir/sweep.csv` after each one (the file is replaced atomically,
so an interrupted sweep keeps what it finished), then draws `out_dir/ppl_vs_density.png`: per corpus,
perplexity (log scale) against the achieved MLP density, one line per method, dense as a dashed
horizontal line. `plot_throughput_vs_perplexity` draws the throughput / quality trade-off for the
benchmarks.

matplotlib is imported inside the plotting functions, and draws on an Agg canvas of its own (no
pyplot, no global backend switch).
"""

from __future__ import annotations

import csv
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .perplexity import _stream, evaluate, num_windows, parse_method_spec
from .plotting import save_figure

CSV_NAME = "sweep.csv"
PLOT_NAME = "ppl_vs_density.png"
CSV_COLUMNS = (
    "corpus",
    "method",
    "target_density",
    "mlp_density",
    "perplexity",
    "tokens",
    "tokens_per_second",
    "bytes_read_per_token",
    "hit_rate",
    "seconds",
)


def configurations(methods: Sequence[str], densities: Sequence[float]) -> list[tuple[str, float]]:
    """(method spec, target density) pairs: every density for each sparse method, 1.0 once for dense."""
    if not methods:
        raise ValueError("sweep needs at least one method.")
    pairs: list[tuple[str, float]] = []
    dense_done = False
    for spec in methods:
        if parse_method_spec(spec)["method"] == "dense":
            if not dense_done:
                pairs.append((spec, 1.0))
            dense_done = True
            continue
        if not densities:
            raise ValueError(f"Method {spec!r} needs at least one density.")
        for density in densities:
            if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
                raise ValueError(f"Densities must be numbers in (0, 1], got {density!r}.")
            pairs.append((spec, float(density)))
    return list(dict.fromkeys(pairs))


def _token_streams(
    model_path: Path, corpora: Sequence[str] | Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    if isinstance(corpora, Mapping):
        return {name: _stream(ids) for name, ids in corpora.items()}
    if isinstance(corpora, str):
        raise ValueError("corpora must be a list of names (or a dict name -> token ids), not a string.")
    from transformers import AutoTokenizer

    from ..data.corpora import corpus_tokens, require

    for name in corpora:
        require(name)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return {name: corpus_tokens(name, tokenizer, split="test") for name in corpora}


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Write `rows` (the `CSV_COLUMNS`) to `path` through a temporary file renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def sweep(
    model_path: str | os.PathLike | None = None,
    *,
    methods: Sequence[str],
    densities: Sequence[float],
    corpora: Sequence[str] | Mapping[str, torch.Tensor],
    context_length: int = 512,
    num_tokens: int | None = 4096,
    memory_budget: int | str | None = None,
    store: str | os.PathLike | None = None,
    out_dir: str | os.PathLike,
    progress: bool = True,
    dtype: torch.dtype | None = torch.bfloat16,
    **config_kwargs: Any,
) -> list[dict[str, Any]]:
    """Evaluate every corpus × method spec × density; write `sweep.csv` and `ppl_vs_density.png`.

    `corpora` are names of `CORPORA` (their test splits, tokenized with the model's tokenizer) or a
    dict name -> 1-D token ids. `"dense"` runs once per corpus, at density 1.0. `config_kwargs` go to
    every `FlashConfig`. Returns the rows (dicts with the `CSV_COLUMNS`), in the order run.
    """
    from tqdm.auto import tqdm

    from ..data.models import default_model_path

    path = Path(model_path) if model_path is not None else default_model_path(progress=progress)
    pairs = configurations(methods, densities)
    streams = _token_streams(path, corpora)
    if not streams:
        raise ValueError("sweep needs at least one corpus.")
    for ids in streams.values():
        num_windows(ids.numel(), context_length, num_tokens)  # every corpus is long enough, before any run
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, plot_path = out / CSV_NAME, out / PLOT_NAME

    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(streams) * len(pairs), desc="sweep", unit="config", disable=not progress)
    with bar:
        for corpus, ids in streams.items():
            for spec, density in pairs:
                bar.set_postfix_str(f"{corpus} {spec} {density:g}")
                result = evaluate(
                    path,
                    ids,
                    method_spec=spec,
                    density=density,
                    context_length=context_length,
                    num_tokens=num_tokens,
                    memory_budget=memory_budget,
                    store=store,
                    dtype=dtype,
                    progress=False,
                    **config_kwargs,
                )
                rows.append(
                    {
                        "corpus": corpus,
                        "method": spec,
                        "target_density": density,
                        "mlp_density": result.mlp_density,
                        "perplexity": result.perplexity,
                        "tokens": result.tokens,
                        "tokens_per_second": result.tokens_per_second,
                        "bytes_read_per_token": result.bytes_read_per_token,
                        "hit_rate": result.hit_rate,
                        "seconds": result.seconds,
                    }
                )
                write_csv(rows, csv_path)
                bar.update()
    plot_perplexity_vs_density(rows, plot_path)
    return rows


def _is_dense(spec: str) -> bool:
    try:
        return parse_method_spec(spec)["method"] == "dense"
    except ValueError:
        return False


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def plot_perplexity_vs_density(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """The DIP paper's Fig. 8: per corpus, perplexity (log) against achieved MLP density per method.

    Rows need `corpus`, `method`, `perplexity` and `mlp_density` (else `target_density`); dense rows
    become a dashed horizontal line.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter

    corpora = list(dict.fromkeys(str(row["corpus"]) for row in rows)) or ["(no rows)"]
    figure = Figure(figsize=(5 * len(corpora), 4), layout="constrained")
    axes = figure.subplots(1, len(corpora), squeeze=False)[0]
    methods = list(dict.fromkeys(str(row["method"]) for row in rows if not _is_dense(str(row["method"]))))
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    for ax, corpus in zip(axes, corpora, strict=True):
        mine = [row for row in rows if str(row["corpus"]) == corpus]
        for row in mine:
            if _is_dense(str(row["method"])):
                ax.axhline(
                    _number(row["perplexity"]), color="black", linestyle="--", label=f"{row['method']}"
                )
        for method in methods:
            points = []
            for row in mine:
                if str(row["method"]) != method:
                    continue
                x = _number(row.get("mlp_density"))
                x = x if math.isfinite(x) else _number(row.get("target_density"))
                points.append((x, _number(row["perplexity"])))
            if points:
                points.sort()
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", color=colors[method], label=method)
        ax.set_yscale("log")
        # plain numbers (70, not 7×10^1); minor ticks labelled only when the range is narrow
        ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
        ax.set_xlabel("MLP density (achieved)")
        ax.set_ylabel("perplexity")
        ax.set_title(corpus)
        ax.grid(True, which="both", alpha=0.3)
        if mine:
            ax.legend()
    return save_figure(figure, path)


def plot_throughput_vs_perplexity(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Decode throughput against perplexity, one series per method, each point labelled by density.

    Rows need `method`, `perplexity` and a throughput: `decode_tok_s` (else `tokens_per_second`);
    the label is `target_density` (else `density`, else `mlp_density`). Returns `path`.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4.5), layout="constrained")
    ax = figure.subplots()
    methods = list(dict.fromkeys(str(row["method"]) for row in rows))
    for i, method in enumerate(methods):
        points = []
        for row in rows:
            if str(row["method"]) != method:
                continue
            speed = _number(row.get("decode_tok_s", row.get("tokens_per_second")))
            density = next(
                (_number(row[k]) for k in ("target_density", "density", "mlp_density") if k in row), math.nan
            )
            points.append((_number(row["perplexity"]), speed, density))
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{i}", label=method)
        for x, y, density in points:
            if math.isfinite(density):
                ax.annotate(f"{density:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("perplexity")
    ax.set_ylabel("decode tokens/s")
    ax.grid(True, alpha=0.3)
    if methods:
        ax.legend()
    return save_figure(figure, path)
