"""What each read lever contributes to DIP-CA's decode, one lever at a time, beside dense streaming.

Every row runs in its own process with the same prompt and budget (default 50% of the MLP bytes):
a prefill, then greedy decoding, timed per step. The rows, cumulative:

- `dense`: dense streaming with every default (the baseline DIP-CA must beat).
- `dip-ca (4 readers, no read-ahead)`: DIP-CA at `--density` with the reader of before the disk
  profile (4 threads, the merge gap measured on the development disk) and no layer-ahead read.
- `+ disk profile`: the reader's threads and merge gap from the profile of the store's disk
  (`flashlm.store.disk.disk_profile`, measured under compute).
- `+ read-ahead`: DIP's default read-ahead, which the `read-ahead` column names: every uncached input
  column of the next layer where merged reads would cover nearly all of them anyway (small units),
  else the layer-ahead guess (the columns the next layer would select for this layer's input).
- `cache split by size`: the last row with the budget shared in proportion to each kind's size
  instead of by read cost (a lever that loses on a disk whose small reads are expensive).

Per row: decode tokens/s and its ratio to `dense`, MB read per token and the MB the selected misses
needed (the rest is merged gaps and unused guesses), requests per token, hit rate, and the split of a
token's time (selection / cache bookkeeping / I/O wait / compute, from `flashlm.stats`).

    python benchmarks/sparsity_levers.py --model qwen2.5-1.5b --out bench-results/levers
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Explain why this mattered."
)


def rows(budget: str, density: float, gamma: float) -> list[tuple[str, dict[str, Any]]]:
    dip_ca = {"memory_budget": budget, "method": "dip", "density": density, "cache_aware": gamma}
    return [
        ("dense", {"memory_budget": budget}),
        ("dip-ca (4 readers, no read-ahead)", {**dip_ca, "io_threads": 4, "read_ahead": False}),
        ("+ disk profile", {**dip_ca, "read_ahead": False}),
        ("+ read-ahead", dip_ca),
        ("cache split by size", {**dip_ca, "cache_split": "size"}),
    ]


def run_child(options: dict[str, Any], model: str, new_tokens: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import flashlm
    from flashlm.data.models import model_path
    from flashlm.methods import flashlm_modules

    path = model_path(model) if not Path(model).is_dir() else Path(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=flashlm.FlashConfig(**options))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    steps = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        flashlm.stats(model, reset=True)
        for _ in range(new_tokens):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            started = time.perf_counter()
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            steps.append(time.perf_counter() - started)
    totals = flashlm.stats(model).totals(decode_only=True)
    module = flashlm_modules(model)[0]
    if module.runtime.read_ahead:
        read_ahead = "every uncached unit"
    else:
        read_ahead = "layer-ahead guess" if getattr(module, "guesses_ahead", False) else "none"
    return {
        "read_ahead": read_ahead,
        "decode_tok_s": len(steps) / sum(steps),
        "read_mb_per_token": totals["bytes_read_per_step"] / 1e6,
        "reads_per_token": totals["reads_per_step"],
        "hit_rate": totals["hit_rate"],
        "ms": {name: 1e3 * totals[f"{name}_s_per_step"] for name in ("select", "cache", "io", "compute")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="bundled name or checkpoint directory")
    parser.add_argument("--memory-budget", default="50%")
    parser.add_argument("--density", type=float, default=0.6)
    parser.add_argument("--gamma", type=float, default=0.2, help="DIP-CA's γ")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench-results/levers"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(json.loads(args.child), args.model, args.new_tokens)))
        return

    results = []
    for name, options in rows(args.memory_budget, args.density, args.gamma):
        command = [sys.executable, __file__, "--child", json.dumps(options), "--model", args.model]
        command += ["--new-tokens", str(args.new_tokens)]
        print(f"running {name} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
        results.append({"config": name, "options": options, **json.loads(line.removeprefix("RESULT "))})

    dense = results[0]["decode_tok_s"]
    lines = [
        f"## {args.model}, memory budget {args.memory_budget}, DIP-CA density {args.density}, γ {args.gamma}",
        "",
        "| configuration | read-ahead | decode tok/s | x dense | MB read/token | requests/token | hit rate "
        "| select / cache / I/O wait / compute ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ms = r["ms"]
        lines.append(
            f"| {r['config']} | {r['read_ahead']} "
            f"| {r['decode_tok_s']:.2f} | {r['decode_tok_s'] / dense:.2f} "
            f"| {r['read_mb_per_token']:.0f} | {r['reads_per_token']:.0f} | {r['hit_rate']:.1%} "
            f"| {ms['select']:.1f} / {ms['cache']:.1f} / {ms['io']:.1f} / {ms['compute']:.1f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"levers-{Path(args.model).name}"
    stem.with_suffix(".json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": results}, indent=1)
    )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
