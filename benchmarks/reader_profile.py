"""Flash throughput as flashlm's reader delivers it during decode: a hardware profile for the simulator.

The `this-machine` profile's flash table comes from raw O_DIRECT reads of a test file with nothing
else running (`flashlm.sim.hardware.this_machine`). During a decode the reader is not alone: it shares two
cores with the model, and each call also plans its reads and gathers the rows under the GIL. This
script measures the reader itself: `StoreReader.read` calls on the SmolLM2 store's files, each
reading runs of R consecutive rows spaced so the reader does not merge them, for R from one row
to a whole file, timed on an I/O thread as the runtime times a read (`io_busy`). With `--load
decode` (the default) plain transformers decodes SmolLM2 in RAM on the main thread meanwhile;
`--load none` measures the reader alone.

Each cell gives the mean request size (reader bytes / requests) and the throughput (reader bytes /
time inside `read`); the cells make the profile's scattered-read table, the whole-file cell its
sequential bandwidth, and DRAM figures are the `this-machine` profile's (measured on first use). The
profile is written as JSON for `flashlm simulate --hardware FILE` and `benchmarks/sim_validation.py
--hardware FILE`.

None of the traces the validation replays is used here: the profile is measured on synthetic
read patterns, so comparing its predictions with the recorded runs is still a test.

    python benchmarks/reader_profile.py [--load decode|none] [--seconds 3] \
        [--out bench-results/sim-validation/this-machine-decode.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from pathlib import Path
from typing import Self

import numpy as np
import torch

from flashlm import FlashConfig
from flashlm.data.models import default_model_path
from flashlm.methods.mlp import open_checkpoint_store
from flashlm.sim.hardware import save_profile, this_machine
from flashlm.store import add_kinds
from flashlm.store.reader import DEFAULT_MERGE_GAP_BYTES, StoreReader
from flashlm.store.rowfile import ALIGNMENT

KIND = "bundle"
"""Rows of gate | up | down of one unit: 3456 bytes for SmolLM2 (the dense stream's unit)."""
RUN_ROWS = (1, 2, 4, 8, 16, 32, 64, None)
"""Rows per run; None: the whole file in one call. Longer runs add nothing: the reader cuts them
into the same 256 KiB requests as 64 rows (221 KiB)."""


class BackgroundLoop:
    """`_run` on a daemon thread from entering the `with` block to leaving it; `_run` loops until
    `stop` is set."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class DecodeLoad(BackgroundLoop):
    """Plain transformers decoding SmolLM2 in RAM on a background thread, token after token."""

    def __init__(self, model_path: Path) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        self.steps = 0

    def _run(self) -> None:
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.inference_mode():
            while not self.stop.is_set():
                out = self.model(input_ids=ids, use_cache=True)
                for _ in range(32):
                    if self.stop.is_set():
                        break
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    out = self.model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
                    self.steps += 1


def ids_for(run_rows: int | None, rows: int, row_bytes: int, rng: np.random.Generator) -> torch.Tensor:
    """Runs of `run_rows` consecutive rows, a random start, spaced beyond the merge gap (all rows: None)."""
    if run_rows is None:
        return torch.arange(rows)
    gap_rows = (DEFAULT_MERGE_GAP_BYTES + 2 * ALIGNMENT) // row_bytes + 1
    stride = run_rows + gap_rows
    starts = np.arange(int(rng.integers(0, stride)), rows - run_rows + 1, stride)
    return torch.from_numpy((starts[:, None] + np.arange(run_rows)).reshape(-1))


def measure(reader: StoreReader, files: dict, run_rows: int | None, seconds: float) -> dict:
    """Reader calls of one pattern on an I/O thread for `seconds`: bytes, requests, time inside `read`."""
    rng = np.random.default_rng(run_rows or 0)
    keys = list(files)
    first = files[keys[0]]
    out = torch.empty(first.rows, first.width, dtype=first.dtype)
    busy, calls = 0.0, 0
    bytes_before, reads_before = reader.bytes_read, reader.reads_issued

    def loop() -> None:
        nonlocal busy, calls
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            key = keys[int(rng.integers(len(keys)))]
            ids = ids_for(run_rows, files[key].rows, files[key].row_bytes, rng)
            started = time.perf_counter()
            reader.read(key, ids, out)
            busy += time.perf_counter() - started
            calls += 1

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()
    nbytes, requests = reader.bytes_read - bytes_before, reader.reads_issued - reads_before
    return {
        "run_rows": run_rows,
        "calls": calls,
        "request_bytes": nbytes / requests,
        "bytes_per_s": nbytes / busy,
        "ms_per_call": 1e3 * busy / calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", choices=("decode", "none"), default="decode")
    parser.add_argument("--seconds", type=float, default=3.0, help="per cell")
    parser.add_argument("--out", default="bench-results/sim-validation/this-machine-decode.json")
    args = parser.parse_args()

    model_path = default_model_path()
    store = add_kinds(open_checkpoint_store(model_path, FlashConfig()), [KIND])  # derived once
    files = {(layer, KIND): store.row_file(layer, KIND) for layer in range(store.num_layers)}
    reader = StoreReader(files, direct_io=True)  # an I/O buffer the size of the largest file
    row_bytes = files[(0, KIND)].row_bytes
    print(
        f"store {store.path}: {KIND} rows of {row_bytes} bytes; load: {args.load}; {args.seconds} s per cell"
    )

    load = DecodeLoad(model_path) if args.load == "decode" else None
    cells = []
    with reader:
        if load is not None:
            load.__enter__()
        try:
            started_steps = load.steps if load else 0
            started = time.perf_counter()
            for run_rows in RUN_ROWS:
                cell = measure(reader, files, run_rows, args.seconds)
                cells.append(cell)
                print(
                    f"  {'all' if run_rows is None else run_rows:>4} rows/run: requests of "
                    f"{cell['request_bytes'] / 1024:7.1f} KiB, {cell['bytes_per_s'] / 1e6:6.0f} MB/s, "
                    f"{cell['ms_per_call']:.2f} ms/call"
                )
            if load is not None:
                rate = (load.steps - started_steps) / (time.perf_counter() - started)
                print(f"  meanwhile the in-RAM decode ran {rate:.1f} tok/s")
        finally:
            if load is not None:
                load.__exit__()

    scattered = sorted(
        (cell["request_bytes"], cell["bytes_per_s"]) for cell in cells if cell["run_rows"] is not None
    )
    table: list[tuple[float, float]] = []
    for size, rate in scattered:  # strictly increasing sizes, as HardwareProfile requires
        if not table or size > table[-1][0]:
            table.append((size, rate))
    sequential = next(cell["bytes_per_s"] for cell in cells if cell["run_rows"] is None)
    # A profile caps scattered reads at its sequential bandwidth; a whole-file call (its chunks
    # read like any others) can come out slower than long runs by noise, so the cap is the best seen.
    profile = dataclasses.replace(
        this_machine(),
        name=f"this machine, reader under {args.load} load (benchmarks/reader_profile.py)",
        flash_sequential_bandwidth=max(sequential, max(rate for _, rate in table)),
        flash_random=tuple(table),
    )
    path = save_profile(profile, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
