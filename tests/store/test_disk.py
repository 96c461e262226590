"""The disk profile that sets the reader's concurrency and merge gap: measured once per disk on the
store's own files, remembered, and skipped where it cannot mean anything."""

from __future__ import annotations

import json
import os

import pytest

from flashlm.store import disk
from flashlm.store.disk import DiskProfile, disk_profile, random_read_throughput
from flashlm.store.reader import ALIGNMENT, HUGE_PAGE_BYTES, break_even_gap_bytes


def test_merge_gap_is_the_break_even_of_the_measured_disk() -> None:
    profile = DiskProfile(threads=8, request_cost_s=20e-6, bandwidth=1.5e9)
    assert profile.merge_gap_bytes == break_even_gap_bytes(20e-6, 1.5e9) == 28672


def test_small_stores_are_not_profiled(tmp_path) -> None:
    small = tmp_path / "layer.safetensors"
    small.write_bytes(b"\0" * (1 << 20))
    assert disk_profile([small]) is None  # its reads would come from the device's cache
    assert disk_profile([]) is None


@pytest.mark.parametrize("huge_pages", [False, True])
def test_random_reads_spread_over_several_files(direct_dir, huge_pages, monkeypatch) -> None:
    files = [direct_dir / f"f{i}" for i in range(3)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * (4 + i) * ALIGNMENT)
    read, landed_at = os.preadv, set()

    def preadv(fd, buffers, offset):
        landed_at.add(buffers[0].ctypes.data)
        return read(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    cell = random_read_throughput(files, 2 * ALIGNMENT, threads=2, seconds=0.05, huge_pages=huge_pages)
    assert cell["reads"] > 0 and cell["bytes_per_s"] == cell["reads"] * 2 * ALIGNMENT / cell["seconds"]
    assert 0 < len(landed_at) <= 2  # a buffer per thread that read (a late one may not have)
    if huge_pages:  # each starts a huge page, as the reader's staging matrices do
        assert all(address % HUGE_PAGE_BYTES == 0 for address in landed_at)
    with pytest.raises(ValueError, match="smaller"):
        random_read_throughput(files, 64 * ALIGNMENT, threads=1, seconds=0.01, huge_pages=huge_pages)


def test_profile_is_measured_once_per_disk_and_remembered(direct_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLASHLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(disk, "PROFILE_MIN_BYTES", 4 << 20)
    monkeypatch.setattr(disk, "PROFILE_SECONDS", 0.02)
    store_files = [direct_dir / f"layer{i}.bin" for i in range(2)]
    for f in store_files:
        f.write_bytes(b"\1" * (3 << 20))
    profile = disk_profile(store_files)
    assert isinstance(profile, DiskProfile)
    assert profile.threads in disk.PROFILE_THREADS
    assert profile.request_cost_s > 0 and profile.bandwidth > 0
    assert profile.merge_gap_bytes % ALIGNMENT == 0
    remembered = tmp_path / "cache" / "measurements" / disk.DISK_PROFILES
    assert list(json.loads(remembered.read_text()).values()) == [
        {"threads": profile.threads, "request_cost_s": profile.request_cost_s, "bandwidth": profile.bandwidth}
    ]
    monkeypatch.setattr(disk, "measure_disk", lambda *args: pytest.fail("measured again"))
    assert disk_profile(list(reversed(store_files))) == profile
