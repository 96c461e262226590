"""What the order of units in the store would buy DIP's reads (issue 16's store-order lever), measured
offline on decode traces with the reader's own read planner, before building a permuted store.

DIP misses scattered input columns; the reader merges a token's misses that lie less than the
disk's merge gap apart into one request (reading the gap), so an order that puts units needed
together side by side turns the same misses into fewer, larger requests and less over-read. The
units needed are the same whatever the order: the bytes the token needs do not change, only how they
are requested.

1. DIP at `--density` decodes the calibration split (`--calibration-tokens`) and, separately, the test
   split (`--test-tokens`) of `--corpus` one token at a time with every unit resident, recording the
   units each token needs (`flashlm.workflows.profile.decode_trace`; kept in `--out` and reused).
2. The test trace is replayed through LFU caches with the capacities DIP-CA's runtime plans for
   `--memory-budget` and `--cache-split` (`flashlm.sim.replay`): each token's misses per layer and
   kind, counted after the first `--warmup` tokens.
3. Each order, learnt on the calibration trace only, maps unit ids to file rows: `natural` (the
   checkpoint's), `hot first` (by how often a unit is needed) and `co-activation` (a greedy chain from
   the most needed unit, each next the unused unit most often needed with the last one). The misses
   of each token are planned as the reader plans them (`flashlm.sim.plan_trace_reads`: 4 KiB
   alignment, the merge gap and threads of this disk's profile).

Per order: MB requested and requests per token, over-read (requested bytes beyond the needed rows),
and the read time the disk profile predicts (requests x request cost + bytes / bandwidth, at the
profile's concurrency).

    python benchmarks/store_order.py --model qwen2.5-1.5b --out bench-results/store-order
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from flashlm import FlashConfig
from flashlm.data.corpora import corpus_tokens
from flashlm.data.models import model_path
from flashlm.engine.trace import Trace
from flashlm.eval.perplexity import load_streaming, release
from flashlm.methods.mlp import open_checkpoint_store
from flashlm.methods.sparse import DIPMLP
from flashlm.sim import replay
from flashlm.sim.simulator import plan_trace_reads
from flashlm.workflows.profile import RESIDENT_BUDGET, decode_trace


def coactivation_order(steps: list[torch.Tensor], num_units: int) -> np.ndarray:
    """A greedy chain: the most needed unit first, then each time the unused unit needed most often
    together with the last one (ties: the more needed)."""
    needed = torch.zeros(len(steps), num_units)
    for row, ids in enumerate(steps):
        needed[row, ids.long()] = 1
    together = (needed.T @ needed).numpy()
    frequency = np.diag(together).copy()
    score = together + frequency[None, :] * 1e-6  # break ties by frequency
    used = np.zeros(num_units, dtype=bool)
    order = [int(np.argmax(frequency))]
    used[order[0]] = True
    for _ in range(num_units - 1):
        candidates = np.where(used, -np.inf, score[order[-1]])
        order.append(int(np.argmax(candidates)))
        used[order[-1]] = True
    return np.asarray(order)


def orders(calibration: Trace, layer: int, kind: str) -> dict[str, np.ndarray]:
    """Each order as `position[unit]` (the file row of each unit)."""
    num_units = calibration.num_units[kind]
    frequency = calibration.frequencies(layer, kind).numpy()
    by_order = {
        "natural": np.arange(num_units),
        "hot first": np.argsort(-frequency, kind="stable"),
        "co-activation": coactivation_order(calibration.requests(layer, kind), num_units),
    }
    positions = {}
    for name, order in by_order.items():
        position = np.empty(num_units, dtype=np.int64)
        position[order] = np.arange(num_units)
        positions[name] = position
    return positions


def load_or_record_traces(path: Path, args: argparse.Namespace) -> dict[str, Trace]:
    """The calibration and test decode traces, recorded once and kept in `--out` for later runs."""
    tokens = {"calibration": args.calibration_tokens, "test": args.test_tokens}
    files = {
        split: args.out / f"trace-{path.name}-d{args.density:g}-{args.corpus}-{split}-{count}.safetensors"
        for split, count in tokens.items()
    }
    if all(f.is_file() for f in files.values()):
        return {split: Trace.load(f) for split, f in files.items()}
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_streaming(
        path,
        FlashConfig(method="dip", density=args.density, memory_budget=RESIDENT_BUDGET, record_trace=True),
    )
    traces = {}
    try:
        for split, count in tokens.items():
            ids = corpus_tokens(args.corpus, tokenizer, split=split)[:count]
            traces[split] = decode_trace(model, ids, context_length=min(args.context_length, count))
    finally:
        release(model)
    args.out.mkdir(parents=True, exist_ok=True)
    for split, recorded in traces.items():
        recorded.save(files[split])
    return traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="bundled name or checkpoint directory")
    parser.add_argument("--density", type=float, default=0.6)
    parser.add_argument("--memory-budget", default="50%")
    parser.add_argument(
        "--cache-split",
        default="read-cost",
        choices=("read-cost", "size"),
        help="the caches' plan (FlashConfig)",
    )
    parser.add_argument("--corpus", default="shakespeare")
    parser.add_argument("--calibration-tokens", type=int, default=512)
    parser.add_argument("--test-tokens", type=int, default=256)
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=16, help="test tokens not counted (the caches fill)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/store-order"))
    args = parser.parse_args()

    path = Path(model_path(args.model))
    traces = load_or_record_traces(path, args)
    config = FlashConfig(
        method="dip",
        density=args.density,
        cache_aware=0.2,
        memory_budget=args.memory_budget,
        cache_split=args.cache_split,
    )
    store = open_checkpoint_store(path, config)
    runtime = DIPMLP.make_runtime(store, config, DIPMLP.load_fitted(store))
    capacities, disk = runtime.capacities, runtime.disk
    runtime.close()
    if disk is None:
        raise SystemExit("This store's disk has no O_DIRECT profile: the read planner's figures need one.")
    test = traces["test"]
    replayed = replay(test, capacity=capacities, policy="lfu", record_misses=True)

    totals: dict[tuple[str, str], dict[str, float]] = {}  # (order, kind) -> bytes and requests
    needed: dict[str, float] = {}
    for (layer, kind), missed in replayed.missed_ids.items():
        steps = missed[args.warmup :]
        row_bytes = store.row_file(layer, kind).row_bytes
        needed[kind] = needed.get(kind, 0.0) + sum(len(ids) for ids in steps) * row_bytes
        if not any(len(ids) for ids in steps):
            continue
        for name, position in orders(traces["calibration"], layer, kind).items():
            sizes = plan_trace_reads(
                [np.sort(position[ids]) for ids in steps],
                row_bytes,
                test.num_units[kind],
                merge_gap_bytes=disk.merge_gap_bytes,
            )
            entry = totals.setdefault((name, kind), {"bytes": 0.0, "requests": 0.0})
            entry["bytes"] += float(sizes.sum())
            entry["requests"] += float(len(sizes))

    steps = test.num_steps - args.warmup
    calibration_tokens = traces["calibration"].num_steps
    lines = [
        f"## {args.model}: DIP at density {args.density}, LFU caches of DIP-CA's plan at "
        f"{args.memory_budget} (cache split {args.cache_split}), {steps} test tokens of {args.corpus} "
        f"after {args.warmup} (orders learnt on "
        f"{calibration_tokens} calibration tokens); disk: {disk.threads} threads, "
        f"{1e6 * disk.request_cost_s:.0f} µs per request, {disk.bandwidth / 1e9:.2f} GB/s, merge gap "
        f"{disk.merge_gap_bytes / 1e3:.0f} KB",
        "",
        "Needed misses (the same for every order): "
        + ", ".join(f"{kind} {value / steps / 1e6:.0f} MB/token" for kind, value in needed.items())
        + ".",
        "",
        "| store order | kind | MB requested/token | requests/token | over-read | predicted read ms/token |",
        "|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(order for order, _ in totals):
        rows = {kind: entry for (order, kind), entry in totals.items() if order == name}
        rows["all"] = {field: sum(entry[field] for entry in rows.values()) for field in ("bytes", "requests")}
        for kind, entry in rows.items():
            wanted = sum(needed.values()) if kind == "all" else needed[kind]
            per_token = {key: value / steps for key, value in entry.items()}
            predicted = per_token["requests"] * disk.request_cost_s + per_token["bytes"] / disk.bandwidth
            lines.append(
                f"| {name} | {kind} | {per_token['bytes'] / 1e6:.0f} | {per_token['requests']:.0f} "
                f"| {entry['bytes'] / wanted - 1:.1%} | {1e3 * predicted:.0f} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"store-order-{path.name}-{args.cache_split}"
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "args": vars(args) | {"out": str(args.out)},
                "needed_bytes": needed,
                "orders": {f"{order}/{kind}": entry for (order, kind), entry in totals.items()},
            }
        )
    )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
