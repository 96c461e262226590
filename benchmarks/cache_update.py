"""The neuron cache's per-step update (record, expiry, admission, row copies) in C and in torch operators.

A sparse method's decode step ends, for every layer and unit kind, with `NeuronCache.update`. This
script records which units a real model's layers use while decoding (`FlashConfig(record_trace=True)`),
then replays those steps, alone, through caches of the same capacities and row widths, driven as the
sparse methods drive them (`find_misses`, then `update` with the staging matrix read by unit), and
times each update. Each replay runs in its own process: `c` (the default: `flashlm_update` in
`cache/_lookup.c`) and `torch` (`FLASHLM_C_KERNEL=0`: the policy's and the cache's torch operators).
The replay reads only the cache's public surface, so `PYTHONPATH=old/src` measures an older flashlm.

    python benchmarks/cache_update.py --model smollm2-135m --method dip --density 0.6 --cache-aware 0.2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPT = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg"
PATHS = {"c": {}, "torch": {"FLASHLM_C_KERNEL": "0"}}


def record(args: argparse.Namespace, out: Path) -> None:
    """Decode `args.new_tokens` tokens with the configured method; save the trace and each cache's shape."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import flashlm
    from flashlm.data.models import model_path
    from flashlm.patching import runtime_of, trace

    path = model_path(args.model)
    config = flashlm.FlashConfig(
        method=args.method,
        density=args.density,
        cache_aware=args.cache_aware,
        memory_budget=args.memory_budget,
        policy=args.policy,
        record_trace=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
    trace(model).save(out / "trace.safetensors")
    caches = {
        f"{layer}/{kind}": {"capacity": cache.capacity, "width": cache.width, "dtype": str(cache.rows.dtype)}
        for (layer, kind), cache in runtime_of(model).caches.items()
    }
    (out / "caches.json").write_text(json.dumps(caches))


def replay(out: Path, policy: str, warmup: int) -> dict[str, dict[str, float]]:
    """Every (layer, kind)'s steps through a fresh cache; µs per update (after `warmup` steps) per kind."""
    from flashlm.cache import NeuronCache, make_policy
    from flashlm.engine.trace import Trace

    recorded = Trace.load(out / "trace.safetensors")
    caches = json.loads((out / "caches.json").read_text())
    seconds: dict[str, list[float]] = {}
    for key, shape in caches.items():
        layer, kind = key.split("/")
        num_units = recorded.num_units[kind]
        dtype = getattr(torch, shape["dtype"].removeprefix("torch."))
        staging = torch.randn(num_units, shape["width"]).to(dtype)
        cache = NeuronCache(
            num_units, shape["capacity"], shape["width"], dtype, make_policy(policy, num_units)
        )
        for step, ids in enumerate(recorded.requests(int(layer), kind)):
            ids = ids.to(torch.int64)
            miss_ids = cache.find_misses(ids)
            started = time.perf_counter()
            cache.update(ids, miss_ids, staging, step, by_unit=True)
            if step >= warmup:
                seconds.setdefault(kind, []).append(time.perf_counter() - started)
    steps = recorded.num_steps - warmup
    return {
        kind: {"us_per_update": 1e6 * sum(times) / len(times), "ms_per_token": 1e3 * sum(times) / steps}
        for kind, times in seconds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="a bundled model's name")
    parser.add_argument("--method", default="dip")
    parser.add_argument("--density", type=float, default=0.6)
    parser.add_argument("--cache-aware", type=float, default=0.2, help="DIP-CA's gamma (1.0: plain DIP)")
    parser.add_argument("--memory-budget", default="50%")
    parser.add_argument("--policy", default="lfu", help="the policy recorded with and replayed")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=2, help="steps per cache left out of the times")
    parser.add_argument("--out", type=Path, default=Path("bench-results/cache-update"))
    parser.add_argument("--replay", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replay:
        print(json.dumps(replay(args.out, args.policy, args.warmup)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    record(args, args.out)
    results = {}
    for name, env in PATHS.items():
        child = [sys.executable, __file__, "--replay", "--out", str(args.out), "--policy", args.policy]
        child += ["--warmup", str(args.warmup)]
        done = subprocess.run(child, env={**os.environ, **env}, check=True, capture_output=True, text=True)
        results[name] = json.loads(done.stdout.splitlines()[-1])
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(
        f"{args.model}, {args.method} at {args.density}, gamma {args.cache_aware}, budget "
        f"{args.memory_budget}, policy {args.policy}: the cache update per layer and kind "
        f"({args.new_tokens} tokens, the first {args.warmup} left out)"
    )
    print("| kind | C µs/update | torch µs/update | C ms/token | torch ms/token | torch / C |")
    print("|---|---|---|---|---|---|")
    for kind in results["c"]:
        c, reference = results["c"][kind], results["torch"][kind]
        ratio = reference["us_per_update"] / c["us_per_update"]
        print(
            f"| {kind} | {c['us_per_update']:.1f} | {reference['us_per_update']:.1f} "
            f"| {c['ms_per_token']:.2f} | {reference['ms_per_token']:.2f} | {ratio:.1f}x |"
        )


if __name__ == "__main__":
    main()
