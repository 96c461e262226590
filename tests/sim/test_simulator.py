"""The hardware simulator: published figures it reproduces, static allocation, traces, CLI.

Each reproduction test builds the workload from the model's dimensions and the paper's stated
inputs (hardware, DRAM, and for LLM in a flash its measured sparsity figures) and checks the
published number within 10%. Nothing is fitted to the published outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from flashlm.cli.sim import add_simulate_parser, cmd_simulate
from flashlm.engine.trace import TraceRecorder
from flashlm.errors import ConfigError
from flashlm.sim import hardware, replay
from flashlm.sim.hardware import GB, PRESETS, HardwareProfile, KiB, MiB, get_preset, this_machine
from flashlm.sim.plots import plot_memory_sweep, sweep_memory
from flashlm.sim.reproductions import REPRODUCTIONS, TOLERANCE, opt_windowed
from flashlm.sim.reproductions import markdown as reproductions_markdown
from flashlm.sim.simulator import (
    MODEL_PRESETS,
    AnalyticDemand,
    ModelDims,
    Workload,
    allocate,
    plan_trace_reads,
    simulate,
)
from flashlm.store import disk
from flashlm.store.reader import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MERGE_GAP_BYTES,
    DEFAULT_THREADS,
    plan_reads,
    split_chunks,
)

A18 = PRESETS["a18"]
M1_MAX = PRESETS["m1-max"]
RTX = PRESETS["rtx4090-pc"]
PHI3_MEDIUM = MODEL_PRESETS["phi-3-medium"]
OPT_6_7B = MODEL_PRESETS["opt-6.7b"]


# ---- published figures (DIP arXiv 2412.01380, LLM in a flash arXiv 2312.11514) ------------------


@pytest.mark.parametrize("case", REPRODUCTIONS, ids=lambda case: case.source)
def test_simulator_reproduces_the_published_figure(case):
    """Each case of `flashlm.sim.reproductions` (its source cited there) within 10%."""
    assert abs(case.simulate() / case.published - 1) <= TOLERANCE


def test_windowed_reads_are_one_column_or_one_bundle():
    """LLM in a flash Table 2 rows 4-5 read 8 KiB columns, then 16 KiB bundles (§3.2)."""
    assert opt_windowed(bundled=False).chunk_bytes == 8 * KiB
    assert opt_windowed(bundled=True).chunk_bytes == 16 * KiB


def test_reproductions_table_lists_every_case():
    table = reproductions_markdown()
    assert all(case.source in table for case in REPRODUCTIONS)


# ---- hardware profiles ------------------------------------------------------------------------


def test_flash_bandwidth_interpolates_in_log_chunk_and_clamps():
    profile = PRESETS["dev-vm"]
    assert profile.flash_bandwidth(4 * KiB) == pytest.approx(136e6)
    assert profile.flash_bandwidth(1 * KiB) == pytest.approx(136e6)
    assert profile.flash_bandwidth(1 << 30) == pytest.approx(1542e6)
    # 128 KiB is halfway between 64 and 256 KiB in log space.
    assert profile.flash_bandwidth(128 * KiB) == pytest.approx((1067e6 + 1526e6) / 2)
    assert profile.flash_bandwidth(1, sequential=True) == pytest.approx(1671e6)
    assert M1_MAX.flash_bandwidth(12 * KiB) < M1_MAX.flash_bandwidth(16 * KiB)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dram_bandwidth": 0}, "dram_bandwidth must be > 0"),
        ({"flash_random": ()}, "at least one point"),
        ({"flash_random": ((16.0, 1e9), (8.0, 2e9))}, "strictly increasing"),
        ({"gpu_bytes": 24e9}, "a GPU needs"),
        ({"dram_bytes": -1}, "dram_bytes must be >= 0"),
    ],
)
def test_bad_hardware_profile_raises(fields, message):
    base = dict(A18.__dict__)
    base.update(fields)
    with pytest.raises(ConfigError, match=message):
        HardwareProfile(**base)


def test_unknown_preset_names_the_available_ones():
    with pytest.raises(ConfigError, match="a18, m1-max, rtx4090-pc, dev-vm, dev-vm-decode, this-machine"):
        get_preset("pixel")


def test_this_machine_is_measured_on_first_use_and_remembered(tmp_path, monkeypatch):
    """`this-machine` reads a test file under flashlm's store directory once per chunk size on the reader's
    default threads, removes it, and remembers the profile for the host and disk; a remembered entry
    the profile refuses is measured again."""
    monkeypatch.setenv("FLASHLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(disk, "supports_direct", lambda directory: True)
    monkeypatch.setattr(hardware, "TEST_FILE_BYTES", 1 << 20)
    monkeypatch.setattr(hardware, "DRAM_PROBE_BYTES", 1 << 20)
    reads = []

    def read(path, chunk, threads, seconds, *, huge_pages):
        assert huge_pages  # as the reader's staging matrices are
        assert Path(path).stat().st_size == 1 << 20
        reads.append((Path(path).parent, chunk, threads, seconds))
        return {"chunk_bytes": chunk, "bytes_per_s": 1000.0 * chunk**0.5}

    monkeypatch.setattr(disk, "random_read_throughput", read)
    profile = get_preset("this-machine")
    stores = tmp_path / "cache" / "stores"
    chunks = (4 * KiB, 32 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
    assert reads == [(stores, chunk, DEFAULT_THREADS, hardware.MEASURED_SECONDS) for chunk in chunks]
    assert profile.flash_random == tuple((chunk, 1000.0 * chunk**0.5) for chunk in chunks)
    assert profile.flash_sequential_bandwidth == 1000.0 * (4 * MiB) ** 0.5
    assert profile.dram_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert profile.dram_bandwidth > 0
    assert list(stores.iterdir()) == []  # the test file is gone

    assert get_preset("this-machine") == profile
    assert len(reads) == len(chunks)  # remembered: nothing read again

    remembered = tmp_path / "cache" / "measurements" / hardware.MACHINE_PROFILES
    entries = json.loads(remembered.read_text())
    for entry in entries.values():
        entry["dram_bandwidth"] = -1.0
    remembered.write_text(json.dumps(entries))
    assert this_machine(progress=False).flash_random == profile.flash_random
    assert len(reads) == 2 * len(chunks)


def test_this_machine_refuses_a_disk_without_o_direct(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "supports_direct", lambda directory: False)
    with pytest.raises(ConfigError, match=r"refuses O_DIRECT.*this_machine\(directory\)"):
        this_machine(tmp_path)


# ---- static allocation (DIP appendix A) --------------------------------------------------------


def test_profile_round_trips_through_json(tmp_path):
    """A saved profile (as benchmarks/reader_profile.py writes) loads back equal, also as --hardware FILE."""
    from flashlm.sim.hardware import load_profile, save_profile

    path = save_profile(PRESETS["rtx4090-pc"], tmp_path / "pc.json")
    assert load_profile(path) == PRESETS["rtx4090-pc"]
    assert get_preset(str(path)) == PRESETS["rtx4090-pc"]
    with pytest.raises(ConfigError, match="No hardware profile"):
        get_preset(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    with pytest.raises(ConfigError, match="not a hardware profile"):
        load_profile(tmp_path / "bad.json")


def test_static_allocation_leaves_the_rest_for_mlps():
    workload = Workload(PHI3_MEDIUM, context_length=1024)
    alloc = allocate(A18, workload)
    kv = 2 * 40 * 10 * 128 * 2 * 1024  # K and V, 40 layers, 10 KV heads of 128, fp16, 1024 tokens
    assert alloc.kv_bytes == kv
    assert alloc.static_bytes == pytest.approx(PHI3_MEDIUM.attention_bytes + PHI3_MEDIUM.embedding_bytes)
    assert alloc.mlp_cache_bytes == pytest.approx(4 * GB - alloc.static_bytes - kv)
    assert alloc.cache_fraction == pytest.approx(alloc.mlp_cache_bytes / PHI3_MEDIUM.mlp_bytes)
    # A model that fits caches all of its MLPs, and the cache never exceeds them.
    big = allocate(A18.with_overrides(dram_bytes=100 * GB), workload)
    assert big.mlp_cache_bytes == pytest.approx(PHI3_MEDIUM.mlp_bytes)
    assert big.cache_fraction == 1.0
    assert simulate(A18.with_overrides(dram_bytes=100 * GB), workload).flash_bytes_per_token == 0
    assert allocate(A18, workload, policy="none").mlp_cache_bytes == 0
    assert allocate(A18, workload, policy="naive").static_bytes == 0


# ---- two tiers: GPU memory and DRAM (M2Cache §5) ------------------------------------------------


def test_gpu_profile_has_two_tiers_and_pays_pcie():
    """GPU memory holds the static parts and the first MLP tier, DRAM the second: a GPU miss DRAM
    serves crosses PCIe; a DRAM miss is read from flash, written into DRAM and crosses PCIe."""
    workload = Workload(OPT_6_7B)
    assert allocate(RTX, workload).resident_bytes == 24 * GB
    profile = RTX.with_overrides(gpu_bytes=8 * GB, dram_bytes=4 * GB)
    alloc = allocate(profile, workload)
    static = OPT_6_7B.attention_bytes + OPT_6_7B.embedding_bytes
    assert alloc.resident_bytes == 8 * GB
    assert alloc.mlp_cache_bytes == pytest.approx(8 * GB - static)
    assert alloc.dram_cache_bytes == 4 * GB
    result = simulate(profile, workload, policy="lfu")
    missed = OPT_6_7B.mlp_bytes - alloc.mlp_cache_bytes  # what the GPU tier misses
    flash = missed - 4 * GB  # the DRAM tier's subset is disjoint from the GPU's
    assert result.hit_rate == pytest.approx(alloc.cache_fraction)
    assert result.dram_hit_rate == pytest.approx(4 * GB / missed)
    assert result.flash_bytes_per_token == pytest.approx(flash)
    assert result.io_s == pytest.approx(flash / (7 * GB))  # dense: one sequential read
    assert result.pcie_bytes_per_token == pytest.approx(missed)
    assert result.memory_management_s == pytest.approx(
        flash / profile.dram_bandwidth + missed / profile.pcie_bandwidth
    )
    assert result.compute_s == pytest.approx(
        (OPT_6_7B.per_token_static_read_bytes + OPT_6_7B.mlp_bytes) / profile.gpu_bandwidth
    )
    assert result.latency_s == pytest.approx(result.io_s + result.memory_management_s + result.compute_s)
    json.dumps(result.to_dict())


@pytest.mark.parametrize(
    "policy, demand",
    [
        ("lfu", AnalyticDemand()),
        ("lfu", AnalyticDemand(density=0.3)),
        ("window", AnalyticDemand(density=0.1, load_fraction=0.024, window_fraction=0.24)),
    ],
)
def test_dram_holding_every_mlp_weight_reads_nothing_from_flash(policy, demand):
    profile = RTX.with_overrides(gpu_bytes=8 * GB)  # 64 GB of DRAM: more than OPT-6.7B's 8.6 GB of MLPs
    result = simulate(profile, Workload(OPT_6_7B, demand), policy=policy)
    assert result.allocation.dram_cache_bytes == pytest.approx(OPT_6_7B.mlp_bytes)
    assert result.flash_bytes_per_token == 0 and result.io_s == 0
    assert result.dram_hit_rate == 1
    assert result.pcie_bytes_per_token > 0
    assert result.memory_management_s == pytest.approx(result.pcie_bytes_per_token / profile.pcie_bandwidth)


def test_no_dram_tier_reduces_to_one_tier():
    """DRAM 0, or policy "none" / "naive" (nothing cached in either tier): every GPU miss is read from
    flash, written into DRAM and sent over PCIe, as with one tier."""
    no_dram = RTX.with_overrides(gpu_bytes=8 * GB, dram_bytes=0)
    for policy, density in (("lfu", 1.0), ("lfu", 0.3), ("none", 1.0), ("naive", 1.0)):
        workload = Workload(OPT_6_7B, AnalyticDemand(density=density))
        result = simulate(no_dram, workload, policy=policy)
        flash = result.flash_bytes_per_token
        assert result.dram_hit_rate == 0
        assert result.pcie_bytes_per_token == pytest.approx(flash)
        assert result.memory_management_s == pytest.approx(
            flash / no_dram.dram_bandwidth + flash / no_dram.pcie_bandwidth
        )
        if policy == "lfu":
            missed = density * OPT_6_7B.mlp_bytes * (1 - result.allocation.cache_fraction)
            assert flash == pytest.approx(missed)
        else:  # 64 GB of DRAM change nothing: neither tier caches
            assert simulate(RTX.with_overrides(gpu_bytes=8 * GB), workload, policy=policy) == result


def _steps_trace(steps: list[list[int]], num_units: int = 8, unit_bytes: int = 4096):
    """One layer, one kind: step s uses the units `steps[s]`."""
    recorder = TraceRecorder()
    for step, used in enumerate(steps):
        recorder.record(step, 0, "ffn", torch.tensor(used))
    return recorder.finish(num_layers=1, num_units={"ffn": num_units}, unit_bytes={"ffn": unit_bytes})


def test_trace_dram_tier_replays_the_gpu_misses():
    """Two alternating pairs of units: ATU's two GPU slots miss every step (LRU's four would not);
    a DRAM tier of four slots serves every miss once warm, one of two slots serves none."""
    trace = _steps_trace([[0, 1], [2, 3]] * 5)
    workload = Workload(_tiny_model(1), trace)
    gpu = {(0, "ffn"): 2}

    def run(dram_units: int, policy: str = "atu", slots: dict = gpu):
        profile = RTX.with_overrides(gpu_bytes=1 * GB, dram_bytes=dram_units * 4096)
        return simulate(profile, workload, policy=policy, capacities=slots, warmup=2, dram_policy="lru")

    warm = run(4)
    assert warm.hit_rate == 0 and warm.dram_hit_rate == 1
    assert warm.flash_bytes_per_token == 0 and warm.io_s == 0
    assert warm.pcie_bytes_per_token == 2 * 4096
    assert warm.memory_management_s == pytest.approx(2 * 4096 / RTX.pcie_bandwidth)
    assert warm.latency_s == pytest.approx(warm.io_s + warm.memory_management_s + warm.compute_s)
    small = run(2)  # LRU of two slots: each pair evicts the other
    assert small.dram_hit_rate == 0
    assert small.flash_bytes_per_token == 2 * 4096  # two adjacent rows: one 8 KiB request
    assert small.pcie_bytes_per_token == 2 * 4096
    assert run(0) == replace(small, allocation=run(0).allocation)  # a tier that never hits changes nothing
    assert run(0).allocation.dram_cache_bytes == 0
    lru = run(4, "lru", {(0, "ffn"): 4})
    assert lru.hit_rate == 1 and lru.pcie_bytes_per_token == 0


def test_trace_with_no_dram_tier_matches_the_one_tier_replay():
    trace = _trace()
    model = _tiny_model()
    static = model.attention_bytes + model.embedding_bytes
    profile = RTX.with_overrides(gpu_bytes=static + 0.25 * 2 * 64 * 4096, dram_bytes=0)
    result = simulate(profile, Workload(model, trace), policy="lru")
    expected = replay(trace, capacity=0.25, policy="lru", record_misses=True)
    sizes = np.concatenate([plan_trace_reads(missed, 4096, 64) for missed in expected.missed_ids.values()])
    flash = sizes.sum() / trace.num_steps
    assert result.hit_rate == pytest.approx(expected.hit_rate)
    assert result.flash_bytes_per_token == pytest.approx(flash)
    assert result.dram_hit_rate == 0 and result.pcie_bytes_per_token == pytest.approx(flash)
    assert result.memory_management_s == pytest.approx(
        flash / RTX.dram_bandwidth + flash / RTX.pcie_bandwidth
    )
    # With DRAM for every unit (64 GB), each unit reaches flash once, at its first use.
    roomy = simulate(RTX.with_overrides(gpu_bytes=profile.gpu_bytes), Workload(model, trace), policy="lru")
    first_uses = sum(len(np.unique(torch.cat(trace.requests(*key)))) for key in trace.layer_kinds())
    assert roomy.hit_rate == result.hit_rate
    assert roomy.dram_hit_rate == pytest.approx(1 - first_uses / expected.misses.sum())
    assert roomy.flash_bytes_per_token < result.flash_bytes_per_token


def test_gpu_memory_override_needs_a_gpu():
    assert RTX.with_overrides(gpu_bytes=8 * GB).gpu_bytes == 8 * GB
    with pytest.raises(ConfigError, match="has no GPU"):
        A18.with_overrides(gpu_bytes=8 * GB)
    with pytest.raises(ConfigError, match="a GPU needs"):
        RTX.with_overrides(gpu_bytes=0)


def test_latency_is_the_sum_of_its_parts():
    result = simulate(
        M1_MAX.with_overrides(dram_bytes=8 * GB), Workload(OPT_6_7B, AnalyticDemand(density=0.3))
    )
    assert result.latency_s == pytest.approx(result.io_s + result.memory_management_s + result.compute_s)
    assert result.tokens_per_s == pytest.approx(1 / result.latency_s)
    assert result.hit_rate == pytest.approx(result.allocation.cache_fraction)
    # Without a GPU, DRAM is the only tier: nothing crosses PCIe.
    assert result.allocation.dram_cache_bytes == result.dram_hit_rate == result.pcie_bytes_per_token == 0
    json.dumps(result.to_dict())


# ---- trace workloads --------------------------------------------------------------------------


def _trace(
    num_layers: int = 2,
    num_units: int = 64,
    steps: int = 30,
    unit_bytes: int = 4096,
    metadata: dict | None = None,
):
    rng = random.Random(0)
    recorder = TraceRecorder()
    for layer in range(num_layers):
        hot = rng.sample(range(num_units), 12)
        for step in range(steps):
            used = {u for u in hot if rng.random() < 0.8} | set(rng.sample(range(num_units), 5))
            recorder.record(step, layer, "ffn", torch.tensor(sorted(used)))
    return recorder.finish(
        num_layers=num_layers, num_units={"ffn": num_units}, unit_bytes={"ffn": unit_bytes}, metadata=metadata
    )


def _tiny_model(num_layers: int = 2) -> ModelDims:
    # Only the static parts come from the model; the trace brings its own units and their sizes.
    return ModelDims("tiny", num_layers, 512, 64, True, 4, 4, 128, 1000, True, 2.0)


@pytest.mark.parametrize("policy", ["lru", "lfu", "window", "atu", "belady", "none"])
def test_trace_workload_agrees_with_replay(policy):
    trace = _trace()
    model = _tiny_model()
    mlp = 2 * 64 * 4096
    static = model.attention_bytes + model.embedding_bytes
    profile = PRESETS["dev-vm"].with_overrides(dram_bytes=static + 0.25 * mlp)
    result = simulate(profile, Workload(model, trace), policy=policy, include_compute=False)
    expected = replay(trace, capacity=0.25, policy=policy, record_misses=True)
    sizes = np.concatenate([plan_trace_reads(missed, 4096, 64) for missed in expected.missed_ids.values()])
    assert result.hit_rate == pytest.approx(expected.hit_rate)
    assert result.flash_bytes_per_token == pytest.approx(sizes.sum() / trace.num_steps)
    # 4096-byte rows are aligned: the plan reads every miss, plus the gaps it merges over.
    assert result.flash_bytes_per_token >= expected.bytes_per_step
    assert result.io_s == pytest.approx(
        sum(size / profile.flash_bandwidth(float(size)) for size in sizes) / trace.num_steps
    )
    if policy == "none":
        assert result.hit_rate == 0


def test_replay_records_misses_only_when_asked():
    trace = _trace()
    plain = replay(trace, capacity=0.25, policy="lfu")
    recorded = replay(trace, capacity=0.25, policy="lfu", record_misses=True)
    assert plain.missed_ids is None
    np.testing.assert_array_equal(plain.misses, recorded.misses)
    counts = sum(np.array([len(ids) for ids in missed]) for missed in recorded.missed_ids.values())
    np.testing.assert_array_equal(counts, recorded.misses)
    for missed in recorded.missed_ids.values():
        assert all(np.all(np.diff(ids) > 0) for ids in missed)


@pytest.mark.parametrize("unit_bytes", [1152, 4096, 6144])
def test_trace_bytes_follow_the_readers_plan(unit_bytes):
    """Planned bytes are `plan_reads`' aligned runs over each step's misses; merged requests <= misses."""
    trace = _trace(num_units=256, unit_bytes=unit_bytes)
    model = _tiny_model()
    profile = PRESETS["dev-vm"]
    capacities = {key: 40 for key in trace.layer_kinds()}
    result = simulate(
        profile, Workload(model, trace), policy="lru", capacities=capacities, include_compute=False
    )
    expected = replay(trace, capacity=capacities, policy="lru", record_misses=True)
    planned_bytes, requests = 0, 0
    for missed in expected.missed_ids.values():
        for ids in missed:
            if len(ids) == 0:
                continue
            plan = plan_reads(
                ids,
                unit_bytes,
                4096,
                alignment=4096,
                merge_gap_bytes=DEFAULT_MERGE_GAP_BYTES,
                max_run_bytes=256 * unit_bytes + 2 * 4096,
            )
            planned_bytes += plan.nbytes
            requests += len(split_chunks(plan.run_starts, plan.run_ends, DEFAULT_CHUNK_BYTES)[0])
    assert result.flash_bytes_per_token == pytest.approx(planned_bytes / trace.num_steps)
    assert result.flash_requests_per_token == pytest.approx(requests / trace.num_steps)
    assert 0 < requests <= expected.misses.sum()
    assert result.chunk_bytes == pytest.approx(planned_bytes / requests)


def test_plan_trace_reads_merges_and_chunks():
    # Rows 0-1 and 20 of 4096 bytes: 16 blocks apart (64 KiB > 40 KiB gap) -> two requests; with
    # a 1 MiB gap one run of 21 blocks; 64 adjacent rows: 256 KiB, one request; 65: two.
    assert plan_trace_reads(np.array([0, 1, 20]), 4096, 100).tolist() == [8192, 4096]
    assert plan_trace_reads(np.array([0, 1, 20]), 4096, 100, merge_gap_bytes=1 << 20).tolist() == [21 * 4096]
    assert plan_trace_reads(np.arange(64), 4096, 100).tolist() == [DEFAULT_CHUNK_BYTES]
    assert plan_trace_reads(np.arange(65), 4096, 100).tolist() == [DEFAULT_CHUNK_BYTES, 4096]
    # A 1152-byte row straddling a block boundary reads both blocks.
    assert plan_trace_reads(np.array([3]), 1152, 100).tolist() == [8192]
    assert plan_trace_reads([np.array([], dtype=np.int64)], 4096, 100).tolist() == []


def test_trace_misses_are_planned_with_the_runs_reader_settings():
    """A trace records how its run's reader cut reads (`StoreReader.plan_settings`); the simulator plans
    the misses with those, and with the reader's defaults where a trace has none."""
    settings = {"threads": 64, "chunk_bytes": 4096, "merge_gap_bytes": 0}  # one request per 4 KiB miss
    model, profile = _tiny_model(), PRESETS["dev-vm"]
    capacities = {(0, "ffn"): 16, (1, "ffn"): 16}
    expected = replay(_trace(), capacity=capacities, policy="lru", record_misses=True)
    results = {}
    for name, metadata in (("recorded", {"reader": settings}), ("defaults", None)):
        workload = Workload(model, _trace(metadata=metadata))
        results[name] = simulate(
            profile, workload, policy="lru", capacities=capacities, include_compute=False
        )
    for name, plan in (("recorded", settings), ("defaults", {})):
        sizes = np.concatenate(
            [plan_trace_reads(missed, 4096, 64, **plan) for missed in expected.missed_ids.values()]
        )
        assert results[name].flash_requests_per_token == pytest.approx(len(sizes) / 30)
        assert results[name].flash_bytes_per_token == pytest.approx(sizes.sum() / 30)
    assert results["recorded"].flash_requests_per_token == pytest.approx(expected.misses.sum() / 30)
    assert results["recorded"].flash_requests_per_token > results["defaults"].flash_requests_per_token


def test_kinds_read_ahead_whole_pin_a_block_and_read_every_unit_outside_it():
    """A kind the run read ahead whole (`read_ahead` in the trace's metadata) pins a block of units, as the
    runtime does (`read_ahead_block`), and reads every unit outside it at every step, not only the
    step's misses: more bytes, in one run."""
    model, profile = _tiny_model(), PRESETS["dev-vm"]
    capacities = {(0, "ffn"): 16, (1, "ffn"): 16}
    expected = replay(_trace(), capacity=capacities, policy="lru", read_ahead=("ffn",))
    assert all(ids.tolist() == list(range(16, 64)) for read in expected.uncached_ids.values() for ids in read)
    results = {}
    for name, kinds in (("ahead", ["ffn"]), ("on demand", [])):
        workload = Workload(model, _trace(metadata={"read_ahead": kinds}))
        results[name] = simulate(
            profile, workload, policy="lru", capacities=capacities, include_compute=False
        )
    sizes = np.concatenate([plan_trace_reads(read, 4096, 64) for read in expected.uncached_ids.values()])
    assert results["ahead"].flash_bytes_per_token == pytest.approx(sizes.sum() / 30)
    assert results["ahead"].flash_requests_per_token == pytest.approx(len(sizes) / 30)
    assert results["ahead"].flash_bytes_per_token > results["on demand"].flash_bytes_per_token
    used = [ids for layer in range(2) for ids in _trace().requests(layer, "ffn")]
    in_block = sum(int((ids < 16).sum()) for ids in used)
    assert results["ahead"].hit_rate == pytest.approx(in_block / sum(ids.numel() for ids in used))
    with pytest.raises(ConfigError, match=r"read-ahead kinds \['gate'\].*record the trace again"):
        simulate(profile, Workload(model, _trace(metadata={"read_ahead": ["gate"]})), policy="lru")


@pytest.mark.parametrize(
    "settings",
    [
        {"threads": 0},
        {"chunk_bytes": "4096"},
        {"threads": True},
        {"queue_depth": 8},
        {"merge_gap_bytes": -1},
        [4],
    ],
)
def test_trace_with_bad_reader_settings_raises(settings):
    trace = _trace(metadata={"reader": settings})
    with pytest.raises(ConfigError, match=r"reader settings.*record the trace again"):
        simulate(PRESETS["dev-vm"], Workload(_tiny_model(), trace), policy="lru")


def test_trace_with_explicit_capacities_reproduces_replay():
    trace = _trace()
    model = _tiny_model()
    capacities = {(0, "ffn"): 7, (1, "ffn"): 20}
    expected = replay(trace, capacity=capacities, policy="lfu")
    for given in (capacities, {"0/ffn": 7, "1/ffn": 20}):
        result = simulate(PRESETS["dev-vm"], Workload(model, trace), policy="lfu", capacities=given)
        assert result.hit_rate == pytest.approx(expected.hit_rate)
        assert result.allocation.mlp_cache_bytes == 27 * 4096
    uniform = simulate(PRESETS["dev-vm"], Workload(model, trace), policy="lfu")
    assert uniform.hit_rate != pytest.approx(expected.hit_rate)
    with pytest.raises(ConfigError, match="capacity"):
        simulate(PRESETS["dev-vm"], Workload(model, trace), policy="lfu", capacities={(0, "ffn"): 7})
    with pytest.raises(ConfigError, match="trace workload only"):
        simulate(PRESETS["dev-vm"], Workload(model), capacities=capacities)


def test_trace_warmup_drops_leading_steps():
    trace = _trace()
    model = _tiny_model()
    profile = PRESETS["dev-vm"]
    result = simulate(profile, Workload(model, trace), policy="lru", warmup=10)
    expected = replay(trace, capacity=1.0, policy="lru", record_misses=True)
    planned = sum(plan_trace_reads(missed[10:], 4096, 64).sum() for missed in expected.missed_ids.values())
    assert result.flash_bytes_per_token == pytest.approx(planned / 20)
    with pytest.raises(ConfigError, match="warmup"):
        simulate(profile, Workload(model, trace), policy="lru", warmup=30)


# ---- bad inputs -------------------------------------------------------------------------------


def test_bad_inputs_raise_config_error():
    with pytest.raises(ConfigError, match="needs a recorded trace"):
        simulate(A18, Workload(PHI3_MEDIUM), policy="belady")
    with pytest.raises(ConfigError, match=r"'atu' needs a recorded trace.*consecutive tokens share"):
        simulate(A18, Workload(PHI3_MEDIUM), policy="atu")
    with pytest.raises(ConfigError, match="Unknown policy 'mru'"):
        simulate(A18, Workload(PHI3_MEDIUM), policy="mru")
    with pytest.raises(ConfigError, match="Unknown DRAM-tier policy 'naive'"):
        simulate(RTX, Workload(_tiny_model(), _trace()), dram_policy="naive")
    with pytest.raises(ConfigError, match="Unknown policy 'mru'"):
        simulate(A18, Workload(_tiny_model(), _trace()), policy="mru")
    with pytest.raises(ConfigError, match="cannot hold what must stay resident"):
        simulate(A18.with_overrides(dram_bytes=1 * GB), Workload(PHI3_MEDIUM))
    with pytest.raises(ConfigError, match="load_fraction and window_fraction"):
        simulate(A18, Workload(PHI3_MEDIUM), policy="window")
    with pytest.raises(ConfigError, match="sliding window keeps"):
        demand = AnalyticDemand(density=0.1, load_fraction=0.02, window_fraction=0.9)
        simulate(A18, Workload(PHI3_MEDIUM, demand), policy="window")
    with pytest.raises(ConfigError, match="together"):
        AnalyticDemand(load_fraction=0.1)
    with pytest.raises(ConfigError, match="density must be a fraction"):
        AnalyticDemand(density=1.5)
    with pytest.raises(ConfigError, match="trace has 2 layers"):
        Workload(PHI3_MEDIUM, _trace())
    with pytest.raises(ConfigError, match="context_length"):
        Workload(PHI3_MEDIUM, context_length=-1)
    with pytest.raises(ConfigError, match="bytes_per_weight"):
        ModelDims("x", 1, 8, 8, True, 1, 1, 8, 8, True, 0)


def test_model_dims_from_hf_config(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    dims = ModelDims.from_hf_config(tmp_path, bytes_per_weight=MODEL_PRESETS["llama-3-8b"].bytes_per_weight)
    assert dims.weight_bytes == pytest.approx(MODEL_PRESETS["llama-3-8b"].weight_bytes)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="cannot read the model's dimensions"):
        ModelDims.from_hf_config(tmp_path)


# ---- CLI --------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flashlm")
    add_simulate_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["simulate", *argv])


def test_cmd_simulate_on_a_preset(capsys):
    args = _parse(["--hardware", "a18", "--model", "phi-3-medium", "--no-compute"])
    assert args.func is cmd_simulate
    assert cmd_simulate(args) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "0.288" in out
    args = _parse(["--model", "phi-3-medium", "--dram", "6GB", "--flash-bandwidth", "2GB", "--json"])
    assert cmd_simulate(args) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["allocation"]["resident_bytes"] == 6e9
    assert record["tokens_per_s"] > 0


def test_cmd_simulate_with_a_trace(tmp_path, capsys):
    trace = _trace(num_layers=32)
    path = tmp_path / "t.safetensors"
    trace.save(path)
    args = _parse(
        ["--hardware", "m1-max", "--model", "opt-6.7b", "--trace", str(path), "--policy", "belady", "--json"]
    )
    assert cmd_simulate(args) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "belady"


def test_cmd_simulate_gpu_memory_and_dram_tier(tmp_path, capsys):
    argv = ["--hardware", "rtx4090-pc", "--model", "opt-6.7b", "--gpu-memory", "8GB", "--dram", "4GB"]
    assert cmd_simulate(_parse([*argv, "--json"])) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["allocation"]["resident_bytes"] == 8e9
    assert record["allocation"]["dram_cache_bytes"] == 4e9
    assert 0 < record["dram_hit_rate"] < 1 and record["pcie_bytes_per_token"] > 0
    assert cmd_simulate(_parse(argv)) == 0
    out = capsys.readouterr().out
    assert "GPU memory" in out and "DRAM hit rate (of GPU misses)" in out and "PCIe per token" in out
    path = tmp_path / "t.safetensors"
    _trace(num_layers=32).save(path)
    trace_argv = ["--trace", str(path), "--policy", "atu", "--dram-policy", "lfu", "--gpu-memory", "5GB"]
    assert cmd_simulate(_parse([*argv[:4], *trace_argv])) == 0
    assert "atu (trace), DRAM tier lfu" in capsys.readouterr().out
    for bad, message in (
        (["--hardware", "a18", "--gpu-memory", "8GB"], "has no GPU"),
        (["--hardware", "rtx4090-pc", "--gpu-memory", "lots"], "--gpu-memory: Cannot read 'lots'"),
        (["--hardware", "rtx4090-pc", "--gpu-memory", "0"], "a GPU needs"),
    ):
        with pytest.raises(ConfigError, match=message):
            cmd_simulate(_parse(["--model", "opt-6.7b", *bad]))


def test_cmd_simulate_sweeps_the_dram_tier_with_a_gpu(capsys):
    argv = ["--hardware", "rtx4090-pc", "--model", "opt-6.7b", "--gpu-memory", "8GB"]
    assert cmd_simulate(_parse([*argv, "--sweep-dram", "0GB,4GB,16GB"])) == 0
    out = capsys.readouterr().out
    assert "| GPU hit rate | DRAM hit rate |" in out and out.count("| lfu |") == 3
    assert cmd_simulate(_parse([*argv, "--sweep-dram", "0GB,4GB,16GB", "--json"])) == 0
    results = json.loads(capsys.readouterr().out)["lfu"]
    assert [r["dram_hit_rate"] for r in results] == sorted(r["dram_hit_rate"] for r in results)
    assert results[0]["flash_bytes_per_token"] > results[1]["flash_bytes_per_token"] > 0
    assert results[2]["flash_bytes_per_token"] == 0


def test_cmd_simulate_unknown_model():
    with pytest.raises(ConfigError, match="neither a preset"):
        cmd_simulate(_parse(["--model", "gpt-5"]))
    with pytest.raises(ConfigError, match="needs --model"):
        cmd_simulate(_parse([]))


def test_cmd_simulate_reproduce_prints_the_published_figures(capsys):
    assert cmd_simulate(_parse(["--reproduce"])) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == len(REPRODUCTIONS) + 2
    assert "| LLM in a flash Table 2, naive (OPT-6.7B from flash at 6.1 GB/s) | ms flash I/O | 2196 |" in out


def test_memory_sweep_latency_falls_as_the_cache_grows(tmp_path):
    """LLM in a flash Fig. 7's shape: more DRAM, more of the MLPs cached, less flash I/O per token."""
    sizes = [6e9, 8e9, 10e9, 12e9]
    sweep = sweep_memory(PRESETS["m1-max"], Workload(MODEL_PRESETS["opt-6.7b"]), sizes, ["naive", "lfu"])
    lfu, naive = sweep["lfu"], sweep["naive"]
    assert [r.io_s for r in lfu] == sorted((r.io_s for r in lfu), reverse=True)
    assert lfu[0].io_s > lfu[-1].io_s
    assert all(r.io_s == pytest.approx(naive[0].io_s) for r in naive)  # naive caches nothing
    assert [r.hit_rate for r in lfu] == sorted(r.hit_rate for r in lfu)
    path = plot_memory_sweep(sweep, sizes, tmp_path / "sweep.png")
    assert path.stat().st_size > 10_000


def test_cmd_simulate_sweep_prints_every_cell_and_plots(tmp_path, capsys):
    plot = tmp_path / "sweep.png"
    argv = ["--model", "opt-6.7b", "--hardware", "m1-max", "--sweep-dram", "8GB,12GB"]
    args = _parse([*argv, "--policies", "naive,lfu", "--plot", str(plot)])
    assert cmd_simulate(args) == 0
    out = capsys.readouterr().out
    assert out.count("| lfu |") == 2 and out.count("| naive |") == 2
    assert plot.is_file()
    with pytest.raises(ConfigError, match="--sweep-dram"):
        cmd_simulate(_parse(["--model", "opt-6.7b", "--plot", str(plot)]))
