"""Dense streaming vs. plain transformers vs. Accelerate disk offload, side by side on SmolLM2.

Each configuration runs in its own subprocess (so peak RSS is its own), with the same prompt and
greedy decode loop: one prefill step, then one forward per new token, each timed alone. Rows:

- ram: plain transformers, everything in memory.
- accelerate-cold: the MLPs offloaded to disk with Accelerate (`device_map` + `offload_folder`);
  the page cache is dropped before every decode step, outside the timed region, so the weights
  really come from the disk (needs root). Without it a small model never leaves the page cache.
- accelerate-warm: the same, page cache left alone (reference only: it reads from RAM).
- flashlm-dense@X: flashlm dense streaming with a budget of X of the MLP bytes (O_DIRECT reads),
  at the smallest budget it accepts ("min"), and at one that caches every unit ("all"). The budget
  covers flashlm's working memory too, so at 100% not quite every unit is cached.

Bytes read per token come from /proc/self/io read_bytes (what the process really fetched from
storage) and, for flashlm, from the reader's own counter; the two are printed side by side.

    python benchmarks/bench_dense_streaming.py --new-tokens 32 --out bench-results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from flashlm.eval.decode import PROMPT, run_in_subprocess


def minimum_budget(store_path: Path) -> int:
    """The smallest budget dense streaming accepts on this store (one layer's working set)."""
    import flashlm
    from flashlm.engine.runtime import FlashRuntime
    from flashlm.errors import BudgetTooSmallError

    try:
        FlashRuntime(flashlm.Store.open(store_path), flashlm.FlashConfig(memory_budget=1))
    except BudgetTooSmallError as exc:
        return exc.minimum_bytes
    raise RuntimeError("a 1-byte budget was accepted")


def fmt_mb(n: float | None) -> str:
    return "—" if n is None else f"{n / 1e6:.1f}"


def markdown(results: list[dict], mlp_bytes: int) -> str:
    ram = next(r for r in results if r["config"] == "ram")
    cold = next((r for r in results if r["config"] == "accelerate-cold"), None)
    lines = [
        "| configuration | regime | cache budget | decode tok/s | x accelerate-cold | bytes read/token "
        "(/proc) MB | reader bytes/token MB | reads/token | hit rate | I/O / cache / compute ms | "
        "peak RSS MB | tokens = ram |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        regime = r["regime"]
        budget = "—"
        if "budget_bytes" in r:
            budget = f"{r['budget_bytes'] / 1e6:.1f} MB ({r['budget_bytes'] / mlp_bytes:.0%})"
        ratio = f"{r['decode_tok_s'] / cold['decode_tok_s']:.2f}" if cold else "—"
        split = f"{r['io_ms']:.1f} / {r['cache_ms']:.1f} / {r['compute_ms']:.1f}" if "io_ms" in r else "—"
        lines.append(
            f"| {r['config']} | {regime} | {budget} | {r['decode_tok_s']:.2f} | {ratio} | "
            f"{fmt_mb(r['proc_read_bytes_per_token'])} | {fmt_mb(r.get('reader_bytes_per_token'))} | "
            f"{r.get('reads_per_token', float('nan')):.0f} | "
            f"{r['hit_rate']:.1%} | {split} | {r['peak_rss'] / 1e6:.0f} | "
            f"{'yes' if r['tokens'] == ram['tokens'] else 'NO'} |"
            if "hit_rate" in r
            else f"| {r['config']} | {regime} | {budget} | {r['decode_tok_s']:.2f} | {ratio} | "
            f"{fmt_mb(r['proc_read_bytes_per_token'])} | — | — | — | — | {r['peak_rss'] / 1e6:.0f} | "
            f"{'yes' if r['tokens'] == ram['tokens'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the embedded SmolLM2)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--budgets",
        default="all,100%,50%,25%,min",
        help="cache budgets: shares of the MLP bytes, 'min' (smallest accepted) or 'all' (every unit cached)",
    )
    parser.add_argument("--skip", default="", help="comma-separated configurations to skip")
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import flashlm
    from flashlm.data.models import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="flashlm-bench-", dir=out_dir))
    store = work / "store.flash"
    flashlm.convert(model, store, progress=True)
    opened = flashlm.Store.open(store)
    mlp_bytes = opened.nbytes()
    minimum = minimum_budget(store)
    named = {
        "min": minimum,
        # Working memory plus a slot (row and 8-byte index) for every unit: nothing is read after warm-up.
        "all": minimum + mlp_bytes + 8 * opened.d_ff * opened.num_layers,
    }
    specs = [{"name": kind, "kind": kind} for kind in ("ram", "accelerate-cold", "accelerate-warm")]
    specs += [
        {
            "name": f"flashlm-dense@{b}",
            "kind": "flashlm",
            "options": {"store": str(store), "memory_budget": named.get(b, b)},
        }
        for b in args.budgets.split(",")
        if b
    ]
    skip = set(filter(None, args.skip.split(",")))
    results = []
    for spec in specs:
        if spec["name"] in skip:
            continue
        print(f"== {spec['name']}", file=sys.stderr, flush=True)
        offload = work / f"offload-{spec['name']}"
        results.append(run_in_subprocess(spec, model, new_tokens=args.new_tokens, offload_dir=offload))
    table = markdown(results, mlp_bytes)
    header = (
        f"SmolLM2-135M-Instruct bf16, MLP bytes {mlp_bytes / 1e6:.1f} MB, prompt {len(PROMPT)} chars, "
        f"{args.new_tokens} greedy decode steps, {os.cpu_count()} CPU cores\n\n"
    )
    (out_dir / "dense_streaming.md").write_text(header + table + "\n")
    (out_dir / "dense_streaming.json").write_text(json.dumps(results, indent=2))
    print(header + table)


if __name__ == "__main__":
    main()
