"""Hardware profiles for `flashlm.sim.simulate`: memory sizes and the speeds that bound decoding.

Token generation is memory-bound (DIP §6, appendix A; LLM in a flash §3), so a profile is what a
cost model needs and nothing else: how much fast memory holds weights, how fast it is read, and
how fast flash delivers bytes. Flash throughput depends on how a read is issued: long linear
reads reach the drive's sequential speed, scattered reads pay a latency per request and reach
less the smaller they are (LLM in a flash §2.2: "1.25 GiB/s sparse vs 6.1 GiB/s dense"). A
profile therefore carries a sequential bandwidth plus a table of (chunk bytes, bytes/s) points for
scattered reads, interpolated linearly in log(chunk size). The table is measured throughput, so
it already includes the per-request latency; no separate latency term is added on top of it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GB = 1e9
"""Papers quote decimal GB and GB/s (13.4 GB / 6.1 GB/s = 2196 ms in LLM in a flash Table 2)."""


@dataclass(frozen=True)
class HardwareProfile:
    """One device, as the simulator sees it.

    Attributes:
        name: a label for reports.
        dram_bytes: DRAM available to the model (what the OS and other apps leave; DIP app. A).
            With a GPU it is the second cache tier, between GPU memory and flash (M2Cache §5).
        dram_bandwidth: DRAM read/write bandwidth (bytes/s); bounds compute without a GPU (every
            weight used by a token is read once) and memory management (every byte loaded from
            flash is written once).
        flash_sequential_bandwidth: throughput of long linear reads (bytes/s).
        flash_random: (chunk bytes, bytes/s) points for scattered reads of one chunk size, sorted
            by chunk size; throughput between points is interpolated in log(chunk), and clamped
            to the end points outside them (and to the sequential bandwidth above it).
        gpu_bytes: GPU memory, if weights are computed on a discrete GPU; the resident weights
            and the first-tier neuron cache then live there, and DRAM holds the second tier.
        gpu_bandwidth: GPU memory bandwidth (bytes/s); bounds compute when `gpu_bytes` is set.
        pcie_bandwidth: host-to-GPU bandwidth (bytes/s); every MLP byte the GPU tier misses
            crosses it, whether DRAM or flash serves it.
    """

    name: str
    dram_bytes: float
    dram_bandwidth: float
    flash_sequential_bandwidth: float
    flash_random: tuple[tuple[float, float], ...]
    gpu_bytes: float | None = None
    gpu_bandwidth: float | None = None
    pcie_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for field_name in ("dram_bytes",):
            value = getattr(self, field_name)
            if not _is_number(value) or value < 0:
                raise ConfigError(f"HardwareProfile {self.name!r}: {field_name} must be >= 0, got {value!r}.")
        for field_name in ("dram_bandwidth", "flash_sequential_bandwidth"):
            value = getattr(self, field_name)
            if not _is_number(value) or value <= 0:
                raise ConfigError(f"HardwareProfile {self.name!r}: {field_name} must be > 0, got {value!r}.")
        if not self.flash_random:
            raise ConfigError(f"HardwareProfile {self.name!r}: flash_random needs at least one point.")
        chunks = [point[0] for point in self.flash_random]
        if any(
            len(point) != 2 or not _is_number(point[0]) or not _is_number(point[1]) or min(point) <= 0
            for point in self.flash_random
        ):
            raise ConfigError(
                f"HardwareProfile {self.name!r}: flash_random points must be (chunk bytes > 0, "
                f"bytes/s > 0), got {self.flash_random!r}."
            )
        if chunks != sorted(set(chunks)):
            raise ConfigError(
                f"HardwareProfile {self.name!r}: flash_random chunk sizes must be strictly increasing, "
                f"got {chunks}."
            )
        gpu = (self.gpu_bytes, self.gpu_bandwidth, self.pcie_bandwidth)
        if any(v is not None for v in gpu) and any(v is None or not _is_number(v) or v <= 0 for v in gpu):
            raise ConfigError(
                f"HardwareProfile {self.name!r}: a GPU needs gpu_bytes, gpu_bandwidth and "
                f"pcie_bandwidth, all > 0; got {gpu}."
            )

    @property
    def has_gpu(self) -> bool:
        return self.gpu_bytes is not None

    @property
    def resident_bytes(self) -> float:
        """Capacity of the memory that holds resident weights: GPU memory if any, else DRAM."""
        return float(self.gpu_bytes) if self.gpu_bytes is not None else float(self.dram_bytes)

    @property
    def compute_bandwidth(self) -> float:
        """Bandwidth at which the decode GEMVs stream their weights."""
        return float(self.gpu_bandwidth) if self.gpu_bandwidth is not None else float(self.dram_bandwidth)

    def flash_bandwidth(self, chunk_bytes: float, *, sequential: bool = False) -> float:
        """Flash throughput (bytes/s) of reads of `chunk_bytes` each, or of one long linear read."""
        if sequential:
            return float(self.flash_sequential_bandwidth)
        if not _is_number(chunk_bytes) or chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes must be > 0, got {chunk_bytes!r}.")
        log_chunks = [math.log(chunk) for chunk, _ in self.flash_random]
        rates = [rate for _, rate in self.flash_random]
        rate = np.interp(math.log(chunk_bytes), log_chunks, rates)  # clamps outside the table
        return float(min(rate, self.flash_sequential_bandwidth))

    def with_overrides(
        self,
        *,
        dram_bytes: float | None = None,
        flash_bandwidth: float | None = None,
        gpu_bytes: float | None = None,
    ) -> HardwareProfile:
        """This profile with another DRAM or GPU memory size, or with flash at one flat speed.

        A flat flash speed is how DIP's ablations are stated (Table 6: 0.5, 1 and 2 GB/s). Raises
        `ConfigError` for `gpu_bytes` on a profile without a GPU (its bandwidths are unknown).
        """
        fields = dict(self.__dict__)
        if dram_bytes is not None:
            fields["dram_bytes"] = dram_bytes
        if gpu_bytes is not None:
            if not self.has_gpu:
                raise ConfigError(
                    f"HardwareProfile {self.name!r} has no GPU, so its GPU memory cannot be set: pick a "
                    f"profile with one ({', '.join(n for n, p in PRESETS.items() if p.has_gpu)})."
                )
            fields["gpu_bytes"] = gpu_bytes
        if flash_bandwidth is not None:
            fields["flash_sequential_bandwidth"] = flash_bandwidth
            fields["flash_random"] = ((1.0, flash_bandwidth),)
        return HardwareProfile(**fields)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The VM flashlm was first developed on (2 vCPUs, 23 GiB), measured: flash numbers from the comment at
# the top of flashlm/store/reader.py (benchmarks/reader_throughput.py, O_DIRECT random reads over a
# 1 GB file), the 4-thread column because StoreReader runs 4 threads (DEFAULT_THREADS); sequential
# = the best cell, 1671 MB/s (512 KiB x 2 threads). DRAM: 23 GiB total per `free -g`; its
# bandwidth, measured for this preset with numpy on a 256 MiB array (best of 5): a sum reads
# 16.7 GB/s, a copy moves 24.2 GB/s (read + write); 16.7 GB/s, the read figure, bounds GEMVs.
# The machine at hand is `this-machine` (`this_machine`), measured where it runs.
_DEV_VM = HardwareProfile(
    name="flashlm's development VM (benchmarks/reader_throughput.py)",
    dram_bytes=23 * 1024**3,
    dram_bandwidth=16.7 * GB,
    flash_sequential_bandwidth=1671e6,
    flash_random=(
        (4 * KiB, 136e6),
        (32 * KiB, 602e6),
        (64 * KiB, 1067e6),
        (256 * KiB, 1526e6),
        (1 * MiB, 1542e6),
    ),
)


PRESETS: dict[str, HardwareProfile] = {
    # DIP (arXiv 2412.01380) appendix A: "Apple A18 with DRAM I/O speed of 60 GB/s, and Flash read
    # speed of 1 GB/s" (one flat speed, no chunk-size dependence). 4 GB of DRAM is DIP's setting for
    # Phi-3-Medium (Table 2); the phone has 8 GB, most of it taken by the OS and other apps.
    "a18": HardwareProfile(
        name="Apple A18 (DIP appendix A)",
        dram_bytes=4 * GB,
        dram_bandwidth=60 * GB,
        flash_sequential_bandwidth=1 * GB,
        flash_random=((1.0, 1 * GB),),
    ),
    # LLM in a flash (arXiv 2312.11514) on an M1 Max with a 1 TB SSD: 6.1 GB/s for a long linear
    # read (§2.2, Table 2 rows 1-2); 1.25 GB/s for scattered reads of one OPT-6.7B fp16 column,
    # d_model x 2 bytes = 8 KiB, and 2.25 GB/s once up column and down row are bundled into 16 KiB
    # chunks (Table 2 rows 4-5, §3.2). DRAM bandwidth: Apple's 400 GB/s spec for the M1 Max.
    # 32 GB is the base M1 Max memory.
    "m1-max": HardwareProfile(
        name="Apple M1 Max (LLM in a flash)",
        dram_bytes=32 * GB,
        dram_bandwidth=400 * GB,
        flash_sequential_bandwidth=6.1 * GB,
        flash_random=((8 * KiB, 1.25 * GB), (16 * KiB, 2.25 * GB)),
    ),
    # A desktop with an RTX 4090 (LLM in a flash §4.1 uses one: 24 GB GPU memory). The other
    # figures are vendor specs, not measurements: 1008 GB/s GDDR6X (NVIDIA), PCIe 4.0 x16
    # 31.5 GB/s theoretical, 64 GB dual-channel DDR5-5600 = 89.6 GB/s, a PCIe 4.0 NVMe drive at
    # 7 GB/s sequential. No source gives this drive's small random reads, so the random table is a
    # single point at 1 MiB (optimistic for small chunks, which real drives read slower).
    "rtx4090-pc": HardwareProfile(
        name="RTX 4090 PC (vendor specs)",
        dram_bytes=64 * GB,
        dram_bandwidth=89.6 * GB,
        flash_sequential_bandwidth=7 * GB,
        flash_random=((1 * MiB, 7 * GB),),
        gpu_bytes=24 * GB,
        gpu_bandwidth=1008 * GB,
        pcie_bandwidth=31.5 * GB,
    ),
    "dev-vm": _DEV_VM,
    # The same VM as flashlm's reader delivers flash during a decode: StoreReader calls on the
    # SmolLM2 store (runs of 1..64 rows of 3456 bytes, and whole files), timed inside `read` as the
    # runtime's io_busy is, with an in-RAM decode of SmolLM2 running beside them:
    #   python benchmarks/reader_profile.py --load decode      (3 s per cell; 2026-11-21)
    # Points are (mean request bytes, MB/s). Slower than the raw disk above: each call also plans,
    # waits on its 4 threads and gathers rows, and shares two cores with the model. Measured on
    # synthetic read patterns, not on the traces benchmarks/sim_validation.py replays.
    "dev-vm-decode": replace(
        _DEV_VM,  # DRAM as measured for dev-vm; flash as the reader delivers it
        name="flashlm's development VM, reader during decode (benchmarks/reader_profile.py)",
        flash_sequential_bandwidth=992e6,
        flash_random=(
            (7418, 146e6),
            (10882, 209e6),
            (17792, 299e6),
            (31619, 353e6),
            (59264, 527e6),
            (114557, 846e6),
            (225138, 992e6),
        ),
    ),
}
"""Named profiles for `simulate` and `flashlm simulate --hardware`."""

THIS_MACHINE = "this-machine"
"""The profile name `get_preset` answers by measuring the machine at hand (`this_machine`)."""
MACHINE_PROFILES = "machine_profiles.json"
"""Measurements file (`flashlm._measurements`) of `this_machine`'s profiles, by host and disk."""
MEASURED_CHUNKS = (4 * KiB, 32 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
"""Chunk sizes `this_machine` reads the disk in, one flash table point each."""
MEASURED_SECONDS = 0.5
"""Seconds `this_machine` reads each chunk size for."""
TEST_FILE_BYTES = 1 << 30
"""Size of the file `this_machine` reads: large against the caches of a disk (and of a VM's host)."""
DRAM_PROBE_BYTES = 256 * MiB
"""Bytes `this_machine` sums to time DRAM, past any CPU cache."""


def get_preset(name: str) -> HardwareProfile:
    """The preset called `name`, this machine measured (`this-machine`: `this_machine`), or the profile
    saved at `name` if it is a `.json` file (`save_profile`); `ConfigError` naming the available
    presets otherwise."""
    if name in PRESETS:
        return PRESETS[name]
    if name == THIS_MACHINE:
        return this_machine()
    if name.endswith(".json"):
        return load_profile(name)
    raise ConfigError(
        f"Unknown hardware preset {name!r}. Available: {', '.join([*PRESETS, THIS_MACHINE])}, or a profile "
        ".json file."
    )


def this_machine(
    directory: str | os.PathLike[str] | None = None, *, progress: bool = True
) -> HardwareProfile:
    """The machine at hand, measured the first time it is asked for and remembered per host and disk
    (`flashlm._measurements`), in about ten seconds:
    - DRAM: its physical memory (all of it, as `dev-vm` counts it: `--dram` sets what a model may use),
      and the bandwidth of a sum over `DRAM_PROBE_BYTES` on torch's threads, the median of seven (a
      decode's products stream their weights as fast);
    - flash: O_DIRECT random reads of a `TEST_FILE_BYTES` file written under `directory` (default:
      flashlm's store directory) and removed after, on the reader's default threads, into huge pages
      as its staging matrices are (on a VM, twice as fast for large requests as 4 KiB pages): one
      point per chunk size of `MEASURED_CHUNKS`, the best of them the sequential bandwidth.

    A progress bar shows unless `progress` is False. `ConfigError` where that disk refuses O_DIRECT."""
    from .._measurements import recall, remember
    from .._utils import cache_dir
    from ..store import disk

    directory = Path(directory) if directory is not None else cache_dir() / "stores"
    directory.mkdir(parents=True, exist_ok=True)
    if not disk.supports_direct(directory):
        raise ConfigError(
            f"Cannot measure this machine's disk under {directory}: its file system refuses O_DIRECT, so "
            "reads would come from the page cache. Measure under a directory on the disk the stores live "
            "on (`this_machine(directory)`, or `FLASHLM_CACHE` for the default), or pass a profile .json "
            "(benchmarks/reader_profile.py writes one)."
        )
    key = disk.disk_key(directory)
    if (known := recall(MACHINE_PROFILES, key, _profile_from_fields)) is not None:
        return known
    profile = _measure_machine(directory, progress)
    remember(MACHINE_PROFILES, key, asdict(profile))
    return profile


def _measure_machine(directory: Path, progress: bool) -> HardwareProfile:
    import torch
    from tqdm.auto import tqdm

    from .._measurements import median_seconds
    from ..store import disk
    from ..store.reader import DEFAULT_THREADS

    test_file = directory / f".flashlm-disk-test-{os.getpid()}"
    bar = tqdm(MEASURED_CHUNKS, desc="Measuring this machine's disk", unit="chunk size", disable=not progress)
    try:
        disk.write_test_file(test_file, TEST_FILE_BYTES)
        reads = [
            disk.random_read_throughput(test_file, chunk, DEFAULT_THREADS, MEASURED_SECONDS, huge_pages=True)
            for chunk in bar
        ]
    finally:
        test_file.unlink(missing_ok=True)
    flash = tuple((read["chunk_bytes"], read["bytes_per_s"]) for read in reads)
    probe = torch.ones(DRAM_PROBE_BYTES // 4, dtype=torch.float32)
    return HardwareProfile(
        name=f"this machine ({os.uname().nodename}, measured by flashlm.sim.hardware.this_machine)",
        dram_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        dram_bandwidth=DRAM_PROBE_BYTES / median_seconds(probe.sum),
        flash_sequential_bandwidth=max(rate for _, rate in flash),
        flash_random=flash,
    )


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str]) -> Path:
    """Write `profile` as JSON (bytes and bytes/s), readable by `load_profile` and `--hardware FILE`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile), indent=1) + "\n")
    return path


def load_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """A profile written by `save_profile`; `ConfigError` if the file is missing or not a profile."""
    try:
        return _profile_from_fields(**json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise ConfigError(f"No hardware profile at {path}.") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{path} is not a hardware profile written by save_profile ({exc!r}).") from exc


def _profile_from_fields(**fields: Any) -> HardwareProfile:
    """A profile from its fields as JSON holds them (`asdict`), its flash table's lists as tuples."""
    fields["flash_random"] = tuple(tuple(point) for point in fields["flash_random"])
    return HardwareProfile(**fields)
