"""Validate the simulator against a real run: replay recorded SmolLM2 traces on "this-machine".

Issue 5, item 5. Every decode result in `bench-results/dip/decode.json` whose config ends in
"+trace" recorded its per-step unit ids (`trace_path`) and its caches' capacities. Each trace is
replayed under the run's own policy and capacities (so hits and misses are the run's), the misses
planned as `StoreReader` reads them, and the predicted flash bytes, requests and I/O time per
token are printed next to the run's measured figures:

* bytes/token: `reader_bytes_per_token` (what the reader read, over-read included);
* reads/token: `reads_per_token` (requests the reader issued);
The trace starts after the prefill, but the run's caches were already filled by it: the replay's
first step is cold (no hits) where the run's was not, so by default (`--warmup 1`) the first step
is left out of the predictions (the measured figures are means over all steps; they have no
per-step series).

* I/O ms/token: `io_busy_ms` (time the reader was busy) when the result has it, otherwise `io_ms`,
  the time the layers WAITED for their reads (reads overlapped with compute are not counted in
  it, time queued behind other reads is).

    .venv/bin/python benchmarks/sim_validation.py [--results bench-results/dip/decode.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashlm.sim.hardware import get_preset
from flashlm.sim.simulator import ModelDims, Workload, simulate
from flashlm.trace import Trace

MODEL = Path("/root/.cache/flashlm/models/SmolLM2-135M-Instruct-bf16")


def _measured_io(row: dict) -> tuple[float, str]:
    for key in ("io_busy_ms", "io_busy_s_per_token"):
        if key in row:
            return (row[key] * (1e3 if key.endswith("_s_per_token") else 1.0)), "busy"
    return row["io_ms"], "wait"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="bench-results/dip/decode.json")
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--hardware", default="this-machine")
    parser.add_argument("--warmup", type=int, default=1, help="leading trace steps left out (default 1)")
    args = parser.parse_args()

    rows = [
        r for r in json.loads(Path(args.results).read_text()) if str(r.get("config", "")).endswith("+trace")
    ]
    profile = get_preset(args.hardware)
    model = ModelDims.from_hf_config(args.model, bytes_per_weight=2.0)
    print(f"hardware: {profile.name}; model: {model.name}; results: {args.results}; warmup: {args.warmup}\n")
    print(
        "| config | policy | steps replayed | hit rate meas. / pred. | MB/token meas. / pred. | err | "
        "reads/token meas. / pred. | err | I/O ms/token meas. (kind) / pred. | err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        trace = Trace.load(row["trace_path"])
        policy = row.get("options", {}).get("policy") or row.get("policy") or "lfu"
        result = simulate(
            profile,
            Workload(model, trace),
            policy=policy,
            window=int(row.get("options", {}).get("window", 5)),
            capacities=row["capacities"],
            warmup=args.warmup,
            include_compute=False,
        )
        meas_mb = row["reader_bytes_per_token"] / 1e6
        pred_mb = result.flash_bytes_per_token / 1e6
        meas_reads = row["reads_per_token"]
        pred_reads = result.flash_requests_per_token
        meas_ms, io_kind = _measured_io(row)
        pred_ms = 1e3 * result.io_s
        print(
            f"| {row['config']} | {policy} | {trace.num_steps - args.warmup} of {trace.num_steps} | "
            f"{row['hit_rate']:.1%} / {result.hit_rate:.1%} | "
            f"{meas_mb:.1f} / {pred_mb:.1f} | {pred_mb / meas_mb - 1:+.1%} | "
            f"{meas_reads:.1f} / {pred_reads:.1f} | {pred_reads / meas_reads - 1:+.1%} | "
            f"{meas_ms:.1f} ({io_kind}) / {pred_ms:.1f} | {pred_ms / meas_ms - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
