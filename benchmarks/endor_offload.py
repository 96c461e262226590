"""Endor offloading vs. Accelerate disk offload of the same pruned model, side by side on SmolLM2.

The model is SmolLM2-135M-Instruct pruned to 50% with Wanda (`flashlm prune`; made here if missing).
With one memory budget for the decoder layers' weights (default 25% of their dense bytes):

- ram: the pruned model, everything in memory (reference tokens and speed).
- accelerate-cold: Accelerate's disk offload of the pruned model stored dense, the Endor paper's
  baseline: as many whole decoder layers in memory as the budget holds dense, the rest in
  Accelerate's offload folder; the page cache is dropped before every decode step (needs root).
- endor-same-map: Endor with the same layers in memory (compressed) and the rest on the Endor store,
  read with O_DIRECT, decompressed on the CPU (the execution device of this machine).
- endor-same-budget: Endor with the same budget: compressed layers are smaller, so more fit.
- accelerate-cold-all-disk / endor-all-disk: every decoder layer on disk, to compare SSD-mapped layers.
- endor-gpu (CUDA machines only): endor-same-budget with the model on the GPU, decompressed there.

Each configuration runs in its own subprocess with the same prompt and greedy loop (one prefill,
then one forward per new token, each timed alone). Endor's budget covers its staging buffers and
decompression workspace too; Accelerate's working memory is not counted against it.

    python benchmarks/endor_offload.py --new-tokens 16 --out bench-results/endor

Writes `report.md`, `results.json`, `step_timelines.png` (the last decode step of each run, the
paper's Figs. 3/5) and `layer_times.png` (each layer's time per token, its Fig. 6).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from flashlm.config import Budget
from flashlm.eval.decode import run_in_subprocess
from flashlm.eval.timeline import plot_layer_times, plot_step_timelines
from flashlm.methods.endor import working_bytes


def pruned_model(path: Path) -> Path:
    """The 50% Wanda-pruned SmolLM2 at `path`, pruned now if it is not there yet."""
    if not (path / "config.json").is_file():
        print(f"pruning SmolLM2 to 50% into {path} ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "flashlm.cli", "prune", str(path), "--sparsity", "0.5"], check=True
        )
    return path


def endor_store(model_path: Path, store_path: Path):
    """The Endor store of `model_path`, compressed now if missing."""
    from flashlm.endor.store import EndorStore, convert_endor, meta_model_layout

    if not store_path.exists():
        convert_endor(model_path, store_path, meta_model_layout(model_path))
    return EndorStore.open(store_path)


def markdown(results: list[dict], baseline: str) -> str:
    ram = next(r for r in results if r["config"] == "ram")
    base = next(r for r in results if r["config"] == baseline)
    lines = [
        "| configuration | layers memory / disk | decode tok/s | x "
        + baseline
        + " | bytes read/token (/proc) MB "
        "| reader bytes/token MB | read wait / decompress / compute ms | peak RSS MB | tokens = ram |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        placement = r.get("placement") or (
            ["cpu"] * r.get("memory_layers", len(r["layer_ms"]))
            + ["disk"] * (len(r["layer_ms"]) - r.get("memory_layers", len(r["layer_ms"])))
        )
        phases = (
            f"{r['read_ms']:.1f} / {r['decompress_ms']:.1f} / {r['compute_ms']:.1f}"
            if "read_ms" in r
            else "—"
        )
        reader = f"{r['reader_bytes_per_token'] / 1e6:.1f}" if "reader_bytes_per_token" in r else "—"
        lines.append(
            f"| {r['config']} | {len(placement) - placement.count('disk')} / {placement.count('disk')} "
            f"| {r['decode_tok_s']:.2f} | {r['decode_tok_s'] / base['decode_tok_s']:.2f} "
            f"| {r['proc_read_bytes_per_token'] / 1e6:.1f} | {reader} | {phases} | {r['peak_rss'] / 1e6:.0f} "
            f"| {'yes' if r['tokens'] == ram['tokens'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pruned", type=Path, default=Path("bench-results/prune/wanda-50"))
    parser.add_argument(
        "--memory-budget", default="25%", help="bytes or a percentage of the dense layer bytes"
    )
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench-results/endor"))
    parser.add_argument("--work", type=Path, default=None, help="where the store and offload folders go")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("accelerate-cold drops the page cache before every step: run as root.")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="endor-bench-", dir="/var/tmp"))
    model = pruned_model(args.pruned)
    store = endor_store(model, work / "store.endor")
    dense_layer = store.layers[0].dense_bytes
    compressed_layer = max(layer.data_bytes for layer in store.layers)
    overhead = working_bytes(store)
    budget = Budget.parse(args.memory_budget).resolve(store.dense_nbytes())
    memory_layers = min(budget // dense_layer, store.num_layers)
    print(
        f"{store}\nbudget {budget / 1e6:.1f} MB: Accelerate holds {memory_layers} dense layers of "
        f"{dense_layer / 1e6:.2f} MB; Endor layers are {compressed_layer / 1e6:.2f} MB, its buffers "
        f"{overhead / 1e6:.2f} MB",
        flush=True,
    )
    endor = {"method": "endor", "store": str(store.path), "direct_io": True}
    specs = [
        {"name": "ram", "kind": "ram"},
        {"name": "accelerate-cold", "kind": "accelerate-cold", "memory_layers": memory_layers},
        {
            "name": "endor-same-map",
            "kind": "flashlm",
            "options": {**endor, "memory_budget": overhead + memory_layers * compressed_layer},
        },
        {"name": "endor-same-budget", "kind": "flashlm", "options": {**endor, "memory_budget": budget}},
        {"name": "accelerate-cold-all-disk", "kind": "accelerate-cold", "memory_layers": 0},
        {"name": "endor-all-disk", "kind": "flashlm", "options": {**endor, "memory_budget": overhead}},
    ]
    if torch.cuda.is_available():
        specs.append(
            {
                "name": "endor-gpu",
                "kind": "flashlm",
                "device": "cuda",
                "options": {**endor, "memory_budget": budget},
            }
        )
    else:
        print("no CUDA device: the GPU-decompression configuration is skipped", flush=True)
    results = []
    for spec in specs:
        print(f"running {spec['name']} ...", flush=True)
        result = run_in_subprocess(spec, model, new_tokens=args.new_tokens, offload_dir=work / spec["name"])
        if "memory_layers" in spec:
            result["memory_layers"] = spec["memory_layers"]
        results.append(result)
        print(f"  {result['decode_tok_s']:.2f} tok/s", flush=True)
    table = markdown(results, "accelerate-cold")
    header = (
        f"Endor offloading of {model} ({store.num_layers} layers, {store.dense_nbytes() / 1e6:.1f} MB of "
        f"decoder linears dense, {store.nbytes() / 1e6:.1f} MB compressed = {store.ratio:.2%}); budget "
        f"{budget / 1e6:.1f} MB; {args.new_tokens} new tokens; Endor decompression by "
        f"{next(r['decompression'] for r in results if 'decompression' in r)}.\n\n"
    )
    (args.out / "report.md").write_text(header + table + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot_step_timelines(results, args.out / "step_timelines.png")
    plot_layer_times(results, args.out / "layer_times.png")
    print(header + table)


if __name__ == "__main__":
    main()
