"""Random-read throughput of a disk with O_DIRECT (the page cache bypassed): the physical limit on how
fast weights can stream from it (LLM in a flash Fig. 2b). Used by `flashlm bench` for each
configuration's bound, and by `benchmarks/reader_throughput.py` for the full chunk x threads grid."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from pathlib import Path

import numpy as np

from ..store.rowfile import ALIGNMENT


def supports_direct(directory: Path) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT (tmpfs answers EINVAL)."""
    probe = directory / ".flashlm-odirect-probe"
    probe.write_bytes(b"\0" * ALIGNMENT)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def write_test_file(path: Path, size: int) -> None:
    """Random bytes (so no layer can compress or dedupe them), fsynced so reads hit the disk."""
    block = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for written in range(0, size, len(block)):
            f.write(block[: min(len(block), size - written)])
        f.flush()
        os.fsync(f.fileno())


def random_read_throughput(path: Path, chunk: int, threads: int, seconds: float) -> dict:
    """`threads` threads each issuing O_DIRECT preads of `chunk` bytes at random aligned offsets."""
    size = os.path.getsize(path)
    slots = (size - chunk) // ALIGNMENT
    stop = time.perf_counter() + seconds
    counts = [0] * threads
    latencies: list[list[float]] = [[] for _ in range(threads)]

    def worker(t: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, chunk)
        rng = random.Random(t)
        try:
            while (now := time.perf_counter()) < stop:
                os.preadv(fd, [buf], rng.randrange(slots) * ALIGNMENT)
                latencies[t].append(time.perf_counter() - now)
                counts[t] += 1
        finally:
            os.close(fd)
            buf.close()

    start = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    reads = sum(counts)
    all_lat = np.concatenate([np.asarray(lat) for lat in latencies])
    return {
        "chunk_bytes": chunk,
        "threads": threads,
        "reads": reads,
        "seconds": elapsed,
        "reads_per_s": reads / elapsed,
        "bytes_per_s": reads * chunk / elapsed,
        "latency_mean_s": float(all_lat.mean()),
        "latency_p50_s": float(np.median(all_lat)),
    }
