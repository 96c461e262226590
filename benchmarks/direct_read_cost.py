"""What an O_DIRECT read costs the CPU, by request size and by the page size of the memory it lands in.

One thread reads the default model's store files front to back with `os.preadv`, O_DIRECT, in
requests of each size, into an anonymous buffer of 4 KiB pages or one advised to use transparent
huge pages (`MADV_HUGEPAGE`, private: shared anonymous memory gets none). Per cell: throughput, and
the process's CPU time (user + system, `getrusage`) per MB and per request. The kernel pins and maps
every page a request lands in, so on a VM whose per-page cost is high the CPU time follows the bytes
more than the requests, and larger pages cut it. flashlm's reader threads pay this cost beside the
decode; on two cores it is the bulk of a budget-bound step's cache bookkeeping.

    python benchmarks/direct_read_cost.py [--mb 256] [--sizes-kib 64,256,1024,4096]
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from pathlib import Path

from read_cpu_cost import cpu_seconds  # from this folder

from flashlm import FlashConfig
from flashlm.data.models import default_model_path
from flashlm.methods.mlp import open_checkpoint_store
from flashlm.store.reader import HUGE_PAGE_BYTES, anonymous_memory


def anon_huge_kib() -> int:
    """This process's anonymous memory in transparent huge pages."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def buffer(nbytes: int, huge: bool) -> mmap.mmap:
    """Anonymous memory in huge pages (as the reader's staging) or in 4 KiB pages."""
    memory = anonymous_memory(nbytes, huge_pages=huge)
    for offset in range(0, nbytes, mmap.PAGESIZE):  # fault every page in before timing
        memory[offset] = 0
    return memory


def measure(files: list[Path], request: int, huge: bool, total: int) -> dict[str, float]:
    memory = buffer(max(request, HUGE_PAGE_BYTES), huge)
    target = memoryview(memory)[:request]
    huge_kib = anon_huge_kib()
    fds = [os.open(path, os.O_RDONLY | os.O_DIRECT) for path in files]
    sizes = [os.fstat(fd).st_size // request * request for fd in fds]
    requests = nbytes = 0
    cpu, wall = cpu_seconds(), time.perf_counter()
    try:
        while nbytes < total:
            for fd, size in zip(fds, sizes, strict=True):
                for offset in range(0, size, request):
                    nbytes += os.preadv(fd, [target], offset)
                    requests += 1
    finally:
        for fd in fds:
            os.close(fd)
    cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
    return {
        "mb_s": nbytes / wall / 1e6,
        "cpu_ms_per_mb": 1e3 * cpu / (nbytes / 1e6),
        "cpu_us_per_request": 1e6 * cpu / requests,
        "huge_pages": huge_kib > 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=256, help="megabytes read per cell")
    parser.add_argument("--sizes-kib", default="64,256,1024,4096", help="request sizes, KiB, comma-separated")
    args = parser.parse_args()
    sizes = [int(size) * 1024 for size in args.sizes_kib.split(",")]
    if args.mb < 1 or any(size < 4096 or size % 4096 for size in sizes):
        parser.error("--mb must be positive and every size a positive multiple of 4 KiB")
    store = open_checkpoint_store(default_model_path(), FlashConfig())
    files = sorted(p for p in Path(store.path).rglob("*.safetensors") if p.stat().st_size >= max(sizes))
    if not files:
        parser.error(f"no store file under {store.path} holds a request of {max(sizes)} bytes")
    print(f"{len(files)} files of {store.path}, {args.mb} MB per cell, one thread, O_DIRECT\n")
    print("| request | pages | MB/s | CPU ms per MB | CPU us per request |")
    print("|---|---|---|---|---|")
    for size in sizes:
        for huge in (False, True):
            cell = measure(files, size, huge, args.mb * 10**6)
            pages = ("2 MiB (THP)" if cell["huge_pages"] else "4 KiB (no THP given)") if huge else "4 KiB"
            print(
                f"| {size // 1024} KiB | {pages} | {cell['mb_s']:.0f} | {cell['cpu_ms_per_mb']:.3f} "
                f"| {cell['cpu_us_per_request']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
