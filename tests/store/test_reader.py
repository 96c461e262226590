"""StoreReader: correct rows in both modes, planned requests (coalesced, merged, aligned), fallback,
errors, batching, and counters that agree with the kernel."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import NO_NATIVE_READER, needs_native_reader

from flashlm.engine.io_thread import IOThread
from flashlm.errors import ConfigError, FlashLMError, StoreCorruptError
from flashlm.sim.simulator import plan_trace_reads
from flashlm.store import reader as reader_mod
from flashlm.store.disk import supports_direct
from flashlm.store.reader import (
    ALIGNMENT,
    SPREAD_CHUNKS,
    DirectIOUnavailableError,
    StoreReader,
    aligned_buffer,
    anonymous_memory,
    break_even_gap_bytes,
    merged_read_cost,
    merged_read_share,
    plan_reads,
    row_matrices,
    row_matrix,
    split_chunks,
)
from flashlm.store.rowfile import RowFile


def make_file(
    directory: Path,
    rows: int,
    width: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    name: str = "m.bin",
) -> tuple[RowFile, torch.Tensor]:
    """A store-like file: 4096 bytes of header, then the matrix, no padding at the end."""
    data = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)
    path = directory / name
    with open(path, "wb") as f:
        f.write(b"\xee" * ALIGNMENT)
        f.write(data.view(torch.uint8).numpy().tobytes())
    return RowFile(path, ALIGNMENT, rows, width, dtype), data


@pytest.mark.parametrize(
    ("width", "expected"),
    [
        (2048, 1.0),  # 4 KiB rows: one whole page each
        (3072, 4 / 3),  # 6 KiB rows: every row spans two pages
        (576, 40 * 4096 / (32 * 1152)),  # SmolLM2 down columns: 8 of every 32 straddle two pages
    ],
)
def test_read_amplification_counts_whole_pages(width: int, expected: float) -> None:
    rows = 64 if width != 576 else 32
    f = RowFile(Path("unused"), ALIGNMENT, rows, width, torch.bfloat16)
    assert f.read_amplification == pytest.approx(expected)


def reference(f: RowFile, ids: torch.Tensor) -> np.ndarray:
    """The rows read with plain numpy, independently of the reader."""
    raw = np.fromfile(f.path, dtype=np.uint8, offset=f.data_offset, count=f.nbytes).reshape(
        f.rows, f.row_bytes
    )
    return raw[ids.numpy()]


def random_ids(rows: int, count: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.sort(rng.choice(rows, count, replace=False)))


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(
    ("width", "dtype"), [(576, torch.bfloat16), (1728, torch.bfloat16), (100, torch.float32)]
)
def test_random_subsets_match_reference(
    direct_dir: Path, direct: bool, width: int, dtype: torch.dtype
) -> None:
    f, _ = make_file(direct_dir, rows=1000, width=width, dtype=dtype)
    assert f.row_bytes % ALIGNMENT
    with StoreReader({"k": f}, direct_io=direct, threads=3, chunk_bytes=2 * ALIGNMENT) as reader:
        assert reader.mode == ("direct" if direct else "buffered")
        for seed, count in enumerate([1, 2, 17, 300, 999, 1000]):
            ids = random_ids(f.rows, count, seed)
            out = torch.full((count + 3, width), 7, dtype=dtype)
            reader.read("k", ids, out)
            np.testing.assert_array_equal(out[:count].view(torch.uint8).numpy(), reference(f, ids))
            assert bool((out[count:] == 7).all())
        for ids in (torch.tensor([0]), torch.tensor([f.rows - 1]), torch.arange(f.rows)):
            out = torch.empty(len(ids), width, dtype=dtype)
            reader.read("k", ids, out)
            np.testing.assert_array_equal(out.view(torch.uint8).numpy(), reference(f, ids))


def test_several_files_and_non_contiguous_out(direct_dir: Path) -> None:
    a, _ = make_file(direct_dir, 300, 576, name="a.bin", seed=1)
    b, _ = make_file(direct_dir, 200, 64, dtype=torch.float32, name="b.bin", seed=2)
    with StoreReader({(0, "x"): a, (1, "x"): b}) as reader:
        ids = random_ids(200, 50, 3)
        out = torch.zeros(64, 50, dtype=torch.float32).t()  # rows are strided
        reader.read((1, "x"), ids, out)
        np.testing.assert_array_equal(out.contiguous().view(torch.uint8).numpy(), reference(b, ids))
        out_a = torch.empty(50, 576, dtype=torch.bfloat16)
        reader.read((0, "x"), ids, out_a)
        np.testing.assert_array_equal(out_a.view(torch.uint8).numpy(), reference(a, ids))


def test_contiguous_ids_are_one_request_per_chunk(direct_dir: Path) -> None:
    f, _ = make_file(direct_dir, 1000, 576)  # 1152-byte rows
    chunk = 4 * ALIGNMENT
    for direct in (True, False):
        with StoreReader({0: f}, direct_io=direct, chunk_bytes=chunk, merge_gap_bytes=0) as reader:
            ids = torch.arange(100, 400)
            reader.read(0, ids, torch.empty(300, 576, dtype=torch.bfloat16))
            run = reader.plan(0, ids)
            assert len(run.run_starts) == 1
            assert reader.reads_issued == -(-run.nbytes // chunk)
            assert reader.bytes_read == run.nbytes
            if not direct:
                assert run.nbytes == 300 * f.row_bytes


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (6, 4 * ALIGNMENT),  # little to read: chunk-sized requests
        (29, 10 * ALIGNMENT),  # 29 rows of 4 KiB over 3 threads: a third each, in whole blocks
        (2000, SPREAD_CHUNKS * 4 * ALIGNMENT),  # much to read: at most SPREAD_CHUNKS chunks a request
    ],
)
def test_long_in_place_reads_take_one_request_per_thread(
    direct_dir: Path, in_place_path: str, rows: int, expected: int
) -> None:
    """An in-place read of many rows is cut into one request per thread (fewer, larger requests: each
    costs the CPU about the same), between `chunk_bytes` and `SPREAD_CHUNKS` chunks a request."""
    f, data = make_file(direct_dir, 2000, 2048)  # 4096-byte rows: one page each
    ids = torch.arange(rows)
    with StoreReader({0: f}, direct_io=True, threads=3, chunk_bytes=4 * ALIGNMENT) as reader:
        assert reader.request_bytes(rows * f.row_bytes) == expected
        matrix = row_matrix(2000, 2048, torch.bfloat16)
        reader.read_in_place(0, ids, matrix)
        assert reader.reads_issued == -(-rows * f.row_bytes // expected)
    assert torch.equal(matrix[ids], data[ids])


@pytest.mark.parametrize("width", [2048, 576])  # 4 KiB rows; SmolLM2's 1152-byte down columns
@pytest.mark.parametrize(
    "ids",
    [
        torch.arange(6),
        torch.arange(0, 2048, 40),
        torch.arange(0, 2048, 3),
        torch.arange(2048),
        torch.cat([torch.arange(40), torch.arange(900, 1900)]),
    ],
    ids=["short", "scattered", "gaps-merged", "whole", "two-runs"],
)
def test_simulator_plans_the_requests_the_reader_issues(
    direct_dir: Path, in_place_path: str, width: int, ids: torch.Tensor
) -> None:
    """`flashlm.sim`'s plan of a trace's misses, with the reader's settings (what a trace records), is the
    reader's own: as many requests, as many bytes."""
    f, _ = make_file(direct_dir, 2048, width)  # a whole number of blocks: no short read at the end
    with StoreReader({0: f}, direct_io=True, threads=3, chunk_bytes=4 * ALIGNMENT) as reader:
        reader.read_in_place(0, ids, row_matrix(f.rows, width, torch.bfloat16))
        planned = plan_trace_reads(ids.numpy(), f.row_bytes, f.rows, **reader.plan_settings)
        assert (len(planned), int(planned.sum())) == (reader.reads_issued, reader.bytes_read)


def test_gap_merging_trades_requests_for_bytes(direct_dir: Path) -> None:
    f, _ = make_file(direct_dir, 2000, 2048)  # 4096-byte rows: one page each
    ids = torch.arange(0, 2000, 3)  # a two-row gap (8 KiB) between wanted rows
    out = torch.empty(len(ids), 2048, dtype=torch.bfloat16)
    counters = {}
    for gap in (0, 2 * ALIGNMENT):
        with StoreReader({0: f}, direct_io=True, merge_gap_bytes=gap, threads=2) as reader:
            reader.read(0, ids, out)
            np.testing.assert_array_equal(out.view(torch.uint8).numpy(), reference(f, ids))
            counters[gap] = (reader.reads_issued, reader.bytes_read)
    assert counters[0] == (len(ids), len(ids) * ALIGNMENT)  # one page per row, no merging
    merged_span = (int(ids[-1]) + 1) * ALIGNMENT
    assert counters[2 * ALIGNMENT][1] == merged_span  # one run, gaps over-read
    assert counters[2 * ALIGNMENT][0] == -(-merged_span // reader_mod.DEFAULT_CHUNK_BYTES)


def test_plan_requests_are_aligned_and_cover_rows() -> None:
    rng = np.random.default_rng(0)
    for row_bytes in (1152, 3456, 100, 8192 + 12):
        rows = 5000
        ids = np.sort(rng.choice(rows, 700, replace=False))
        for gap, max_run in (
            (0, 1 << 30),
            (20000, 1 << 30),
            (20000, row_bytes + 2 * ALIGNMENT + 1),
            (0, 50000),
        ):
            plan = plan_reads(
                ids, row_bytes, ALIGNMENT, alignment=ALIGNMENT, merge_gap_bytes=gap, max_run_bytes=max_run
            )
            assert (plan.run_starts % ALIGNMENT == 0).all() and (plan.run_ends % ALIGNMENT == 0).all()
            assert (plan.run_bytes <= max_run).all()
            # Runs never overlap, except pieces of a run cut to fit the buffer: they may share
            # the block that a row straddles (read twice, and counted twice).
            overlap = plan.run_ends[:-1] - plan.run_starts[1:]
            assert (overlap <= (ALIGNMENT if max_run < 1 << 30 else 0)).all()
            starts = plan.row_starts
            assert (starts >= plan.run_starts[plan.row_runs]).all()
            assert (starts + row_bytes <= plan.run_ends[plan.row_runs]).all()
            run, offset, length = split_chunks(plan.run_starts, plan.run_ends, 3 * ALIGNMENT)
            assert ((plan.run_starts[run] + offset) % ALIGNMENT == 0).all() and (
                length % ALIGNMENT == 0
            ).all()
            assert length.sum() == plan.nbytes


def test_every_issued_request_is_aligned_in_direct_mode(direct_dir: Path, monkeypatch) -> None:
    f, _ = make_file(direct_dir, 3000, 576)
    issued = []
    real_preadv = os.preadv

    def spy(fd, buffers, offset):
        issued.append((offset, sum(memoryview(b).nbytes for b in buffers), memoryview(buffers[0])))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(reader_mod.os, "preadv", spy)
    with StoreReader(
        {0: f}, direct_io=True, threads=4, chunk_bytes=2 * ALIGNMENT, buffer_bytes=40000
    ) as reader:
        ids = random_ids(f.rows, 900, 5)
        out = torch.empty(900, 576, dtype=torch.bfloat16)
        reader.read(0, ids, out)
        np.testing.assert_array_equal(out.view(torch.uint8).numpy(), reference(f, ids))
        assert len(issued) == reader.reads_issued
        for offset, length, view in issued:
            address = np.frombuffer(view, dtype=np.uint8).ctypes.data
            assert offset % ALIGNMENT == 0 and length % ALIGNMENT == 0 and address % ALIGNMENT == 0


def test_fallback_when_o_direct_refused(tmp_path: Path, monkeypatch) -> None:
    f, _ = make_file(tmp_path, 100, 576)
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(reader_mod.os, "open", no_direct)
    with StoreReader({0: f}) as reader:
        assert reader.mode == "buffered"
        assert "O_DIRECT" in reader.fallback_reason and str(f.path) in reader.fallback_reason
        ids = torch.tensor([3, 4, 50])
        out = torch.empty(3, 576, dtype=torch.bfloat16)
        reader.read(0, ids, out)
        np.testing.assert_array_equal(out.view(torch.uint8).numpy(), reference(f, ids))
    with pytest.raises(DirectIOUnavailableError, match="direct_io=True") as info:
        StoreReader({0: f}, direct_io=True)
    assert isinstance(info.value, FlashLMError) and isinstance(info.value, OSError)
    with StoreReader({0: f}, direct_io=False) as reader:
        assert reader.mode == "buffered" and reader.fallback_reason is None


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_fallback_on_real_tmpfs() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        if supports_direct(Path(d)):
            pytest.skip("/dev/shm accepts O_DIRECT here (not tmpfs)")
        f, _ = make_file(Path(d), 50, 576)
        with StoreReader({0: f}) as reader:
            assert reader.mode == "buffered" and reader.fallback_reason
        with pytest.raises(DirectIOUnavailableError):
            StoreReader({0: f}, direct_io=True)


def test_direct_mode_has_no_fallback_reason(direct_dir: Path) -> None:
    f, _ = make_file(direct_dir, 10, 576)
    with StoreReader({0: f}) as reader:
        assert reader.mode == "direct" and reader.fallback_reason is None


@pytest.mark.parametrize("direct", [True, False])
def test_truncated_file_raises(direct_dir: Path, direct: bool) -> None:
    f, _ = make_file(direct_dir, 1000, 576)
    os.truncate(f.path, f.data_offset + f.nbytes - 5000)
    with pytest.raises(StoreCorruptError, match="truncated"):
        StoreReader({0: f}, direct_io=direct)
    # Truncated after opening: the read itself notices.
    f, _ = make_file(direct_dir, 1000, 576, name="later.bin")
    with StoreReader({0: f}, direct_io=direct) as reader:
        os.truncate(f.path, f.data_offset + 500 * f.row_bytes + 10)
        out = torch.empty(2, 576, dtype=torch.bfloat16)
        reader.read(0, torch.tensor([1, 2]), out)  # before the cut: fine
        with pytest.raises(StoreCorruptError, match="truncated"):
            reader.read(0, torch.tensor([1, 700]), out)


@pytest.mark.parametrize("direct", [True, False])
def test_truncated_after_opening_read_in_place_raises(
    direct_dir: Path, direct: bool, in_place_path: str
) -> None:
    f, data = make_file(direct_dir, 1000, 576)
    matrix = row_matrix(1000, 576, torch.bfloat16)
    with StoreReader({0: f}, direct_io=direct) as reader:
        os.truncate(f.path, f.data_offset + 500 * f.row_bytes + 10)
        reader.read_in_place(0, torch.tensor([1, 2]), matrix)  # before the cut: fine
        assert torch.equal(matrix[1:3], data[1:3])
        with pytest.raises(StoreCorruptError, match="truncated: end of file at byte"):
            reader.read_in_place(0, torch.tensor([1, 700]), matrix)


@pytest.mark.parametrize("direct", [True, False])
def test_small_buffer_serves_in_batches(direct_dir: Path, direct: bool) -> None:
    f, _ = make_file(direct_dir, 2000, 1728)  # 3456-byte rows
    small = f.row_bytes + 2 * ALIGNMENT + 1
    for buffer_bytes in (small, 64 * 1024):
        with StoreReader({0: f}, direct_io=direct, buffer_bytes=buffer_bytes, merge_gap_bytes=8192) as reader:
            assert reader.buffer_bytes >= buffer_bytes and reader.buffer_bytes % ALIGNMENT == 0
            for ids in (random_ids(f.rows, 800, 9), torch.arange(f.rows)):
                out = torch.empty(len(ids), 1728, dtype=torch.bfloat16)
                reader.read(0, ids, out)
                np.testing.assert_array_equal(out.view(torch.uint8).numpy(), reference(f, ids))


def test_default_buffer_holds_the_largest_file(direct_dir: Path) -> None:
    a, _ = make_file(direct_dir, 300, 576, name="a.bin")
    b, _ = make_file(direct_dir, 100, 576, name="b.bin")
    with StoreReader({0: a, 1: b}) as reader:
        assert reader.buffer_bytes >= a.nbytes + 2 * ALIGNMENT


def test_bad_arguments(direct_dir: Path) -> None:
    f, _ = make_file(direct_dir, 100, 576)
    with pytest.raises(FlashLMError, match="chunk_bytes"):
        StoreReader({0: f}, chunk_bytes=1000)
    with pytest.raises(FlashLMError, match="buffer_bytes"):
        StoreReader({0: f}, buffer_bytes=100)
    reader = StoreReader({0: f})
    out = torch.empty(4, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sorted"):
        reader.read(0, torch.tensor([3, 1]), out)
    with pytest.raises(ValueError, match="lie in"):
        reader.read(0, torch.tensor([99, 100]), out)
    with pytest.raises(ValueError, match="out"):
        reader.read(0, torch.tensor([1]), torch.empty(1, 576))
    with pytest.raises(KeyError):
        reader.read(1, torch.tensor([1]), out)
    reader.read(0, torch.tensor([], dtype=torch.int64), out)
    assert reader.reads_issued == 0
    reader.close()
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.read(0, torch.tensor([1]), out)


def test_row_matrices_share_one_allocation_each_with_its_spare_block(direct_dir: Path) -> None:
    """`row_matrices` lays the matrices one after another in one storage, each on a page boundary with
    a spare block after its last row, so O_DIRECT reads of any rows land in each without touching the
    next; their sizes need not be whole blocks."""
    f, data = make_file(direct_dir, 300, 1000)  # 2000-byte rows
    shapes = [(300, 1000), (7, 3), (300, 1000)]
    matrices = row_matrices(shapes, torch.bfloat16)
    assert [tuple(m.shape) for m in matrices] == shapes
    assert len({m.untyped_storage().data_ptr() for m in matrices}) == 1
    for matrix, following in itertools.pairwise(matrices):
        assert matrix.data_ptr() % ALIGNMENT == 0
        end = matrix.data_ptr() + matrix.numel() * matrix.element_size()
        assert following.data_ptr() >= end + ALIGNMENT
    small = matrices[1].copy_(torch.arange(21).view(7, 3))
    ids = torch.tensor([0, 1, 150, 299])
    with StoreReader({"m": f}, direct_io=True) as reader:
        for matrix in (matrices[0], matrices[2]):
            reader.read_in_place("m", ids, matrix)
            assert torch.equal(matrix[ids], data[ids])
    assert torch.equal(small, torch.arange(21).view(7, 3).bfloat16())


THP_SETTINGS = Path("/sys/kernel/mm/transparent_hugepage")
needs_smaps = pytest.mark.skipif(
    not Path("/proc/self/smaps").is_file(), reason="needs Linux's /proc/self/smaps"
)


def thp_eligible(address: int) -> bool:
    """Whether the mapping holding `address` may take transparent huge pages (`/proc/self/smaps`)."""
    eligible = None
    with open("/proc/self/smaps") as smaps:
        within = False
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(bound, 16) for bound in first.split("-"))
                within = start <= address < end
            elif within and first == "THPeligible:":
                eligible = line.split()[1] == "1"
    assert eligible is not None, "the mapping has no THPeligible line in /proc/self/smaps"
    return eligible


def thp_setting(name: str) -> str:
    """The selected value of a transparent huge page setting ("never" where the kernel has none)."""
    path = THP_SETTINGS / name
    return path.read_text().split("[")[1].split("]")[0] if path.is_file() else "never"


@needs_smaps
def test_staging_memory_may_take_transparent_huge_pages() -> None:
    """`aligned_buffer` memory is page-aligned, writable, and (private, advised `MADV_HUGEPAGE`) eligible
    for transparent huge pages wherever the kernel enables them at all (`enabled` not `[never]`)."""
    buffer = aligned_buffer(8 << 20)
    address = buffer.data_ptr()
    assert address % 4096 == 0
    buffer.fill_(7)
    assert int(buffer[-1]) == 7
    assert thp_eligible(address) == (thp_setting("enabled") != "never")


@needs_smaps
def test_memory_without_huge_pages_keeps_to_small_pages() -> None:
    """`anonymous_memory(huge_pages=False)` (the disk profile's reads, the benchmarks' 4 KiB cells) is
    shared, so it takes huge pages only where the kernel gives them to shared memory unasked
    (`shmem_enabled`), whatever it does for private memory."""
    memory = anonymous_memory(8 << 20, huge_pages=False)
    pages = np.frombuffer(memory, dtype=np.uint8)
    pages[::4096] = 1
    assert thp_eligible(pages.ctypes.data) == (
        thp_setting("shmem_enabled") in ("always", "within_size", "force")
    )
    del pages
    memory.close()


def test_break_even_gap() -> None:
    assert break_even_gap_bytes(20e-6, 1.5e9) == 28672  # 30 KB, whole pages
    assert break_even_gap_bytes(1e-6, 1e9) == 0
    assert reader_mod.DEFAULT_MERGE_GAP_BYTES % ALIGNMENT == 0


@pytest.mark.parametrize(("needed", "gap_units"), [(0.6, 2), (0.3, 2), (0.45, 5), (0.9, 0), (0.6, 12)])
def test_merged_read_share_and_cost_are_what_the_planner_reads(needed, gap_units) -> None:
    """The expected share of a file's rows that `plan_reads` reads for rows needed at random, merging
    gaps of up to `gap_units` rows, and its disk time with the runs' requests, against the plan of
    200,000 such rows."""
    row_bytes, rows = 4096, 200_000
    mask = np.random.default_rng(5).random(rows) < needed
    plan = plan_reads(
        np.flatnonzero(mask),
        row_bytes,
        0,
        alignment=1,
        merge_gap_bytes=gap_units * row_bytes,
        max_run_bytes=rows * row_bytes,
    )
    share = merged_read_share(needed, gap_units)
    assert share == pytest.approx(plan.nbytes / (rows * row_bytes), abs=0.005)
    assert needed <= share <= 1
    # each run a request that costs as much as reading the gap
    cost = (plan.nbytes + len(plan.run_starts) * gap_units * row_bytes) / (rows * row_bytes)
    assert merged_read_cost(needed, row_bytes, gap_units * row_bytes) == pytest.approx(cost, abs=0.005)


def test_merged_read_share_bounds() -> None:
    assert merged_read_share(0.6, 0) == 0.6  # no gap read across
    assert merged_read_share(1.0, 3) == 1.0
    assert merged_read_share(0.0, 3) == 0.0
    assert merged_read_share(0.6, 2) == pytest.approx(0.6 + 0.4 * 0.36 * (1 + 2 * 0.4))
    with pytest.raises(ConfigError, match="share in"):
        merged_read_share(1.5, 2)
    assert merged_read_cost(1.0, 4096, 8192) == 1.0  # one run of every unit
    assert merged_read_cost(0.5, 4096, 0) == 0.5  # requests free: bytes alone
    with pytest.raises(ConfigError, match="row_bytes > 0"):
        merged_read_cost(0.5, 0, 4096)


def _proc_read_bytes() -> int | None:
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))
    except (OSError, StopIteration):
        return None


def test_bytes_read_agrees_with_proc_io(direct_dir: Path) -> None:
    if _proc_read_bytes() is None:
        pytest.skip("/proc/self/io is not available")
    f, _ = make_file(direct_dir, 6000, 1728)  # ~20 MB
    with StoreReader({0: f}, direct_io=True) as reader:
        before = _proc_read_bytes()
        for seed in range(4):
            ids = random_ids(f.rows, 1500, seed)
            reader.read(0, ids, torch.empty(1500, 1728, dtype=torch.bfloat16))
        kernel = _proc_read_bytes() - before
    if kernel == 0:
        pytest.skip("this kernel does not account O_DIRECT reads in /proc/self/io (read_bytes stayed 0)")
    assert reader.bytes_read == pytest.approx(kernel, rel=0.10)


@pytest.fixture(params=["native", "python"])
def in_place_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`read_in_place` by the C planner and pool, or by the Python path (numpy plan, os.preadv threads)."""
    if request.param == "python":
        monkeypatch.setattr(reader_mod, "native_reader", lambda: None)
    elif reader_mod.native_reader() is None:
        pytest.skip(NO_NATIVE_READER)
    return request.param


def _native_plan(ids: np.ndarray, f: RowFile, alignment: int, gap: int, chunk: int) -> np.ndarray:
    """The (offset, length, needed) requests the C planner makes."""
    library = reader_mod.native_reader()
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.zeros((3 * len(ids) + 64, 3), dtype=np.int64)
    count = library.flashlm_plan_rows(
        ids.ctypes.data, len(ids), f.rows, f.row_bytes, f.data_offset, alignment, gap, chunk,
        out.ctypes.data, len(out),
    )  # fmt: skip
    assert 0 <= count <= len(out)
    return out[:count]


@needs_native_reader
@pytest.mark.parametrize("seed", range(40))
def test_native_plan_is_the_python_plan(seed: int) -> None:
    """The C planner makes exactly the requests `plan_reads` + `split_chunks` make for `read_in_place`."""
    rng = np.random.default_rng(seed)
    rows, width = int(rng.integers(1, 400)), int(rng.choice([64, 333, 576, 1536, 2048, 3333]))
    f = RowFile(Path("unused"), ALIGNMENT, rows, width, torch.bfloat16)
    ids = np.sort(rng.choice(rows, int(rng.integers(1, rows + 1)), replace=False))
    alignment = int(rng.choice([1, ALIGNMENT]))
    gap = int(rng.choice([0, 4096, 40960, 1 << 20]))
    chunk = int(rng.choice([4096, 65536, 256 * 1024]))
    plan = plan_reads(
        ids, f.row_bytes, f.data_offset, alignment=alignment, merge_gap_bytes=gap,
        max_run_bytes=f.nbytes + 2 * ALIGNMENT,
    )  # fmt: skip
    run, within, length = split_chunks(plan.run_starts, plan.run_ends, chunk)
    offsets = plan.run_starts[run] + within
    needed = np.clip(plan.run_needed_ends[run] - offsets, 0, length)
    assert np.array_equal(_native_plan(ids, f, alignment, gap, chunk), np.stack([offsets, length, needed], 1))


@needs_native_reader
@pytest.mark.parametrize("direct", [True, False])
def test_native_and_python_reads_in_place_agree(direct_dir: Path, direct: bool, monkeypatch) -> None:
    """The same rows land, the same bytes and requests are counted, whichever path reads."""
    f, data = make_file(direct_dir, 500, 1536)
    results = {}
    for path in ("native", "python"):
        if path == "python":
            monkeypatch.setattr(reader_mod, "native_reader", lambda: None)
        matrix = row_matrix(500, 1536, torch.bfloat16)
        matrix.fill_(7.0)
        with StoreReader({"m": f}, direct_io=direct, threads=4, chunk_bytes=16384) as reader:
            done = [
                reader.read_in_place("m", random_ids(500, 40 + 50 * seed, seed), matrix) for seed in range(5)
            ]
            results[path] = (matrix.clone(), reader.bytes_read, reader.reads_issued)
        assert results[path][1:] == (sum(d.bytes_read for d in done), sum(d.reads for d in done))
    assert torch.equal(results["native"][0], results["python"][0])
    assert results["native"][1:] == results["python"][1:]
    wanted = torch.cat([random_ids(500, 40 + 50 * seed, seed) for seed in range(5)]).unique()
    assert torch.equal(results["native"][0][wanted], data[wanted])


@needs_native_reader
def test_a_read_in_place_returns_its_own_cost_when_another_finishes_meanwhile(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's counters count every read waited for, by any thread; what `read_in_place` returns is
    its own read alone (the I/O thread's read, while the decode thread waits for one on the C pool)."""
    f, _ = make_file(direct_dir, 500, 1536)
    matrix = row_matrix(500, 1536, torch.bfloat16)
    with StoreReader({"m": f}, direct_io=True, threads=4, chunk_bytes=16384) as reader:
        alone = reader.read_in_place("m", random_ids(500, 60, 1), matrix)
        assert alone.bytes_read == reader.bytes_read > 0 and alone.reads == reader.reads_issued
        other = reader.submit_in_place("m", random_ids(500, 90, 2), matrix)
        submit, finished = reader.submit_in_place, []

        def submit_as_the_other_finishes(*args, **kwargs):
            pending = submit(*args, **kwargs)
            finished.append(other.result())
            return pending

        monkeypatch.setattr(reader, "submit_in_place", submit_as_the_other_finishes)
        before = reader.bytes_read
        again = reader.read_in_place("m", random_ids(500, 60, 1), matrix)
        assert (again.bytes_read, again.reads) == (alone.bytes_read, alone.reads)
        assert reader.bytes_read - before == again.bytes_read + finished[0].bytes_read > again.bytes_read


def test_read_in_place_checks_the_ids(direct_dir: Path, in_place_path: str) -> None:
    f, _ = make_file(direct_dir, 10, 64)
    matrix = row_matrix(10, 64, torch.bfloat16)
    with StoreReader({"m": f}, direct_io=True) as reader:
        with pytest.raises(ValueError, match="sorted"):
            reader.read_in_place("m", torch.tensor([3, 2, 5]), matrix)
        with pytest.raises(ValueError, match="sorted"):
            reader.read_in_place("m", torch.tensor([1, 1]), matrix)
        with pytest.raises(ValueError, match=r"lie in \[0, 10\)"):
            reader.read_in_place("m", torch.tensor([-1, 4]), matrix)
        with pytest.raises(ValueError, match=r"lie in \[0, 10\)"):
            reader.read_in_place("m", torch.tensor([4, 10]), row_matrix(11, 64, torch.bfloat16))
        assert reader.reads_issued == 0


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("first", [0, 1, 37, 99])
def test_read_in_place_of_a_range(direct_dir: Path, direct: bool, first: int, in_place_path: str) -> None:
    """Rows `first..` land at their own rows of a `row_matrix`; the rows before stay as they were but
    for the block the aligned read shares with row `first - 1` (O_DIRECT reads whole blocks)."""
    f, data = make_file(direct_dir, 100, 333)  # 666-byte rows: blocks straddle rows, the file ends mid-block
    matrix = row_matrix(100, 333, torch.bfloat16)
    matrix.fill_(7.0)
    with StoreReader({"m": f}, direct_io=direct) as reader:
        reader.read_in_place("m", torch.arange(first, 100), matrix)
        assert reader.mode == ("direct" if direct else "buffered")
        assert torch.equal(matrix[first:], data[first:])
        untouched = first - 1 if direct and first else first
        assert bool((matrix[:untouched] == 7.0).all())
        expected = (100 - first) * f.row_bytes
        if direct:
            start = (f.data_offset + first * f.row_bytes) // ALIGNMENT * ALIGNMENT
            expected = os.path.getsize(f.path) - start  # the aligned tail stops at end of file
        assert reader.bytes_read == expected


@pytest.mark.parametrize("direct", [True, False])
def test_read_in_place_of_scattered_rows(direct_dir: Path, direct: bool, in_place_path: str) -> None:
    """Every wanted row lands at its own row; any other byte holds its file byte or what it held."""
    f, data = make_file(direct_dir, 300, 3333)  # 6666-byte rows: runs of them stay apart
    ids = torch.nonzero(torch.rand(300, generator=torch.Generator().manual_seed(1)) < 0.3).squeeze(1)
    matrix = row_matrix(300, 3333, torch.bfloat16)
    matrix.fill_(7.0)
    with StoreReader({"m": f}, direct_io=direct, merge_gap_bytes=0) as reader:
        reader.read_in_place("m", ids, matrix)
        assert reader.reads_issued >= len(reader.plan("m", ids).run_starts) > 1
    assert torch.equal(matrix[ids], data[ids])
    assert bool(((matrix == data) | (matrix == 7.0)).all())


def test_read_in_place_rejects_what_it_cannot_fill(direct_dir: Path, in_place_path: str) -> None:
    f, _ = make_file(direct_dir, 10, 64)
    with StoreReader({"m": f}, direct_io=True) as reader:
        with pytest.raises(ValueError, match="cannot hold"):
            reader.read_in_place("m", torch.arange(3), torch.empty(10, 32, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="does not fit"):
            reader.read_in_place("m", torch.arange(5, 10), row_matrix(8, 64, torch.bfloat16))
        with pytest.raises(ValueError, match="page-aligned"):
            reader.read_in_place("m", torch.arange(3), row_matrix(11, 64, torch.bfloat16)[1:])


@needs_native_reader
@pytest.mark.parametrize("direct", [True, False])
def test_submitted_reads_run_in_the_background_and_land_in_place(direct_dir: Path, direct: bool) -> None:
    """Reads of two files into two matrices, several outstanding at once (`submit_in_place`), each land
    their rows, are counted once when waited for, and cost what the same reads cost one at a time."""
    f, data = make_file(direct_dir, 400, 1536, name="a.bin")
    g, other = make_file(direct_dir, 300, 576, seed=1, name="b.bin")
    reads = [("a", random_ids(400, 60, seed), f) for seed in range(3)] + [("b", random_ids(300, 90, 9), g)]
    with StoreReader({"a": f, "b": g}, direct_io=direct, threads=3, chunk_bytes=16384) as reader:
        expected = row_matrix(400, 1536, torch.bfloat16), row_matrix(300, 576, torch.bfloat16)
        for key, ids, _ in reads:
            reader.read_in_place(key, ids, expected[key == "b"])
        one_at_a_time = reader.bytes_read, reader.reads_issued
        reader.bytes_read = reader.reads_issued = 0
        matrices = [row_matrix(400, 1536, torch.bfloat16) for _ in range(3)] + [
            row_matrix(300, 576, torch.bfloat16)
        ]
        pending = [
            reader.submit_in_place(key, ids, m) for (key, ids, _), m in zip(reads, matrices, strict=True)
        ]
        assert reader.bytes_read == 0  # counted when waited for
        done = [p.result() for p in reversed(pending)][::-1]
        assert [p.result() for p in pending] == done  # waiting again returns the same
        assert (reader.bytes_read, reader.reads_issued) == one_at_a_time
        assert sum(d.bytes_read for d in done) == one_at_a_time[0] and all(d.seconds >= 0 for d in done)
    for (key, ids, _), matrix in zip(reads, matrices, strict=True):
        assert torch.equal(matrix[ids], (other if key == "b" else data)[ids])


@needs_native_reader
def test_in_place_reads_serve_one_matrix_again_and_again(direct_dir: Path) -> None:
    """One `InPlaceReads` (the matrix checked once) serves read after read into its matrix, of the file's
    first rows where the matrix holds only those, refusing rows past them; a bad matrix fails at once,
    and a closed reader's reads refuse to submit."""
    f, data = make_file(direct_dir, 400, 1536)
    with StoreReader({"m": f}, direct_io=True, threads=3) as reader:
        with pytest.raises(ValueError, match="cannot hold"):
            reader.in_place_reads("m", row_matrix(400, 768, torch.bfloat16))
        with pytest.raises(ValueError, match="page-aligned"):
            reader.in_place_reads("m", row_matrix(401, 1536, torch.bfloat16)[1:])
        into = reader.in_place_reads("m", row_matrix(300, 1536, torch.bfloat16))
        for seed in range(4):
            ids = random_ids(300, 40, seed)
            into.submit(ids).result()
            assert torch.equal(into.matrix[ids], data[ids])
        with pytest.raises(ValueError, match="matrix has 300 rows; row 350 does not fit"):
            into.submit(torch.tensor([10, 350]))
        with pytest.raises(ValueError, match="sorted"):
            into.submit(torch.tensor([12, 11]))
        with pytest.raises(ValueError, match="1-D int64"):
            into.submit(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="closed"):
        into.submit(torch.tensor([1, 2]))


@needs_native_reader
def test_in_place_reads_take_a_forked_childs_own_pool(direct_dir: Path, monkeypatch) -> None:
    """Threads do not survive a fork: in a child (here a changed pid) an `InPlaceReads` made in the parent
    submits to the pool the child's reader makes, and its rows land."""
    f, data = make_file(direct_dir, 400, 1536)
    library = reader_mod.native_reader()
    with StoreReader({"m": f}, direct_io=True, threads=2) as reader:
        into = reader.in_place_reads("m", row_matrix(400, 1536, torch.bfloat16))
        parent_pool = reader._native_pool()
        into.submit(random_ids(400, 30, 0)).result()
        real_pid = os.getpid()
        monkeypatch.setattr(reader_mod.os, "getpid", lambda: real_pid + 1)
        ids = random_ids(400, 30, 1)
        into.submit(ids).result()
        child_pool = reader._native_pool()
        assert child_pool != parent_pool
        assert library.flashlm_reader_peak_serving(child_pool) >= 1  # the child's threads read it
        assert torch.equal(into.matrix[ids], data[ids])
    library.flashlm_reader_free(parent_pool)  # the child's pool went with the reader; the parent's is ours


@needs_native_reader
def test_only_waits_someone_waits_on_poll_before_sleeping(direct_dir: Path, monkeypatch) -> None:
    """A wait polls for a read's end first (`WAIT_SPIN_S`, in flight requests only: the C side decides),
    except on a thread marked `sleep_while_reading` (a runtime's I/O thread), which sleeps at once; the
    rows land either way."""
    f, data = make_file(direct_dir, 400, 1536)
    library = reader_mod.native_reader()
    budgets: list[tuple[str, int]] = []

    class Recording:
        def __getattr__(self, name):
            function = getattr(library, name)
            if name != "flashlm_reader_wait":
                return function
            return lambda *args: (
                budgets.append((threading.current_thread().name, args[-1])),
                function(*args),
            )

    monkeypatch.setattr(reader_mod, "native_reader", Recording)
    ids = random_ids(400, 120, 3)
    with StoreReader({"m": f}, direct_io=True, threads=2) as reader:
        polled, slept = row_matrix(400, 1536, torch.bfloat16), row_matrix(400, 1536, torch.bfloat16)
        reader.submit_in_place("m", ids, polled).result()
        io = IOThread("test-io")
        io.submit(lambda: reader.submit_in_place("m", ids, slept).result()).result(timeout=30)
        io.shutdown()
    assert budgets == [("MainThread", int(reader_mod.WAIT_SPIN_S * 1e9)), ("test-io", 0)]
    assert budgets[0][1] > 0
    assert torch.equal(polled[ids], data[ids]) and torch.equal(slept[ids], data[ids])


@needs_native_reader
def test_submitted_read_errors(direct_dir: Path) -> None:
    """Bad ids fail at submission, having read nothing; a file cut short fails when the read is waited
    for (every time); closing the reader waits for reads nobody waited for."""
    f, data = make_file(direct_dir, 1000, 576)
    matrix = row_matrix(1000, 576, torch.bfloat16)
    with StoreReader({0: f}, direct_io=True) as reader:
        with pytest.raises(ValueError, match="sorted"):
            reader.submit_in_place(0, torch.tensor([5, 2]), matrix)
        with pytest.raises(ValueError, match=r"lie in \[0, 1000\)"):
            reader.submit_in_place(0, torch.tensor([2, 1000]), matrix)
        assert reader.reads_issued == 0
        os.truncate(f.path, f.data_offset + 500 * f.row_bytes + 10)
        cut = reader.submit_in_place(0, torch.tensor([1, 700]), matrix)
        for _ in range(2):
            with pytest.raises(StoreCorruptError, match="truncated: end of file at byte"):
                cut.result()
        unwaited = reader.submit_in_place(0, torch.arange(100, 400), matrix)
    assert unwaited.result().bytes_read > 0
    assert torch.equal(matrix[100:400], data[100:400])


def test_no_background_reads_without_the_c_library(direct_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(reader_mod, "native_reader", lambda: None)
    f, _ = make_file(direct_dir, 10, 64)
    with StoreReader({"m": f}, direct_io=False) as reader:
        assert reader.submit_in_place("m", torch.arange(3), row_matrix(10, 64, torch.bfloat16)) is None
        assert reader.reads_issued == 0


@needs_native_reader
def test_reads_queued_without_waking_the_threads_still_run(direct_dir: Path) -> None:
    """Reads submitted with `start=False` wait for threads awake, the next read submitted with `start`,
    or a wait: with none of the first two, waiting for them still gets them read."""
    f, data = make_file(direct_dir, 400, 1536)
    matrices = [row_matrix(400, 1536, torch.bfloat16) for _ in range(3)]
    ids = [random_ids(400, 50, seed) for seed in range(3)]
    with StoreReader({0: f}, direct_io=True, threads=2) as reader:
        reader.read_in_place(0, torch.arange(10), row_matrix(400, 1536, torch.bfloat16))
        time.sleep(0.05)  # the pool's threads, made by that read, are asleep again
        held = [reader.submit_in_place(0, i, m, start=False) for i, m in zip(ids, matrices, strict=True)]
        with ThreadPoolExecutor(1) as waiter:
            waited = waiter.submit(lambda: [p.result().bytes_read for p in held])
            try:
                read = waited.result(timeout=30)  # a wait that never wakes the threads fails here
            finally:
                reader.read_in_place(0, ids[0], matrices[0])  # wakes them, so nothing hangs
        assert all(nbytes > 0 for nbytes in read)
    for i, m in zip(ids, matrices, strict=True):
        assert torch.equal(m[i], data[i])


@needs_native_reader
def test_a_read_woken_by_one_thread_is_served_by_several(direct_dir: Path) -> None:
    """A submission wakes one sleeping thread, which wakes the next as it takes a request: a read of many
    requests still brings the pool's threads in, and lands whole."""
    f, data = make_file(direct_dir, 2048, 1536)
    matrix = row_matrix(2048, 1536, torch.bfloat16)
    with StoreReader({0: f}, direct_io=True, threads=4, chunk_bytes=16384) as reader:
        reader.read_in_place(0, torch.arange(4), matrix)  # one request: one thread
        pool, library = reader._native_pool(), reader_mod.native_reader()
        assert library.flashlm_reader_peak_serving(pool) == 1
        time.sleep(0.05)  # the pool's threads are asleep again
        done = reader.read_in_place(0, torch.arange(2048), matrix)
        assert done.reads >= (6 << 20) // (SPREAD_CHUNKS * 16384)  # requests of at most SPREAD_CHUNKS chunks
        # the submission wakes one thread and the wait one more: the others were woken by threads
        assert library.flashlm_reader_peak_serving(pool) >= 3
    assert torch.equal(matrix, data)


@needs_native_reader
def test_a_reader_left_open_with_reads_outstanding_closes_quietly_at_exit(direct_dir: Path) -> None:
    """A script that ends with a read submitted and the reader still open: the reader's finalizer, run
    while Python shuts down (when imports fail), waits for the read and exits without an error."""
    f, _ = make_file(direct_dir, 400, 1536)
    script = (
        "import torch\n"
        "from pathlib import Path\n"
        "from flashlm.store.reader import StoreReader, row_matrix\n"
        "from flashlm.store.rowfile import RowFile\n"
        f"f = RowFile(Path({str(f.path)!r}), {f.data_offset}, {f.rows}, {f.width}, torch.bfloat16)\n"
        "reader = StoreReader({0: f}, direct_io=True)\n"
        "matrix = row_matrix(f.rows, f.width, torch.bfloat16)\n"
        "pending = reader.submit_in_place(0, torch.arange(0, 400, 3), matrix)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
