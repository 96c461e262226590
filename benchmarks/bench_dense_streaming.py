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
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Explain why this mattered."
)


def proc_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def mlp_disk_device_map(model_path: Path) -> dict[str, str]:
    """Every MLP on 'disk', everything else on 'cpu', keyed by the modules that hold parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from flashlm.arch import find_mlps, model_type_of, spec_for

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    mlp_names = [name for _, name, _ in find_mlps(model, spec_for(model_type_of(config)))]
    device_map = {name: "disk" for name in mlp_names}
    for name, _ in model.named_parameters(remove_duplicate=False):
        module = name.rsplit(".", 1)[0]
        if not any(module == m or module.startswith(m + ".") for m in mlp_names):
            device_map[module] = "cpu"
    return device_map


def load(config_name: str, model_path: Path, store: Path, budget: str | None, offload_dir: Path):
    from transformers import AutoModelForCausalLM

    import flashlm

    if config_name == "ram":
        return AutoModelForCausalLM.from_pretrained(model_path)
    if config_name.startswith("accelerate"):
        return AutoModelForCausalLM.from_pretrained(
            model_path, device_map=mlp_disk_device_map(model_path), offload_folder=str(offload_dir)
        )
    return AutoModelForCausalLM.from_pretrained(
        model_path, quantization_config=flashlm.FlashConfig(store=str(store), memory_budget=budget)
    )


def run_child(args: argparse.Namespace) -> None:
    """Load one configuration, decode greedily, print one JSON line of measurements."""
    import torch
    from transformers import AutoTokenizer

    import flashlm

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    started = time.perf_counter()
    model = load(args.child, Path(args.model), Path(args.store), args.budget, Path(args.offload_dir))
    load_s = time.perf_counter() - started
    rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cold = args.child == "accelerate-cold"
    patched = bool(flashlm.patching.streaming_mlps(model))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids

    tokens, step_s, step_bytes = [], [], []
    with torch.inference_mode():
        if cold:
            drop_page_cache()
        started = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill_s = time.perf_counter() - started
        if patched:
            flashlm.stats(model, reset=True)
        for _ in range(args.new_tokens):
            next_token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(next_token))
            if cold:
                drop_page_cache()
            read_before = proc_read_bytes()
            started = time.perf_counter()
            out = model(input_ids=next_token, past_key_values=out.past_key_values, use_cache=True)
            step_s.append(time.perf_counter() - started)
            step_bytes.append(proc_read_bytes() - read_before)
    result = {
        "config": args.child,
        "budget": args.budget,
        "load_s": load_s,
        "prefill_s": prefill_s,
        "decode_tok_s": len(step_s) / sum(step_s),
        "proc_read_bytes_per_token": sum(step_bytes) / len(step_bytes),
        "rss_after_load": rss_after_load,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tokens": tokens,
    }
    if patched:
        snapshot = flashlm.stats(model)
        totals = snapshot.totals()
        result.update(
            reader_bytes_per_token=totals["bytes_read_per_step"],
            reads_per_token=totals["reads_per_step"],
            hit_rate=totals["hit_rate"],
            io_ms=1e3 * totals["io_s_per_step"],
            cache_ms=1e3 * totals["cache_s_per_step"],
            compute_ms=1e3 * totals["compute_s_per_step"],
            io_mode=snapshot.io_mode,
            resident_bytes=snapshot.resident_bytes,
            budget_bytes=snapshot.budget_bytes,
        )
    print("RESULT " + json.dumps(result), flush=True)


def minimum_budget(store_path: Path) -> int:
    """The smallest budget dense streaming accepts on this store (one layer's working set)."""
    import flashlm
    from flashlm.errors import BudgetTooSmallError
    from flashlm.runtime import FlashRuntime

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
        regime = {
            "ram": "in RAM",
            "accelerate-cold": "cold (page cache dropped every step)",
            "accelerate-warm": "warm (page cache kept; reference)",
        }.get(r["config"], r.get("io_mode", ""))
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
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--offload-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child:
        run_child(args)
        return

    import flashlm
    from flashlm.models import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="flashlm-bench-", dir=out_dir))
    store = work / "store.flash"
    flashlm.convert(model, store, progress=True)
    mlp_bytes = flashlm.Store.open(store).nbytes("bundle")
    opened = flashlm.Store.open(store)
    minimum = minimum_budget(store)
    named = {
        "min": minimum,
        # Working memory plus a slot (row and 8-byte index) for every unit: nothing is read after warm-up.
        "all": minimum + mlp_bytes + 8 * opened.d_ff * opened.num_layers,
    }
    configs = [("ram", None), ("accelerate-cold", None), ("accelerate-warm", None)]
    configs += [
        (f"flashlm-dense@{b}", str(named[b]) if b in named else b) for b in args.budgets.split(",") if b
    ]
    skip = set(filter(None, args.skip.split(",")))
    results = []
    for name, budget in configs:
        if name in skip:
            continue
        print(f"== {name}", file=sys.stderr, flush=True)
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--model",
            str(model),
            "--store",
            str(store),
            "--offload-dir",
            str(work / f"offload-{name}"),
            "--new-tokens",
            str(args.new_tokens),
        ]
        if budget:
            cmd += ["--budget", budget]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"configuration {name} failed (exit {proc.returncode})")
        results.append(json.loads(line.removeprefix("RESULT ")))
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
