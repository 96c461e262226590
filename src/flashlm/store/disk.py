"""Random-read throughput of a disk with O_DIRECT (the page cache bypassed): the physical limit on how
fast weights can stream from it (LLM in a flash Fig. 2b). Used by the runtimes, through `disk_profile`,
to set the reader's concurrency and merge gap for the disk at hand; by `flashlm bench` for each
configuration's bound; and by `benchmarks/reader_throughput.py` for the full chunk x threads grid."""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .rowfile import ALIGNMENT


def supports_direct(directory: Path) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT (tmpfs answers EINVAL; some platforms
    have no O_DIRECT at all)."""
    if not hasattr(os, "O_DIRECT"):
        return False
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


def random_read_throughput(
    path: Path | Sequence[Path], chunk: int, threads: int, seconds: float, *, huge_pages: bool = False
) -> dict:
    """`threads` threads each issuing O_DIRECT preads of `chunk` bytes at random aligned offsets of the
    file `path` (of one of the files `path`, chosen in proportion to their sizes), into 4 KiB pages, or
    with `huge_pages` into memory like the reader's staging matrices (`aligned_buffer`), from a huge
    page boundary. A virtual disk may move twice the bytes per second into huge pages: on the
    development VM, 4 MiB requests on 4 threads ran at 1.07 GB/s into 4 KiB pages and 2.7-2.9 GB/s
    into huge pages. The disk profile reads into 4 KiB pages, as when its choices were measured."""
    from .reader import HUGE_PAGE_BYTES, anonymous_memory

    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    slots = [(os.path.getsize(p) - chunk) // ALIGNMENT for p in paths]
    if max(slots, default=-1) < 0:
        raise ValueError(f"No file to read {chunk}-byte chunks from: every one is smaller.")
    paths, slots = zip(*((p, n) for p, n in zip(paths, slots, strict=True) if n >= 0), strict=True)
    stop = time.perf_counter() + seconds
    counts = [0] * threads
    latencies: list[list[float]] = [[] for _ in range(threads)]

    def worker(t: int) -> None:
        fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
        memory = anonymous_memory(chunk + (HUGE_PAGE_BYTES if huge_pages else 0), huge_pages=huge_pages)
        pages = np.frombuffer(memory, dtype=np.uint8)
        start = -pages.ctypes.data % HUGE_PAGE_BYTES if huge_pages else 0
        buf = pages[start : start + chunk]
        rng = random.Random(t)
        try:
            while (now := time.perf_counter()) < stop:
                (i,) = rng.choices(range(len(fds)), weights=slots) if len(fds) > 1 else (0,)
                os.preadv(fds[i], [buf], rng.randrange(slots[i] + 1) * ALIGNMENT)
                latencies[t].append(time.perf_counter() - now)
                counts[t] += 1
        finally:
            for fd in fds:
                os.close(fd)
            del pages, buf  # they export the mapping, which cannot close under them
            memory.close()

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


PROFILE_THREADS = (4, 8, 16)
"""Requests in flight the disk profile tries (fewer is kept unless more is clearly faster: every
reader thread also costs CPU time that decoding shares)."""
PROFILE_SECONDS = 0.15
"""Seconds each cell of the disk profile reads for."""
PROFILE_MIN_BYTES = 64 << 20
"""Smallest set of files worth profiling: reads of less would mostly hit the device's own cache."""
PROFILE_SMALL, PROFILE_MEDIUM, PROFILE_LARGE = 4096, 64 << 10, 256 << 10
"""Request sizes of the profile: one page (the cost of a request), the size that picks the
concurrency, and a large read (the bandwidth)."""


@dataclasses.dataclass(frozen=True)
class DiskProfile:
    """What the disk under a store does with O_DIRECT random reads, measured (`disk_profile`).

    `threads`: requests in flight; `request_cost_s`: amortized seconds of one 4 KiB read at that
    concurrency; `bandwidth`: bytes/s of 256 KiB reads at that concurrency.
    """

    threads: int
    request_cost_s: float
    bandwidth: float

    @property
    def merge_gap_bytes(self) -> int:
        """The gap worth over-reading rather than skipping with another request, on this disk."""
        from .reader import break_even_gap_bytes

        return break_even_gap_bytes(self.request_cost_s, self.bandwidth)


def measure_disk(paths: Sequence[Path], seconds: float | None = None) -> DiskProfile:
    """Profile the disk holding `paths` (files opened with O_DIRECT) by reading them at random while
    this thread computes as a decode step does (`_under_compute`): the fewest `PROFILE_THREADS` whose
    64 KiB reads reach 90% of the best, then the request cost and the bandwidth at that concurrency
    (each cell reads for `seconds`, default `PROFILE_SECONDS`).

    The compute matters: on two busy cores a reader thread whose request completed waits for a time
    slice before it issues the next, so more requests must be in flight than an idle machine needs.
    """
    seconds = PROFILE_SECONDS if seconds is None else seconds

    def cell(chunk: int, threads: int) -> dict:
        return _under_compute(lambda: random_read_throughput(paths, chunk, threads, seconds))

    by_threads = {t: cell(PROFILE_MEDIUM, t) for t in PROFILE_THREADS}
    best = max(c["bytes_per_s"] for c in by_threads.values())
    threads = min(t for t, c in by_threads.items() if c["bytes_per_s"] >= 0.9 * best)
    small, large = cell(PROFILE_SMALL, threads), cell(PROFILE_LARGE, threads)
    return DiskProfile(threads, 1 / small["reads_per_s"], large["bytes_per_s"])


def _under_compute(read: Callable[[], dict]) -> dict:
    """`read()` on another thread while this one runs matrix-vector products on torch's threads."""
    import torch

    result: list[dict] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(read())
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    # 8 MiB, past the CPU caches like a layer's weights; on the CPU even under transformers' meta-device
    # context (a runtime is built while a model loads).
    weights = torch.ones(4096, 1024, dtype=torch.bfloat16, device="cpu")
    vector = torch.ones(1, 1024, dtype=torch.bfloat16, device="cpu")
    worker = threading.Thread(target=run)
    worker.start()
    while worker.is_alive():
        torch.nn.functional.linear(vector, weights)
    worker.join()
    if errors:
        raise errors[0]
    return result[0]


DISK_PROFILES = "disk_profiles.json"
"""Measurements file (`flashlm._measurements`) of the disks profiled on this machine."""


def disk_key(path: str | os.PathLike[str]) -> str:
    """The key a measurement of the disk holding `path` is remembered under: the host and the device."""
    device = os.stat(path).st_dev
    return f"{os.uname().nodename}|{os.major(device)}:{os.minor(device)}"


def disk_profile(paths: Sequence[Path]) -> DiskProfile | None:
    """The profile of the disk holding the files `paths`, measured the first time a store on it is
    read and remembered; None where it cannot be measured (O_DIRECT refused, or less than
    `PROFILE_MIN_BYTES` of files: their reads would come from the device's cache)."""
    from .._measurements import recall, remember

    paths = sorted({Path(p) for p in paths})
    if not paths or sum(p.stat().st_size for p in paths) < PROFILE_MIN_BYTES:
        return None
    key = disk_key(paths[0])
    if (known := recall(DISK_PROFILES, key, DiskProfile)) is not None:
        return known
    try:
        profile = measure_disk(paths)
    except (OSError, ValueError):
        return None  # O_DIRECT refused, or no file large enough for a 256 KiB read
    remember(DISK_PROFILES, key, dataclasses.asdict(profile))
    return profile
