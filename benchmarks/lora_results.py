"""LoRA recovery results (issue 18): perplexity recovered, and decode speed before and after fusing.

For each run directory `flashlm train lora` wrote (its `report.json`):

1. **Perplexity** on the test splits it measured: dense, the sparse method, the sparse method on the
   store with the adapter fused in, and the share of the sparse model's gap to dense the adapter
   closes (the DIP paper closes 41% on Phi-3-Mini at 50% density).
2. **Decode speed** of the method on the original store and on the fused store, side by side, each
   row in its own process (`flashlm.eval.decode`, as `flashlm bench` runs rows), alternating over
   `--repeats`: fusing adds no runtime cost, so the two should agree within the machine's noise.

    python benchmarks/lora_results.py bench-results/lora/smollm2-dip-0.5 [...] --out bench-results/lora
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from flashlm.eval.decode import flashlm_spec, run_in_subprocess


def perplexity_rows(report: dict) -> list[str]:
    options = report["options"]
    rows = []
    for corpus, dense in report["measurements"]["dense"].items():
        sparse = report["measurements"]["sparse"][corpus]["perplexity"]
        lora = report["measurements"]["sparse+lora"][corpus]["perplexity"]
        base = dense["perplexity"]
        closed = (sparse - lora) / (sparse - base) if sparse != base else float("nan")
        rows.append(
            f"| {Path(report['model']).name} | {options['method']}@{options['density']} "
            f"| {options['train']['steps']} | {corpus} | {base:.2f} "
            f"| {sparse:.2f} ({sparse / base - 1:+.1%}) | {lora:.2f} ({lora / base - 1:+.1%}) "
            f"| {closed:.1%} |"
        )
    return rows


def decode_rows(report: dict, args: argparse.Namespace, offload: Path) -> tuple[list[str], dict]:
    options, model = report["options"], Path(report["model"])
    stores = {"original store": None, "fused store": report["fused_store"]}
    speeds: dict[str, list[float]] = {name: [] for name in stores}
    runs: dict[str, list[dict]] = {name: [] for name in stores}
    for repeat in range(args.repeats):
        order = list(stores) if repeat % 2 == 0 else list(reversed(stores))
        for name in order:
            spec = flashlm_spec(
                name,
                options["method"],
                options["density"],
                memory_budget=args.memory_budget,
                store=stores[name],
            )
            result = run_in_subprocess(spec, model, new_tokens=args.new_tokens, offload_dir=offload)
            speeds[name].append(result["decode_tok_s"])
            runs[name].append(result)
    before, after = (statistics.median(speeds[name]) for name in stores)
    label = f"{model.name} {options['method']}@{options['density']}"
    row = (
        f"| {label} | {', '.join(f'{s:.2f}' for s in speeds['original store'])} "
        f"| {', '.join(f'{s:.2f}' for s in speeds['fused store'])} | {after / before:.3f} "
        f"| {runs['original store'][0]['reader_bytes_per_token'] / 1e6:.1f} "
        f"| {runs['fused store'][0]['reader_bytes_per_token'] / 1e6:.1f} |"
    )
    return [row], runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="output directories of `flashlm train lora`")
    p.add_argument("--out", type=Path, default=Path("bench-results/lora"))
    p.add_argument("--memory-budget", default="50%", help="for both decode rows (default: 50%%)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="decode runs of each store, alternating")
    p.add_argument("--no-decode", dest="decode", action="store_false", help="the perplexity table only")
    args = p.parse_args()

    reports = [json.loads((run / "report.json").read_text()) for run in args.runs]
    lines = [
        "## Perplexity (test splits), dense vs sparse vs sparse + LoRA (fused)",
        "",
        "| model | method | steps | corpus | dense | sparse | sparse + LoRA | gap closed |",
        "|---|---|---|---|---|---|---|---|",
        *(row for report in reports for row in perplexity_rows(report)),
    ]
    results: dict = {"reports": reports, "decode": {}}
    if args.decode:
        lines += [
            "",
            f"## Decode, {args.memory_budget} memory budget, {args.new_tokens} tokens, tok/s per run",
            "",
            "| run | original store | fused store | fused / original (medians) | MB/token original | fused |",
            "|---|---|---|---|---|---|",
        ]
        with tempfile.TemporaryDirectory() as offload:
            for run, report in zip(args.runs, reports, strict=True):
                rows, decoded = decode_rows(report, args, Path(offload))
                lines += rows
                results["decode"][str(run)] = decoded
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
