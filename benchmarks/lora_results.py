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
from flashlm.training.lora import gap_closed


def perplexity_rows(report: dict) -> list[str]:
    options = report["options"]
    rows = []
    for corpus, dense in report["measurements"]["dense"].items():
        sparse = report["measurements"]["sparse"][corpus]["perplexity"]
        lora = report["measurements"]["sparse+lora"][corpus]["perplexity"]
        base = dense["perplexity"]
        closed = gap_closed(base, sparse, lora)
        rows.append(
            f"| {Path(report['model']).name} | {options['method']}@{options['density']} "
            f"| {options['train']['steps']} | {corpus} | {base:.2f} "
            f"| {sparse:.2f} ({sparse / base - 1:+.1%}) | {lora:.2f} ({lora / base - 1:+.1%}) "
            f"| {closed:.1%} |"
        )
    return rows


def decode_specs(report: dict, memory_budget: str) -> dict[str, dict]:
    """The method on the store it was trained on and with the adapter fused in (the fused store; for
    `endor`, the pruned checkpoint and the fused one, each compressed when it is loaded)."""
    options = report["options"]
    specs = {}
    for name in ("original", "fused"):
        spec = flashlm_spec(name, options["method"], options["density"], memory_budget=memory_budget)
        if name == "fused" and options["method"] == "endor":
            spec["model"] = report["fused"]
        elif options["method"] != "endor":
            spec["options"]["store"] = report["fused"] if name == "fused" else report["store"]
        specs[name] = spec
    return specs


def decode_rows(report: dict, args: argparse.Namespace, offload: Path) -> tuple[list[str], dict]:
    specs = decode_specs(report, args.memory_budget)
    runs: dict[str, list[dict]] = {name: [] for name in specs}
    for repeat in range(args.repeats):
        for name in list(specs) if repeat % 2 == 0 else list(reversed(specs)):
            runs[name].append(
                run_in_subprocess(
                    specs[name], Path(report["model"]), new_tokens=args.new_tokens, offload_dir=offload
                )
            )
    speeds = {name: [r["decode_tok_s"] for r in results] for name, results in runs.items()}
    options = report["options"]
    row = (
        f"| {Path(report['model']).name} {options['method']}@{options['density']} "
        f"| {', '.join(f'{s:.2f}' for s in speeds['original'])} "
        f"| {', '.join(f'{s:.2f}' for s in speeds['fused'])} "
        f"| {statistics.median(speeds['fused']) / statistics.median(speeds['original']):.3f} "
        f"| {runs['original'][0]['reader_bytes_per_token'] / 1e6:.1f} "
        f"| {runs['fused'][0]['reader_bytes_per_token'] / 1e6:.1f} |"
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
