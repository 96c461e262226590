"""Random-read throughput of the disk under a store, and the reader defaults it implies.

Measures O_DIRECT random reads (page cache bypassed) over a test file for chunk sizes 4 KiB..1 MiB
x threads 1..16 (the LLM in a flash Fig. 2b experiment), the 4 KiB random-read latency on one
thread, and the best large-read bandwidth; derives the merge gap of the latency x bandwidth
model (`flashlm.store.reader.break_even_gap_bytes`). Then checks that `StoreReader.bytes_read`
agrees with what the kernel says the process read (`read_bytes` of /proc/self/io).

    python benchmarks/reader_throughput.py --out bench-results/reader_throughput.json

The test file goes to a disk-backed directory (never tmpfs, which refuses O_DIRECT): `--dir`,
else /var/tmp, else a folder under the repository. It is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from flashlm._utils import format_bytes, parse_bytes
from flashlm.eval.decode import proc_read_bytes
from flashlm.store.disk import random_read_throughput, supports_direct, write_test_file
from flashlm.store.reader import ALIGNMENT, StoreReader, break_even_gap_bytes
from flashlm.store.rowfile import RowFile

CHUNKS = [4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20]
THREADS = [1, 2, 4, 8, 16]
REPO = Path(__file__).resolve().parent.parent


def pick_dir(requested: str | None) -> Path:
    candidates = [Path(requested)] if requested else [Path("/var/tmp"), REPO / ".bench-tmp"]
    for candidate in candidates:
        candidate.mkdir(parents=True, exist_ok=True)
        if supports_direct(candidate):
            return candidate
    raise SystemExit(f"No O_DIRECT-capable directory among {[str(c) for c in candidates]}; pass --dir.")


def honesty_check(path: Path, width: int, density: float, seconds: float) -> dict:
    """Random row subsets read with the StoreReader: its counter vs. the kernel's read_bytes."""
    size = os.path.getsize(path)
    row_bytes = width * 2
    rows = (size - ALIGNMENT) // row_bytes
    f = RowFile(path, ALIGNMENT, rows, width, torch.bfloat16)
    rng = np.random.default_rng(1)
    take = int(density * min(rows, 20_000))
    out = torch.empty(take, width, dtype=torch.bfloat16)
    with StoreReader({0: f}, direct_io=True, buffer_bytes=64 << 20) as reader:
        kernel_before, calls, t0 = proc_read_bytes(), 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            base = int(rng.integers(0, rows - 20_000))
            ids = torch.from_numpy(np.sort(rng.choice(20_000, take, replace=False)) + base)
            reader.read(0, ids, out)
            calls += 1
        elapsed = time.perf_counter() - t0
        kernel = proc_read_bytes() - kernel_before
        return {
            "row_bytes": row_bytes,
            "rows_per_call": take,
            "calls": calls,
            "reader_bytes_read": reader.bytes_read,
            "reader_reads_issued": reader.reads_issued,
            "proc_read_bytes": kernel,
            "ratio_reader_over_proc": reader.bytes_read / kernel if kernel else None,
            "useful_bytes_per_s": calls * take * row_bytes / elapsed,
            "disk_bytes_per_s": reader.bytes_read / elapsed,
            "settings": {
                "threads": reader.threads,
                "chunk_bytes": reader.chunk_bytes,
                "merge_gap_bytes": reader.merge_gap_bytes,
            },
        }


def device_of(directory: Path) -> str:
    try:
        return subprocess.run(
            ["df", "--output=source,fstype", str(directory)], capture_output=True, text=True, check=True
        ).stdout.split("\n")[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="directory for the test file (default: /var/tmp, else under the repo)")
    parser.add_argument("--size", default="1GB", help="test file size (default 1GB)")
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per (chunk, threads) cell")
    parser.add_argument("--out", default="reader_throughput.json", help="JSON results file")
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="read into huge pages, as the reader's staging matrices are (default: 4 KiB pages, as the "
        "disk profile reads)",
    )
    args = parser.parse_args()

    directory = pick_dir(args.dir)
    size = parse_bytes(args.size) // ALIGNMENT * ALIGNMENT
    workdir = Path(tempfile.mkdtemp(prefix="flashlm-bench-", dir=directory))
    path = workdir / "testfile.bin"
    try:
        print(f"writing {format_bytes(size)} to {path} ({device_of(directory)}) ...", flush=True)
        write_test_file(path, size)

        cells = []
        for chunk in CHUNKS:
            for threads in THREADS:
                cells.append(
                    random_read_throughput(path, chunk, threads, args.seconds, huge_pages=args.huge_pages)
                )
        latency = random_read_throughput(path, 4096, 1, max(args.seconds, 2.0), huge_pages=args.huge_pages)
        best = max(cells, key=lambda c: c["bytes_per_s"])
        # The smallest chunk within 10% of the best bandwidth, and the fewest threads that get it.
        good = [c for c in cells if c["bytes_per_s"] >= 0.9 * best["bytes_per_s"]]
        pick = min(good, key=lambda c: (c["chunk_bytes"], c["threads"]))
        # One more request costs its share of the pipeline at the chosen thread count (1 / rate of
        # 4 KiB reads there); the 1-thread latency would overstate it for a parallel reader.
        small = next(c for c in cells if c["chunk_bytes"] == 4096 and c["threads"] == pick["threads"])
        gap = break_even_gap_bytes(1 / small["reads_per_s"], pick["bytes_per_s"])
        gap_1thread = break_even_gap_bytes(latency["latency_mean_s"], best["bytes_per_s"])

        print("\n| chunk | " + " | ".join(f"{t} thr MB/s (reads/s)" for t in THREADS) + " |")
        print("|---" * (len(THREADS) + 1) + "|")
        for chunk in CHUNKS:
            row = [c for c in cells if c["chunk_bytes"] == chunk]
            body = " | ".join(f"{c['bytes_per_s'] / 1e6:.0f} ({c['reads_per_s']:.0f})" for c in row)
            print(f"| {chunk >> 10} KiB | {body} |")
        print(
            f"\n4 KiB random-read latency (1 thread): mean {latency['latency_mean_s'] * 1e6:.1f} us, "
            f"p50 {latency['latency_p50_s'] * 1e6:.1f} us ({latency['reads_per_s']:.0f} reads/s)"
        )
        print(
            f"best bandwidth: {best['bytes_per_s'] / 1e6:.0f} MB/s "
            f"({best['chunk_bytes'] >> 10} KiB x {best['threads']} threads)"
        )
        print(
            f"suggested defaults: chunk {pick['chunk_bytes'] >> 10} KiB, threads {pick['threads']} "
            f"({pick['bytes_per_s'] / 1e6:.0f} MB/s)\nmerge gap = request cost x bandwidth = "
            f"{1e6 / small['reads_per_s']:.1f} us x {pick['bytes_per_s'] / 1e6:.0f} MB/s -> {gap} bytes "
            f"(1-thread latency x best bandwidth would give {gap_1thread})"
        )

        honesty = honesty_check(path, width=576, density=0.25, seconds=min(5.0, 2 * args.seconds))
        print(
            f"\nStoreReader honesty ({honesty['calls']} calls of {honesty['rows_per_call']} random rows of "
            f"{honesty['row_bytes']} B): bytes_read {honesty['reader_bytes_read']}, /proc/self/io read_bytes "
            f"{honesty['proc_read_bytes']}, ratio {honesty['ratio_reader_over_proc']:.4f}; "
            f"useful {honesty['useful_bytes_per_s'] / 1e6:.0f} MB/s, "
            f"from disk {honesty['disk_bytes_per_s'] / 1e6:.0f} MB/s"
        )
        results = {
            "dir": str(directory),
            "device": device_of(directory),
            "file_bytes": size,
            "seconds_per_cell": args.seconds,
            "huge_pages": args.huge_pages,
            "cells": cells,
            "latency_4k_1thread": latency,
            "best": best,
            "suggested": {
                "chunk_bytes": pick["chunk_bytes"],
                "threads": pick["threads"],
                "merge_gap_bytes": gap,
                "merge_gap_bytes_1thread_latency": gap_1thread,
            },
            "honesty": honesty,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.out}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
