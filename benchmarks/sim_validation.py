"""Validate the simulator against real runs: replay recorded SmolLM2 traces, compare with what was measured.

Issue 5, item 5. `--record` first decodes SmolLM2 with flashlm at half the MLP bytes (dense
streaming, DIP at 0.8, DIP-CA at 0.85; each in its own process, O_DIRECT, `record_trace`) and
writes their results and traces under `--out`. Then every result whose config ends in "+trace" is
replayed under the run's own policy and cache capacities (so hits and misses are the run's), its
misses planned as `StoreReader` reads them, on each hardware profile of `--hardware`, and the
predicted flash bytes, requests and I/O time per token are printed next to the measured ones:

* bytes/token: `reader_bytes_per_token` (what the reader read, over-read included);
* reads/token: `reads_per_token` (requests the reader issued);
* I/O ms/token: `io_busy_ms` (time the reader was busy) when the result has it, otherwise `io_ms`,
  the time the layers waited for their reads.

The default profiles are "this-machine" (this machine's raw disk, nothing else running, measured on
first use) and "dev-vm-decode" (the reader measured during an in-RAM decode by `reader_profile.py` on
flashlm's development VM, on synthetic read patterns, not these traces; `reader_profile.py` writes
this machine's, for `--hardware FILE`).

A trace holds every step since the model was loaded, the prefill's first, so its replay starts from
the caches the run started from; by default (`--warmup 1`) that step is left out of the predictions,
which then cover the decode steps the measured figures are means over.

    .venv/bin/python benchmarks/sim_validation.py --record [--out bench-results/sim-validation]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashlm.data.models import default_model_path
from flashlm.engine.trace import Trace
from flashlm.sim.hardware import get_preset
from flashlm.sim.simulator import ModelDims, Workload, simulate


def _measured_io(row: dict) -> tuple[float, str]:
    for key in ("io_busy_ms", "io_busy_s_per_token"):
        if key in row:
            return (row[key] * (1e3 if key.endswith("_s_per_token") else 1.0)), "busy"
    return row["io_ms"], "wait"


RECORDED = {"dense": 1.0, "dip": 0.8, "dip-ca": 0.85}
"""Method spec -> density of the runs `--record` traces."""


def record(out: Path, results: Path, *, new_tokens: int) -> None:
    """Decode SmolLM2 at half the MLP bytes per `RECORDED`, saving each run's trace; write `results`."""
    from flashlm.eval.decode import flashlm_spec, run_in_subprocess

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for method, density in RECORDED.items():
        name = f"{method}@{density:g}+trace" if density < 1 else f"{method}+trace"
        spec = flashlm_spec(name, method, density, memory_budget="50%", record_trace=True)
        spec["trace_path"] = str(out / f"{method}-trace.safetensors")
        print(f"recording {name}", flush=True)
        rows.append(run_in_subprocess(spec, default_model_path(), new_tokens=new_tokens, offload_dir=out))
    results.write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/sim-validation"))
    parser.add_argument("--record", action="store_true", help="decode and record the traces first")
    parser.add_argument("--new-tokens", type=int, default=32, help="with --record (default 32)")
    parser.add_argument("--results", default=None, help="decode results (default: OUT/decode.json)")
    parser.add_argument("--model", default=None, help="the traced checkpoint (default: SmolLM2)")
    parser.add_argument(
        "--hardware",
        default="this-machine,dev-vm-decode",
        help="comma-separated presets or profile .json files, one table each (default: this machine's raw "
        "disk, and the development VM's reader measured during decode)",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="leading trace steps left out (default 1: the prefill)"
    )
    args = parser.parse_args()
    results = Path(args.results) if args.results else args.out / "decode.json"
    if args.record:
        record(args.out, results, new_tokens=args.new_tokens)

    rows = [r for r in json.loads(results.read_text()) if str(r.get("config", "")).endswith("+trace")]
    model = ModelDims.from_hf_config(args.model or default_model_path(), bytes_per_weight=2.0)
    traces = {row["config"]: Trace.load(row["trace_path"]) for row in rows}
    for name in args.hardware.split(","):
        profile = get_preset(name)
        print(f"\nhardware: {profile.name}; model: {model.name}; results: {results}; warmup: {args.warmup}\n")
        print(
            "| config | policy | steps replayed | hit rate meas. / pred. | MB/token meas. / pred. | err | "
            "reads/token meas. / pred. | err | I/O ms/token meas. (kind) / pred. | err |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            print(_compare(row, traces[row["config"]], profile, model, args.warmup))


def _compare(row: dict, trace: Trace, profile, model: ModelDims, warmup: int) -> str:
    """One table row: the run's measured figures against the simulator's for its trace."""
    policy = row.get("options", {}).get("policy") or row.get("policy") or "lfu"
    result = simulate(
        profile,
        Workload(model, trace),
        policy=policy,
        window=int(row.get("options", {}).get("window", 5)),
        capacities=row["capacities"],
        warmup=warmup,
        include_compute=False,
    )
    meas_mb = row["reader_bytes_per_token"] / 1e6
    pred_mb = result.flash_bytes_per_token / 1e6
    meas_reads = row["reads_per_token"]
    pred_reads = result.flash_requests_per_token
    meas_ms, io_kind = _measured_io(row)
    pred_ms = 1e3 * result.io_s
    return (
        f"| {row['config']} | {policy} | {trace.num_steps - warmup} of {trace.num_steps} | "
        f"{row['hit_rate']:.1%} / {result.hit_rate:.1%} | "
        f"{meas_mb:.1f} / {pred_mb:.1f} | {pred_mb / meas_mb - 1:+.1%} | "
        f"{meas_reads:.1f} / {pred_reads:.1f} | {pred_reads / meas_reads - 1:+.1%} | "
        f"{meas_ms:.1f} ({io_kind}) / {pred_ms:.1f} | {pred_ms / meas_ms - 1:+.1%} |"
    )


if __name__ == "__main__":
    main()
