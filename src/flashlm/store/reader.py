"""`StoreReader`: planned, coalesced, parallel reads of store rows, with O_DIRECT where it works.

Units are small (a SmolLM2 down column is 1152 bytes) and this disk pays a fixed latency per
request, so the reader *plans* each call: sorted ids become byte ranges, adjacent rows become one
run, and two runs separated by a gap cheaper to read than to skip are merged, over-reading the
gap ("read more than needed, in larger chunks, then discard", LLM in a flash §2.2). With O_DIRECT
every request is the 4096-aligned superset of what it wants. Runs are cut into chunks that a
thread pool reads in parallel (`os.preadv` releases the GIL) into one preallocated, page-aligned
buffer; the wanted rows are then gathered from it into the caller's tensor.

`read_in_place`, the decode path, plans and reads in C (`_reader.c`) where a compiler is found: the
same plan, served by a pool of C threads with the GIL released, so a layer's read costs the Python
threads of a 2-core machine one call instead of a planning pass and a Python step per request.
`submit_in_place` starts such a read and returns at once (`PendingRead.result()` waits): the decode
thread hands reads to the C threads itself, with no Python thread between, which on two cores took
the GIL from the decode thread at every read and answered the wait late (SmolLM2-135M's dense
streaming at 50%: 13.5 against 9.5 tokens/s; Qwen2.5-1.5B's 1.95 against 1.60; alternated in one
process, as `benchmarks/alternate.py` does, the README's few-cores section).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import mmap
import os
import sys
import threading
from collections.abc import Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import numpy as np
import torch

from .._native import load_library
from ..errors import ConfigError, FlashLMError, StoreCorruptError, StoreNotFoundError
from .rowfile import ALIGNMENT, RowFile, whole_blocks

NATIVE_SOURCE = Path(__file__).with_name("_reader.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_WaitStats = ctypes.c_int64 * 5
"""What `flashlm_reader_wait` reports of a job (see `_reader.c`)."""
_NO_MEMORY = -3
"""`flashlm_reader_submit`'s status where it could not allocate the plan."""

# Defaults measured on the development disk (virtio /dev/vda, ext4, 2 cores) with
#   python benchmarks/reader_throughput.py --size 1GB --out /var/tmp/reader_throughput.json
# O_DIRECT random reads over a 1 GB file, 1.5 s per cell (MB/s):
#   chunk \ threads     1      2      4      8     16
#   4 KiB              54     82    136    205    207   (13.1k .. 50.5k reads/s)
#   32 KiB            241    466    602    825   1108
#   64 KiB            584    802   1067   1544   1576
#   256 KiB          1266   1613   1526   1561   1441
#   1 MiB            1554   1466   1542   1321   1072
# 4 KiB latency on 1 thread: 101 us mean (97 us p50); best bandwidth 1671 MB/s (512 KiB x 2).
# A second run (--seconds 1) agreed: 64 KiB x 8 threads 1637 MB/s, 20.0 us per 4 KiB read -> 32 KiB gap.
# The disk alone peaks with many small requests (64 KiB x 8-16 threads), but during decode the reader
# shares two cores with the model and every request costs Python time under the GIL. Measured where
# it matters, dense-streaming decode of SmolLM2 at the smallest budget (all 158 MB read per token):
#   python benchmarks/decode_io_settings.py --steps 10      (tok/s, two runs each; a noisy machine)
#   8 x 64 KiB: 5.47, 4.28 | 4 x 128 KiB: 5.46, 4.57 | 4 x 256 KiB: 6.72, 5.62 | 3 x 256 KiB: 4.71, 5.00
#   2 x 512 KiB: 5.71, 7.03 | 2 x 1 MiB: 6.98, 6.10
# Fewer, larger requests win; 4 threads keep the small scattered reads of sparse methods
# concurrent (4 KiB: 13.1k reads/s on 1 thread, 33.6k on 4), so 4 threads x 256 KiB chunks.
# The cost of one more request in a reader running 4 requests at a time is not the 1-thread
# latency but its share of the pipeline: 1 / 33.6k 4 KiB reads/s = 30 us; times the 1398 MB/s of
# 256 KiB reads on 4 threads -> 41.6 KB -> a 40 KiB merge gap. A sweep of StoreReader calls on
# 3456-byte rows (5-50% of 1536 rows, 8 threads) found the fastest gaps at 16-32 KiB, slower at 0
# (25%: 9.8 ms vs 4.6 ms per call) and at >= 128 KiB, near what this model gives.
MEASURED_REQUEST_COST_S = 1 / 33_600
"""Amortized time of one 4 KiB O_DIRECT random read with 4 requests in flight (seconds)."""
MEASURED_BANDWIDTH = 1398e6
"""Random-read bandwidth in 256 KiB chunks on 4 threads (bytes/s)."""
DEFAULT_THREADS = 4
"""Reader threads (see the decode measurement above)."""
DEFAULT_CHUNK_BYTES = 256 * 1024
"""Request size (see the decode measurement above); an in-place read of many rows takes larger ones,
up to `SPREAD_CHUNKS` times this (`StoreReader.request_bytes`)."""
# Every request costs the CPU about the same whatever its size: O_DIRECT reads of a 512 MB file on the
# same kind of VM (one thread, 256 KiB requests) took 86-128 ms of system time, in 2 MiB requests
# 16-19 ms, so ~35-40 us a request. On two cores that time is taken from the decode. Reading Qwen2.5-
# 1.5B at a 50% budget (27.5 MB per layer and kind), 256 KiB requests made 5124 requests per token;
# up to 1 MiB, 1316, and decoding ran 1.12-1.24x faster (benchmarks/alternate.py, io_chunk_bytes
# 262144 against 1048576, three runs, default and AVX2 kernels, 12 of 12 block pairs); SmolLM2's
# layers (1.8 MB per kind) ran 0.90-0.98x as fast with 1 MiB requests (seven runs), probably having
# too few of them to keep the threads busy. So a read is cut into one request per thread where that
# makes requests larger than `chunk_bytes`, up to SPREAD_CHUNKS chunks each. Against 256 KiB
# requests, one process each: Qwen2.5-1.5B dense@50% 1.18x (1.93 / 1.64 tok/s) with default kernels
# and 1.25x with AVX2's, DIP-CA@0.6 1.10x, every block pair faster; SmolLM2's reads make the same
# requests either way. Into staging matrices in huge pages (`aligned_buffer`), where a 4 MiB request
# cost 54-190 us of CPU against 228-389 in 4 KiB pages (README), up to 4 MiB against up to 1 MiB
# (alternated in one process, a /tmp copy of benchmarks/alternate.py): Qwen2.5-1.5B dense@50% 1.12x and
# 1.04x tokens/s in two runs, @70% 1.07x (12 of 14 block pairs faster; default kernels), 0.99x with
# AVX2's; DIP@0.6 and DIP-CA@0.6, whose runs are shorter, 0.99-1.01x. Larger requests are split by the
# disk's queue anyway (`max_sectors_kb` 4096 there): up to 8 MiB and 16 MiB against 4 MiB, Qwen2.5-1.5B
# dense@50% decoded 1.06x / 1.06x, then 0.96x / 0.96x (default kernels), 0.85x / 0.88x (AVX2's).
SPREAD_CHUNKS = 16
"""Largest request of a long in-place read, in chunks (`StoreReader.request_bytes`)."""
# A thread that sleeps while its read finishes leaves its core idle; on a VM the idle vCPU halts, and
# the products right after the wake-up run slower (README, `per_token_path.py`: "a core that slept").
# Where every request of the read is in flight already, so that its end is near, the waiting thread
# polls for it first, yielding the core to any thread ready to run on it between polls. At a 50% budget,
# in one process on the 2-core AMD EPYC VM (benchmarks/alternate.py with a per-block switch in a /tmp
# copy; SmolLM2 24 tokens a block, five blocks each; Qwen2.5-1.5B 8 tokens, five), against sleeping at
# once: dense streaming 1.13x on SmolLM2 (default kernels), 1.30x (AVX2 kernels), 1.04x on Qwen2.5-1.5B
# (1.01x with AVX2's); DIP-CA@0.6 1.08x on SmolLM2, 1.00x on Qwen2.5-1.5B. Polling whatever the read's
# progress gained less (1.09x, 1.22x, 1.00x and 0.98x where both ran). Where the runtime's I/O thread,
# which waits for reads off the decode's path, polled as well, Qwen2.5-1.5B's DIP-CA ran 0.95-0.99x:
# a thread whose wait nobody waits on sleeps at once (`sleep_while_reading`).
WAIT_SPIN_S = 500e-6
"""How long a thread waiting for a read of the C pool whose requests are all in flight polls for its end
before it sleeps."""
_waits = threading.local()
# An O_DIRECT read pins the pages it lands in one by one, and on a VM each page is a descriptor for the
# virtual disk: into transparent huge pages a request cost less CPU time (README, "What the reads cost the
# decode on two cores": 45-59 against 75-95 µs per 1 MiB request), time the decode's products share their
# two cores with. Staging matrices in huge pages against 4 KiB ones, alternated in one process
# (benchmarks/alternate.py, a /tmp copy switching the allocation per variant; 2-core AMD EPYC VM, 50%
# budget): Qwen2.5-1.5B's median compute per token fell 3-7% (dense 180.6 -> 167.7 ms, DIP@0.6
# 70.6 -> 66.8, default kernels; dense 113.5 -> 109.6, DIP-CA@0.6 80.8 -> 74.9, AVX2's) at 1.01-1.06x the
# tokens/s. SmolLM2-135M's staging matrices (1.8 MB a kind) are mostly too small for a 2 MiB page.
HUGE_PAGES = getattr(mmap, "MADV_HUGEPAGE", None)
"""The advice that asks for transparent huge pages (None where Python's `mmap` has none)."""
HUGE_PAGE_BYTES = 2 << 20
"""Bytes of a transparent huge page (x86-64, and arm64 with 4 KiB pages)."""


def sleep_while_reading() -> None:
    """Have the calling thread sleep at once whenever it waits for a read, without polling first
    (`WAIT_SPIN_S`): for background threads (a runtime's I/O thread), whose polling would take a core
    from the thread that computes."""
    _waits.sleep = True


def break_even_gap_bytes(latency_s: float, bandwidth: float, alignment: int = ALIGNMENT) -> int:
    """Largest gap between two runs worth over-reading rather than skipping with a second request.

    Reading the gap costs `gap / bandwidth`; a second request costs one more `latency`. Merging
    wins while `gap / bandwidth < latency`, so the break-even gap is `latency * bandwidth`,
    rounded down to whole `alignment` blocks (what an O_DIRECT gap is made of). For a reader
    with several requests in flight, `latency` is the amortized cost of one request at that
    concurrency (1 / small-read rate), not the single-thread latency.
    """
    if latency_s < 0 or bandwidth <= 0:
        raise ConfigError(f"Need latency >= 0 and bandwidth > 0, got {latency_s} s and {bandwidth} B/s.")
    return int(latency_s * bandwidth) // alignment * alignment


DEFAULT_MERGE_GAP_BYTES = break_even_gap_bytes(MEASURED_REQUEST_COST_S, MEASURED_BANDWIDTH)
"""Gap below which two runs are read as one (the latency x bandwidth model on the measured disk)."""


def merged_read_share(needed: float, gap_units: int) -> float:
    """Expected share of a row file's units that a read of only the needed ones moves, where each unit is
    needed with probability `needed`, independently, and the reader reads across runs of at most
    `gap_units` unneeded units (its merge gap, in rows).

    The needed units, plus each unneeded one that lies in such a run between two needed ones: an
    unneeded unit lies in a run of exactly `l` with probability `l * needed**2 * (1 - needed)**(l - 1)`
    (edges of the file ignored).
    """
    if not 0 <= needed <= 1 or gap_units < 0:
        raise ConfigError(f"Need a share in [0, 1] and a gap >= 0, got {needed!r} and {gap_units!r}.")
    skipped = 1 - needed
    read_across = needed**2 * sum(length * skipped ** (length - 1) for length in range(1, gap_units + 1))
    return needed + skipped * read_across


def merged_read_cost(needed: float, row_bytes: int, merge_gap_bytes: int) -> float:
    """Expected disk time of a read of only the needed units of a row file (each needed with probability
    `needed`), as a share of the time to read every unit in one run.

    Its bytes (`merged_read_share`) plus its runs, each a request that costs as much as reading
    `merge_gap_bytes` (what the break-even gap is, `break_even_gap_bytes`). A needed unit opens a run
    where more than a gap of unneeded ones precedes it: `needed * (1 - needed) ** (gap_units + 1)` runs
    per unit.
    """
    if row_bytes <= 0 or merge_gap_bytes < 0:
        raise ConfigError(f"Need row_bytes > 0 and a gap >= 0, got {row_bytes!r} and {merge_gap_bytes!r}.")
    gap_units = merge_gap_bytes // row_bytes
    runs = needed * (1 - needed) ** (gap_units + 1)
    return merged_read_share(needed, gap_units) + runs * merge_gap_bytes / row_bytes


def pin_for_gpu() -> bool:
    """Whether the host buffers a GPU copies from are pinned (page-locked): wherever CUDA is available.
    Pinned memory crosses by DMA at the bus's speed, pageable memory through the driver's bounce
    buffers. Pinning costs only the allocator's rounding to power-of-two blocks (which the budget
    counts), so it does not wait to know where the model will run."""
    return torch.cuda.is_available()


def anonymous_memory(nbytes: int, *, huge_pages: bool = True) -> mmap.mmap:
    """`nbytes` (at least one) of anonymous memory, page-aligned: private and advised to take transparent
    huge pages (`HUGE_PAGES`), which the kernel grants where it can; or, without `huge_pages`, shared,
    which keeps it in 4 KiB pages whatever the kernel's setting for private memory (the disk profile's
    measurement, and benchmarks comparing the two)."""
    if not huge_pages:
        return mmap.mmap(-1, max(nbytes, 1))
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if HUGE_PAGES is not None:
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages
            memory.madvise(HUGE_PAGES)
    return memory


def aligned_buffer(nbytes: int, *, pinned: bool = False) -> torch.Tensor:
    """A page-aligned CPU uint8 tensor of `nbytes`, as O_DIRECT reads need: private anonymous memory in
    transparent huge pages where the kernel grants them (`HUGE_PAGES`), or with `pinned` page-locked
    memory from torch's pinned allocator. Its storage's bytes are all it took."""
    if not pinned:
        return torch.frombuffer(anonymous_memory(nbytes), dtype=torch.uint8)[:nbytes]
    # the pinned allocator hands out power-of-two blocks: take the whole block, so that the storage
    # (what a budget counts) is what was taken, with room to start on a page boundary
    block = torch.empty(1 << (nbytes + ALIGNMENT - 1).bit_length(), dtype=torch.uint8, pin_memory=True)
    start = -block.data_ptr() % ALIGNMENT
    return block[start : start + nbytes]


def row_matrix(rows: int, width: int, dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
    """A `[rows, width]` matrix laid out like a store file's rows, for `StoreReader.read_in_place`: row 0
    on a page boundary and one spare block after the last row, so an aligned O_DIRECT read of any run of
    rows can land in place (the partial blocks at its ends fall on neighbouring rows or the spare).
    `pinned`: see `aligned_buffer`."""
    return row_matrices([(rows, width)], dtype, pinned=pinned)[0]


def row_matrices(
    shapes: list[tuple[int, int]], dtype: torch.dtype, *, pinned: bool = False
) -> list[torch.Tensor]:
    """A `row_matrix` of each `(rows, width)` of `shapes`, one after another in one allocation, so that
    matrices smaller than a huge page share huge pages (`aligned_buffer`): a 2 MiB page needs 2 MiB of one
    mapping. SmolLM2-135M's staging matrices (1.8 MB each) in one allocation against one each, alternated
    in one process at a 50% budget (benchmarks/alternate.py, a /tmp copy; 2-core AMD EPYC VM): dense
    1.03x tokens/s, DIP@0.6 1.08x (default kernels), dense 1.06x, DIP-CA@0.6 1.07x (AVX2's), faster in
    21 of 24 block pairs (one equal). Pinned, each is an allocation of its own: torch's pinned allocator
    rounds each one up to a power of two, and one for all would round up the total."""
    sizes = [rows * width * dtype.itemsize for rows, width in shapes]
    spans = [whole_blocks(size + ALIGNMENT) for size in sizes]
    if pinned:
        buffers = [aligned_buffer(span, pinned=True) for span in spans]
    else:
        whole = aligned_buffer(sum(spans))
        ends = itertools.accumulate(spans)
        buffers = [whole[end - span : end] for end, span in zip(ends, spans, strict=True)]
    return [
        buffer[:size].view(dtype).view(rows, width)
        for buffer, size, (rows, width) in zip(buffers, sizes, shapes, strict=True)
    ]


@functools.cache
def native_reader() -> ctypes.CDLL | None:
    """The C planner and reader pool (`_reader.c`), or None where it cannot be built (the Python path
    then serves every call)."""
    library = load_library(NATIVE_SOURCE, "reader")
    if library is None:
        return None
    library.flashlm_reader_new.argtypes = [_I]
    library.flashlm_reader_new.restype = _P
    library.flashlm_reader_free.argtypes = [_P]
    library.flashlm_reader_free.restype = None
    library.flashlm_reader_submit.argtypes = [_P, _P, _I, _I, _I, _P]
    library.flashlm_reader_submit.restype = _P
    library.flashlm_reader_wait.argtypes = [_P, _P, _P, _I]
    library.flashlm_reader_wait.restype = None
    library.flashlm_reader_peak_serving.argtypes = [_P]
    library.flashlm_reader_peak_serving.restype = _I
    library.flashlm_plan_rows.argtypes = [_P, _I, _I, _I, _I, _I, _I, _I, _P, _I]
    library.flashlm_plan_rows.restype = _I
    return library


class DirectIOUnavailableError(FlashLMError, OSError):
    """`direct_io=True` was asked for, but a store file cannot be opened with O_DIRECT."""


@dataclass(frozen=True)
class ReadPlan:
    """The requests that serve one call, and where each wanted row lies in them.

    Runs are in file order and do not overlap, except the pieces of a run cut to fit the buffer,
    which may share the block a row straddles (read twice, counted twice). `run_ends` are
    request ends (aligned with O_DIRECT), `run_needed_ends` the end of each run's last wanted
    row: a read that stops at end-of-file before it means the file is truncated, one that stops
    after it is only the aligned tail of a file whose size is not a multiple of the block size.
    """

    run_starts: np.ndarray
    run_ends: np.ndarray
    run_needed_ends: np.ndarray
    row_runs: np.ndarray
    row_starts: np.ndarray

    @property
    def run_bytes(self) -> np.ndarray:
        return self.run_ends - self.run_starts

    @property
    def nbytes(self) -> int:
        return int(self.run_bytes.sum())


def plan_reads(
    ids: np.ndarray,
    row_bytes: int,
    data_offset: int,
    *,
    alignment: int,
    merge_gap_bytes: int,
    max_run_bytes: int,
) -> ReadPlan:
    """Turn sorted unique row ids into runs of bytes to request (vectorized: no loop per row).

    Each row's extent is widened to `alignment` (1 for buffered reads); consecutive extents that
    overlap, touch or lie at most `merge_gap_bytes` apart join one run. A run longer than
    `max_run_bytes` (the I/O buffer) is cut at row boundaries into pieces that fit.
    """
    starts = data_offset + ids.astype(np.int64) * row_bytes
    ends = starts + row_bytes
    lo = starts // alignment * alignment
    hi = -(-ends // alignment) * alignment
    breaks = np.empty(len(ids), dtype=bool)
    breaks[:1] = True
    breaks[1:] = lo[1:] - hi[:-1] > merge_gap_bytes
    first, last, runs = _runs(breaks)
    oversize = hi[last] - lo[first] > max_run_bytes
    if oversize.any():
        # Rows whose starts fall in the same `span`-long window of their run share a piece; a
        # piece then covers < span + row_bytes + 2 * (alignment - 1) = max_run_bytes bytes.
        span = max_run_bytes - row_bytes - 2 * (alignment - 1)
        piece = (starts - starts[first][runs]) // span
        breaks[1:] |= oversize[runs[1:]] & (piece[1:] != piece[:-1])
        first, last, runs = _runs(breaks)
    return ReadPlan(lo[first], hi[last], ends[last], runs, starts)


def _runs(breaks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First row, last row of every run, and each row's run, from a mask of rows opening a run."""
    first = np.flatnonzero(breaks)
    last = np.append(first[1:] - 1, len(breaks) - 1)
    return first, last, np.cumsum(breaks) - 1


def split_chunks(
    starts: np.ndarray, ends: np.ndarray, chunk_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut runs `[starts, ends)` into requests of at most `chunk_bytes`: (run, offset in run, length)."""
    counts = -(-(ends - starts) // chunk_bytes)
    run = np.repeat(np.arange(len(starts)), counts)
    index = np.arange(len(run)) - np.repeat(np.cumsum(counts) - counts, counts)
    offset = index * chunk_bytes
    return run, offset, np.minimum(chunk_bytes, (ends - starts)[run] - offset)


PLAN_SETTINGS = ("threads", "chunk_bytes", "merge_gap_bytes")
"""The reader's attributes that shape its requests besides the ids (`StoreReader.plan_settings`)."""


def check_plan_settings(threads: int, chunk_bytes: int, merge_gap_bytes: int) -> None:
    """Raise `ConfigError` unless a reader can plan its requests with these (`PLAN_SETTINGS`)."""
    if threads < 1:
        raise ConfigError(f"threads must be at least 1, got {threads}.")
    if chunk_bytes < ALIGNMENT or chunk_bytes % ALIGNMENT:
        raise ConfigError(f"chunk_bytes must be a positive multiple of {ALIGNMENT}, got {chunk_bytes}.")
    if merge_gap_bytes < 0:
        raise ConfigError(f"merge_gap_bytes must be non-negative, got {merge_gap_bytes}.")


def spread_request_bytes(nbytes: int, threads: int, chunk_bytes: int) -> int:
    """Request size of an in-place read of about `nbytes` on `threads` reader threads: one request per
    thread, in whole blocks, where that is more than `chunk_bytes` (each request costs the CPU about the
    same whatever its size), but at most `SPREAD_CHUNKS` chunks."""
    per_thread = -(-nbytes // (threads * ALIGNMENT)) * ALIGNMENT
    return min(max(chunk_bytes, per_thread), SPREAD_CHUNKS * chunk_bytes)


@dataclass(frozen=True)
class ReadDone:
    """What one read cost: bytes and read calls issued, and seconds from its start to its last byte."""

    bytes_read: int
    reads: int
    seconds: float


class PendingRead:
    """A `read_in_place` the C pool serves in the background (`StoreReader.submit_in_place`): `result()`
    waits for it (with the GIL released, polling first where its requests are all in flight:
    `WAIT_SPIN_S`) and raises what the read met. Every one is waited for, by its
    owner or by `StoreReader.close`."""

    def __init__(self, reader: StoreReader, pool: int, job: int, f: RowFile) -> None:
        self._reader, self._pool, self._job, self._file = reader, pool, job, f
        self._lock = threading.Lock()
        self._done: ReadDone | None = None
        self._error: BaseException | None = None

    def result(self) -> ReadDone:
        with self._lock:
            if self._done is None and self._error is None:
                self._finish()
        if self._error is not None:
            raise self._error
        return self._done

    def _finish(self) -> None:
        # a ctypes array, not numpy's `.ctypes`, which imports a module: a reader closed while Python
        # shuts down (its finalizer) waits here when imports fail
        stats = _WaitStats()
        spin_ns = 0 if getattr(_waits, "sleep", False) else int(WAIT_SPIN_S * 1e9)
        native_reader().flashlm_reader_wait(self._pool, self._job, stats, spin_ns)
        nbytes, calls, eof_at, error, nanoseconds = stats
        self._reader._count(self, nbytes, calls)
        f = self._file
        if error:
            self._error = OSError(error, os.strerror(error), str(f.path))
        elif eof_at >= 0:
            self._error = StoreCorruptError(
                f"Store file {f.path} is truncated: end of file at byte {eof_at}, but row data runs to "
                f"byte {f.data_offset + f.nbytes}. Convert the store again."
            )
        else:
            self._done = ReadDone(nbytes, calls, nanoseconds / 1e9)


class _Target(ctypes.Structure):
    """`Target` of `_reader.c`: where reads of one file's rows land."""

    _fields_ = [
        ("pool", _P),
        ("fd", _I),
        ("rows", _I),
        ("row_bytes", _I),
        ("data_offset", _I),
        ("alignment", _I),
        ("merge_gap", _I),
        ("base", _P),
    ]


class InPlaceReads:
    """Reads of one store file's rows into one matrix in place, on the C pool
    (`StoreReader.in_place_reads`): the file, the matrix and the C call's standing arguments are checked
    and built once, so that each `submit` costs the C call and a few lines of Python. A decode step
    submits every layer's reads through these (`FlashRuntime`): inside a decode on two cores, the Python
    around the C call of a submission that checked everything each time took the decode thread about
    0.1 ms of CPU per read, ten times what it takes alone. One thread submits through one at a time."""

    def __init__(self, reader: StoreReader, key: Hashable, matrix: torch.Tensor, pool: int) -> None:
        f = reader.files[key]
        self._reader, self._file = reader, f
        self.matrix = matrix
        """The matrix the rows land in (held here: the C threads write into its memory)."""
        self._target = _Target(
            pool,
            reader._fds[key],
            min(f.rows, matrix.shape[0]),  # a matrix of the file's first rows takes only those
            f.row_bytes,
            f.data_offset,
            ALIGNMENT if reader.mode == "direct" else 1,
            reader.merge_gap_bytes,
            matrix.data_ptr(),
        )
        self._target_address = ctypes.addressof(self._target)
        self._status = _I()
        self._status_address = ctypes.addressof(self._status)

    def submit(self, ids: torch.Tensor, *, start: bool = True) -> PendingRead:
        """Start reading rows `ids` (a sorted, unique 1-D int64 CPU tensor) into their rows of the matrix
        and return at once (`StoreReader.submit_in_place`, whose `start` this is)."""
        reader = self._reader
        if reader._closed:
            raise ValueError("This StoreReader is closed.")
        StoreReader._check_id_type(ids)
        if not ids.is_contiguous():
            ids = ids.contiguous()
        pool, count = reader._native_pool(), ids.shape[0]  # a forked child's pool is its own
        if pool != self._target.pool:
            self._target.pool = pool
        job = native_reader().flashlm_reader_submit(
            self._target_address,
            ids.data_ptr(),
            count,
            reader.request_bytes(count * self._file.row_bytes),
            int(start),
            self._status_address,
        )
        status = self._status.value
        if status:  # the planner refused the ids (say which way), or ran out of memory
            StoreReader._check_id_values(self._file, ids, self._target.rows)
            raise ValueError(
                "out of memory planning the reads."
                if status == _NO_MEMORY
                else f"read planning failed ({status})."
            )
        pending = PendingRead(reader, pool, job, self._file)
        with reader._lock:
            reader._outstanding.add(pending)
        return pending


class StoreReader:
    """Reads rows of store files into caller-owned tensors: planned, coalesced, parallel, counted.

    Every file is opened once, here; so are the thread pool and the I/O buffer. `read` may be
    called from any thread, one call at a time (a lock serializes calls: they share the buffer).

    Args:
        files: what to read, by key (the runtime uses `(layer, kind)`).
        direct_io: `None` uses O_DIRECT where the file system allows it and falls back to buffered
            reads otherwise (`fallback_reason` says why); `True` requires it
            (`DirectIOUnavailableError` otherwise); `False` reads through the page cache.
        threads: parallel readers (`DEFAULT_THREADS`, measured).
        chunk_bytes: request size, a multiple of 4096 (`DEFAULT_CHUNK_BYTES`, measured); an in-place
            read of many rows cuts them into larger requests, up to `SPREAD_CHUNKS` chunks each
            (`request_bytes`).
        merge_gap_bytes: runs at most this far apart are read as one (`DEFAULT_MERGE_GAP_BYTES`,
            the latency x bandwidth model; 0 merges only touching runs).
        buffer_bytes: size of the I/O buffer; a call needing more is served in batches. Default:
            the largest file's size plus two alignment blocks, so any call fits in one batch. 0: no
            buffer, for a reader that serves only `read_all` and `read_in_place` (which read into the
            caller's memory).
    """

    mode: str
    fallback_reason: str | None
    bytes_read: int
    reads_issued: int
    buffer_bytes: int

    def __init__(
        self,
        files: Mapping[Hashable, RowFile],
        *,
        direct_io: bool | None = None,
        threads: int | None = None,
        chunk_bytes: int | None = None,
        merge_gap_bytes: int | None = None,
        buffer_bytes: int | None = None,
    ) -> None:
        if not files:
            raise ConfigError("StoreReader needs at least one file to read.")
        self.threads = DEFAULT_THREADS if threads is None else threads
        self.chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self.merge_gap_bytes = DEFAULT_MERGE_GAP_BYTES if merge_gap_bytes is None else merge_gap_bytes
        largest_row = max(f.row_bytes for f in files.values())
        min_buffer = largest_row + 2 * ALIGNMENT
        wanted = (
            max(f.nbytes for f in files.values()) + 2 * ALIGNMENT if buffer_bytes is None else buffer_bytes
        )
        check_plan_settings(self.threads, self.chunk_bytes, self.merge_gap_bytes)
        if 0 < wanted < min_buffer:
            raise ConfigError(
                f"buffer_bytes={wanted} cannot hold one row ({largest_row} bytes) plus alignment padding: "
                f"use at least {min_buffer}."
            )

        self.files = dict(files)
        self.bytes_read = 0
        self.reads_issued = 0
        self._fds: dict[Hashable, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = True  # until everything below exists
        self._open_all(direct_io)
        self.buffer_bytes = max(whole_blocks(wanted), ALIGNMENT)
        self._serves_rows = wanted > 0
        self._buffer = anonymous_memory(self.buffer_bytes, huge_pages=False)  # page-aligned for O_DIRECT
        self._view = memoryview(self._buffer)
        self._windows: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        if self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="flashlm-reader")
        self._native: tuple[int, int] | None = None
        """(pid, handle) of the C reader pool `read_in_place` uses, made on first use by that process."""
        self._outstanding: set[PendingRead] = set()
        """Reads submitted to the C pool and not yet waited for (`close` waits for them)."""
        self._closed = False

    def _open_all(self, direct_io: bool | None) -> None:
        """Open every file once; settle `mode` and `fallback_reason`."""
        self.fallback_reason = None
        direct_flag = getattr(os, "O_DIRECT", None)
        if direct_io is not False and direct_flag is None:
            self.fallback_reason = f"O_DIRECT is not available on {sys.platform}"
        elif direct_io is not False:
            for key, f in self.files.items():
                try:
                    self._fds[key] = self._open(f, os.O_RDONLY | direct_flag)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        self._close_fds()
                        raise
                    self.fallback_reason = f"O_DIRECT not supported by the file system of {f.path}"
                    break
        if direct_io is True and self.fallback_reason is not None:
            self._close_fds()
            raise DirectIOUnavailableError(
                errno.EINVAL,
                f"direct_io=True, but {self.fallback_reason}. Put the store on a disk file system "
                "(ext4, xfs, ...) or pass direct_io=None to fall back to buffered reads.",
            )
        self.mode = "direct" if direct_io is not False and self.fallback_reason is None else "buffered"
        if self.mode == "buffered":
            self._close_fds()
            for key, f in self.files.items():
                self._fds[key] = self._open(f, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    # Reads are planned already; kernel readahead would only over-read.
                    os.posix_fadvise(self._fds[key], 0, 0, os.POSIX_FADV_RANDOM)

    def _open(self, f: RowFile, flags: int) -> int:
        try:
            fd = os.open(f.path, flags)
        except FileNotFoundError as exc:
            self._close_fds()
            raise StoreNotFoundError(f"Store file {f.path} does not exist: is the store complete?") from exc
        size = os.fstat(fd).st_size
        if size < f.data_offset + f.nbytes:
            os.close(fd)
            self._close_fds()
            raise StoreCorruptError(
                f"Store file {f.path} is truncated: {size} bytes, but its {f.rows} rows end at byte "
                f"{f.data_offset + f.nbytes}. Convert the store again."
            )
        return fd

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def plan(self, key: Hashable, ids: torch.Tensor) -> ReadPlan:
        """The read plan `read(key, ids, ...)` would follow (for stats, tests and benchmarks)."""
        f = self.files[key]
        return plan_reads(
            ids.numpy(),
            f.row_bytes,
            f.data_offset,
            alignment=ALIGNMENT if self.mode == "direct" else 1,
            merge_gap_bytes=self.merge_gap_bytes,
            max_run_bytes=self.buffer_bytes,
        )

    def read(self, key: Hashable, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Fill `out[k]` with row `ids[k]` of `files[key]`.

        `ids` is a 1-D int64 CPU tensor, sorted ascending and unique; `out` a CPU tensor of the
        file's dtype with at least `len(ids)` rows of its width (rows past `len(ids)` are left alone).
        """
        if self._closed:
            raise ValueError("This StoreReader is closed.")
        if key not in self.files:
            raise KeyError(f"No store file under key {key!r}.")
        if not self._serves_rows:
            raise ValueError(
                "This StoreReader has no I/O buffer (buffer_bytes=0): it serves read_all and "
                "read_in_place only."
            )
        f = self.files[key]
        self._check_args(f, ids, out)
        if len(ids) == 0:
            return
        with self._lock:
            plan = self.plan(key, ids)
            for first_run, last_run in self._batches(plan.run_bytes):
                self._read_batch(self._fds[key], f, plan, first_run, last_run, out)

    @staticmethod
    def _check_args(f: RowFile, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Types, shapes, and the ids' range and order, for a read gathered into `out`."""
        StoreReader._check_id_type(ids)
        if out.dtype != f.dtype or out.dim() != 2 or out.device.type != "cpu":
            raise ValueError(
                f"out must be a 2-D CPU tensor of {f.dtype}, got {out.dtype} {tuple(out.shape)}."
            )
        if out.shape[0] < len(ids) or out.shape[1] != f.width:
            raise ValueError(f"out {tuple(out.shape)} cannot hold {len(ids)} rows of width {f.width}.")
        StoreReader._check_id_values(f, ids)

    @staticmethod
    def _check_id_type(ids: torch.Tensor) -> None:
        if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_cpu:
            raise ValueError(
                f"ids must be a 1-D int64 CPU tensor, got {ids.dtype} {tuple(ids.shape)} on {ids.device}."
            )

    @staticmethod
    def _check_id_values(f: RowFile, ids: torch.Tensor, rows: int | None = None) -> None:
        """Rows of the file, sorted and unique, and below `rows` (the rows of a matrix they land in)."""
        if len(ids) and (int(ids[0]) < 0 or int(ids[-1]) >= f.rows):
            raise ValueError(f"ids must lie in [0, {f.rows}), got {int(ids[0])}..{int(ids[-1])}.")
        if rows is not None and len(ids) and int(ids[-1]) >= rows:
            raise ValueError(f"matrix has {rows} rows; row {int(ids[-1])} does not fit.")
        if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("ids must be sorted ascending and unique.")

    @staticmethod
    def _check_matrix(f: RowFile, matrix: torch.Tensor, direct: bool) -> None:
        """A matrix reads of `f`'s rows can land in, in place: a `row_matrix` of its shape or first rows."""
        if matrix.dtype != f.dtype or matrix.dim() != 2 or matrix.device.type != "cpu":
            raise ValueError(
                f"matrix must be a 2-D CPU tensor of {f.dtype}, got {matrix.dtype} {tuple(matrix.shape)}."
            )
        if matrix.shape[1] != f.width:
            raise ValueError(f"matrix {tuple(matrix.shape)} cannot hold rows of width {f.width}.")
        if not matrix.is_contiguous():
            raise ValueError(f"matrix must be a contiguous [rows, {f.width}] {f.dtype} row_matrix.")
        if direct and matrix.data_ptr() % mmap.PAGESIZE:
            raise ValueError("O_DIRECT reads need a page-aligned matrix: allocate it with `row_matrix`.")

    def _batches(self, run_bytes: np.ndarray) -> list[tuple[int, int]]:
        """Consecutive run ranges `[first, last)` whose bytes fit the buffer (a loop per run only when
        a call needs more than one batch)."""
        if run_bytes.sum() <= self.buffer_bytes:
            return [(0, len(run_bytes))]
        batches, first, used = [], 0, 0
        for run, size in enumerate(run_bytes.tolist()):
            if used + size > self.buffer_bytes:
                batches.append((first, run))
                first, used = run, 0
            used += size
        batches.append((first, len(run_bytes)))
        return batches

    def _read_batch(
        self, fd: int, f: RowFile, plan: ReadPlan, first: int, last: int, out: torch.Tensor
    ) -> None:
        """Read runs `[first, last)` back to back into the buffer, then gather their rows into `out`."""
        starts, ends = plan.run_starts[first:last], plan.run_ends[first:last]
        run_pos = np.cumsum(ends - starts) - (ends - starts)  # each run's place in the buffer
        run, within, length = split_chunks(starts, ends, self.chunk_bytes)
        offsets = starts[run] + within
        needed = np.clip(plan.run_needed_ends[first:last][run] - offsets, 0, length)
        requests = list(
            zip(
                offsets.tolist(),
                length.tolist(),
                (run_pos[run] + within).tolist(),
                needed.tolist(),
                strict=True,
            )
        )
        self._issue(fd, f, requests)

        rows = slice(*np.searchsorted(plan.row_runs, [first, last]).tolist())
        row_runs = plan.row_runs[rows] - first
        byte_pos = run_pos[row_runs] + plan.row_starts[rows] - starts[row_runs]
        elem_pos = torch.from_numpy(byte_pos // f.dtype.itemsize)
        target = out[rows]
        if target.is_contiguous():
            torch.index_select(self._rows_view(f), 0, elem_pos, out=target)
        else:
            target.copy_(self._rows_view(f).index_select(0, elem_pos))

    def _rows_view(self, f: RowFile) -> torch.Tensor:
        """The buffer as overlapping rows: row `e` is `width` elements starting at element `e`."""
        key = (f.dtype, f.width)
        if key not in self._windows:
            elems = torch.frombuffer(self._buffer, dtype=f.dtype)
            self._windows[key] = elems.as_strided((elems.numel() - f.width + 1, f.width), (1, 1))
        return self._windows[key]

    def request_bytes(self, nbytes: int) -> int:
        """Request size of an in-place read of about `nbytes` by this reader (`spread_request_bytes`)."""
        return spread_request_bytes(nbytes, self.threads, self.chunk_bytes)

    @property
    def plan_settings(self) -> dict[str, int]:
        """What shapes this reader's requests besides the ids (`threads`, `chunk_bytes`,
        `merge_gap_bytes`): a trace records them so that the simulator plans its reads as they were made."""
        return {name: getattr(self, name) for name in PLAN_SETTINGS}

    def read_in_place(self, key: Hashable, ids: torch.Tensor, matrix: torch.Tensor) -> ReadDone:
        """Fill row `ids[k]` of `matrix` with row `ids[k]` of `files[key]`, straight from the disk: the
        planned runs (coalesced and merged as `read` plans them) land at their own rows, with no I/O
        buffer and no gather (LLM in a flash's preallocated matrix, filled in place).

        `matrix` is a `row_matrix` of the file's shape (or its first rows). Each run is read whole, so
        rows of `matrix` inside a merged gap, and with O_DIRECT the bytes the aligned run shares with
        its neighbour rows (and the spare block after the matrix), receive the file's bytes for those
        rows: they hold this file's rows or what they held before, never anything else.

        Returns what this read cost (the reader's counters, `bytes_read` and `reads_issued`, also count
        the reads other threads finish meanwhile).
        """
        if not len(ids):
            return ReadDone(0, 0, 0.0)  # no job for the pool to queue and finish
        pending = self.submit_in_place(key, ids, matrix)
        if pending is not None:
            return pending.result()
        return self._read_in_place_in_python(key, ids, matrix)

    def submit_in_place(
        self, key: Hashable, ids: torch.Tensor, matrix: torch.Tensor, *, start: bool = True
    ) -> PendingRead | None:
        """Start `read_in_place(key, ids, matrix)` on the C pool and return at once: the read runs after
        the ones submitted before it, with no Python thread involved, and `result()` waits for it. None
        where there is no C pool (nothing started: call `read_in_place`, which reads in Python). Bad
        arguments raise here, before anything is read. A caller that reads into the same matrix again
        and again submits through `in_place_reads` instead, which checks the matrix once.

        A submission wakes one sleeping thread of the pool, and each thread that takes a request wakes
        the next while more wait. `start=False` queues the read without waking any (those awake take
        it): a caller submitting several reads at once passes it to all but the last, which starts them
        all. Waiting for any read wakes them too."""
        reads = self.in_place_reads(key, matrix)
        if reads is None:
            f = self.files[key]
            self._check_id_type(ids)
            self._check_id_values(f, ids, matrix.shape[0])
            return None
        return reads.submit(ids, start=start)

    def in_place_reads(self, key: Hashable, matrix: torch.Tensor) -> InPlaceReads | None:
        """Reads of `files[key]`'s rows into `matrix` in place (`InPlaceReads.submit`), the matrix checked
        here: a `row_matrix` of the file's shape or its first rows. None where there is no C pool."""
        if self._closed:
            raise ValueError("This StoreReader is closed.")
        self._check_matrix(self.files[key], matrix, self.mode == "direct")
        pool = self._native_pool()
        return None if pool is None else InPlaceReads(self, key, matrix, pool)

    def _count(self, pending: PendingRead, nbytes: int, calls: int) -> None:
        """Count a waited-for read of the C pool's."""
        with self._lock:
            self._outstanding.discard(pending)
            self.bytes_read += nbytes
            self.reads_issued += calls

    def _read_in_place_in_python(self, key: Hashable, ids: torch.Tensor, matrix: torch.Tensor) -> ReadDone:
        """`read_in_place` without the C library: planned in numpy, read by the Python thread pool."""
        f = self.files[key]
        plan = plan_reads(
            ids.numpy(),
            f.row_bytes,
            f.data_offset,
            alignment=ALIGNMENT if self.mode == "direct" else 1,
            merge_gap_bytes=self.merge_gap_bytes,
            max_run_bytes=max(f.nbytes + 2 * ALIGNMENT, ALIGNMENT),
        )
        starts, ends = plan.run_starts, plan.run_ends
        run, within, length = split_chunks(starts, ends, self.request_bytes(len(ids) * f.row_bytes))
        offsets = starts[run] + within
        needed = np.clip(plan.run_needed_ends[run] - offsets, 0, length)
        # Byte b of the file lands at byte b - data_offset of the matrix (requests never start before
        # data_offset: it is block-aligned).
        view = memoryview((ctypes.c_char * (f.nbytes + ALIGNMENT)).from_address(matrix.data_ptr())).cast("B")
        requests = list(
            zip(
                offsets.tolist(),
                length.tolist(),
                (offsets - f.data_offset).tolist(),
                needed.tolist(),
                strict=True,
            )
        )
        with self._lock:
            return self._issue(self._fds[key], f, requests, view)

    def _native_pool(self) -> int | None:
        """This process's C reader pool, made on first use (a forked child makes its own: threads do not
        survive a fork); None without the C library."""
        library = native_reader()
        if library is None:
            return None
        if self._native is None or self._native[0] != os.getpid():
            with self._lock:
                if self._native is None or self._native[0] != os.getpid():
                    handle = library.flashlm_reader_new(self.threads)
                    if not handle:
                        return None
                    self._native = (os.getpid(), handle)
        return self._native[1]

    def read_all(self, key: Hashable, out: torch.Tensor) -> ReadDone:
        """Read every row of `files[key]` straight into `out`, with no intermediate buffer or copy.

        For callers that read whole files every time (an Endor layer per token): `out` is a
        contiguous CPU uint8 tensor of at least the file's bytes rounded up to `ALIGNMENT`, and, for
        O_DIRECT, starts at a page-aligned address (allocate it with `aligned_buffer`). Returns what the
        read cost.
        """
        if self._closed:
            raise ValueError("This StoreReader is closed.")
        f = self.files[key]
        length = whole_blocks(f.nbytes) if self.mode == "direct" else f.nbytes
        if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.numel() < length:
            raise ValueError(f"out must be a contiguous 1-D uint8 tensor of at least {length} bytes.")
        if self.mode == "direct" and out.data_ptr() % mmap.PAGESIZE:
            raise ValueError("O_DIRECT reads need a page-aligned `out`: allocate it with `aligned_buffer`.")
        _, positions, sizes = split_chunks(np.array([0]), np.array([length]), self.chunk_bytes)
        requests = [
            (f.data_offset + pos, size, pos, max(0, min(size, f.nbytes - pos)))
            for pos, size in zip(positions.tolist(), sizes.tolist(), strict=True)
        ]
        with self._lock:
            return self._issue(self._fds[key], f, requests, memoryview(out.numpy()))

    def _issue(
        self, fd: int, f: RowFile, requests: list[tuple[int, int, int, int]], view: memoryview | None = None
    ) -> ReadDone:
        """Run the requests into `view` (default: the I/O buffer), spread round-robin over the pool;
        update the counters and return what these requests cost."""
        started = perf_counter()
        view = self._view if view is None else view
        if self._pool is None or len(requests) == 1:
            done = [self._read_requests(fd, f, requests, view)]
        else:
            groups = [requests[t :: self.threads] for t in range(min(self.threads, len(requests)))]
            futures = [self._pool.submit(self._read_requests, fd, f, group, view) for group in groups]
            wait(futures)  # every worker done with the buffer before any error propagates
            done = [future.result() for future in futures]
        nbytes, calls = sum(nbytes for nbytes, _ in done), sum(calls for _, calls in done)
        self.bytes_read += nbytes
        self.reads_issued += calls
        return ReadDone(nbytes, calls, perf_counter() - started)

    def _read_requests(
        self, fd: int, f: RowFile, requests: list[tuple[int, int, int, int]], view: memoryview
    ) -> tuple[int, int]:
        """Read each `(offset, length, position in view, needed)`; return (bytes read, syscalls)."""
        nbytes = calls = 0
        for offset, length, pos, needed in requests:
            got = 0
            while got < length:
                n = os.preadv(fd, [view[pos + got : pos + length]], offset + got)
                calls += 1
                nbytes += n
                got += n
                if got >= length or got >= needed:  # complete, or only the aligned tail is past EOF
                    break
                if n == 0 or (self.mode == "direct" and got % ALIGNMENT):
                    raise StoreCorruptError(
                        f"Store file {f.path} is truncated: end of file at byte {offset + got}, but row "
                        f"data runs to byte {f.data_offset + f.nbytes}. Convert the store again."
                    )
        return nbytes, calls

    def close(self) -> None:
        """Close the files, stop the pool, free the buffer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for pending in list(self._outstanding):  # the pool's threads may still be writing into memory
            with contextlib.suppress(OSError, StoreCorruptError):
                pending.result()
        if self._native is not None and self._native[0] == os.getpid():
            native_reader().flashlm_reader_free(self._native[1])
        self._native = None
        self._close_fds()
        self._windows.clear()
        self._view.release()
        with contextlib.suppress(BufferError):  # a caller still holds a view: freed with the last one
            self._buffer.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
