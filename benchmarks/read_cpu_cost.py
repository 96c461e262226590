"""What flashlm's reader costs the CPU, and what it takes from a decode running beside it.

Streaming decode overlaps each layer's reads with compute, which only helps if reading leaves the
cores free. This script measures whether it does, with flashlm's reader (O_DIRECT, by default its
threads and request size) reading whole layer files of the SmolLM2 store on a background thread,
as dense streaming does:

1. the reader alone: its throughput, and the process CPU time (user + system, `getrusage`) per GB
   read;
2. plain transformers decoding SmolLM2 in RAM alone (`DecodeLoad`): tokens/s;
3. both at once: the decode's tokens/s and the reader's throughput.

The CPU time is the reader's whole cost, not the disk's: on the development VM
`dd iflag=direct bs=256K` of the same bytes takes ~0.15 CPU-s per GB, the reader about 1. The rest
is the reader's own work: planning, the row gather, and the OpenMP thread team that the gather (a
torch op) starts on the reading thread, which spin-waits after every gather.

    python benchmarks/read_cpu_cost.py [--seconds 5] [--threads N] [--chunk-kib K]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
from reader_profile import BackgroundLoop, DecodeLoad  # from this folder

from flashlm import FlashConfig
from flashlm.data.models import default_model_path
from flashlm.methods.mlp import open_checkpoint_store
from flashlm.store import add_kinds
from flashlm.store.reader import StoreReader

KIND = "bundle"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ReadLoad(BackgroundLoop):
    """Whole layer files read back to back on a background thread, as dense streaming reads them."""

    def __init__(self, reader: StoreReader, files: dict) -> None:
        super().__init__()
        self.reader = reader
        self.keys = list(files)
        first = files[self.keys[0]]
        self.out = torch.empty(first.rows, first.width, dtype=first.dtype)
        self.ids = torch.arange(first.rows)

    def _run(self) -> None:
        while not self.stop.is_set():
            for key in self.keys:
                self.reader.read(key, self.ids, self.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--threads", type=int, default=None, help="reader threads (default: flashlm's)")
    parser.add_argument("--chunk-kib", type=int, default=None, help="largest request (default: flashlm's)")
    args = parser.parse_args()

    model_path = default_model_path()
    store = add_kinds(open_checkpoint_store(model_path, FlashConfig()), [KIND])  # derived once
    files = {(layer, KIND): store.row_file(layer, KIND) for layer in range(store.num_layers)}
    reader = StoreReader(
        files,
        direct_io=True,
        threads=args.threads,
        chunk_bytes=None if args.chunk_kib is None else args.chunk_kib * 1024,
    )
    print(
        f"store {store.path}; reader: {reader.mode}, {reader.threads} threads x "
        f"{reader.chunk_bytes // 1024} KiB requests; torch threads: {torch.get_num_threads()}; "
        f"{args.seconds} s per measurement"
    )

    def measure(read: bool, decode: DecodeLoad | None) -> tuple[float, float, float]:
        """(read GB/s, process CPU s per GB read, decode tok/s) over `args.seconds`."""
        bytes_before, cpu_before, steps_before = (
            reader.bytes_read,
            cpu_seconds(),
            decode.steps if decode else 0,
        )
        started = time.perf_counter()
        if read:
            with ReadLoad(reader, files):
                time.sleep(args.seconds)
        else:
            time.sleep(args.seconds)
        elapsed = time.perf_counter() - started
        gb = (reader.bytes_read - bytes_before) / 1e9
        cpu = cpu_seconds() - cpu_before
        steps = (decode.steps - steps_before) if decode else 0
        return gb / elapsed, (cpu / gb if gb else float("nan")), steps / elapsed

    with reader:
        read_alone, cpu_per_gb, _ = measure(True, None)
        print(f"reader alone:        {read_alone:.2f} GB/s, {cpu_per_gb:.2f} CPU s per GB read")
        with DecodeLoad(model_path) as decode:
            time.sleep(1.0)  # warm-up: the first forwards allocate
            _, _, decode_alone = measure(False, decode)
            print(f"in-RAM decode alone: {decode_alone:.1f} tok/s")
            read_shared, _, decode_shared = measure(True, decode)
        print(
            f"both at once:        decode {decode_shared:.1f} tok/s "
            f"({decode_shared / decode_alone:.2f}x alone), "
            f"reader {read_shared:.2f} GB/s ({read_shared / read_alone:.2f}x alone)"
        )
        print(
            f"so the reader spends about {100 * cpu_per_gb:.0f} ms of CPU time per 100 MB here "
            f"(on {len(os.sched_getaffinity(0))} cores)"
        )


if __name__ == "__main__":
    main()
