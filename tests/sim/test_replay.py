"""Offline replay of traces through the cache policies, and Belady's oracle against brute force."""

from __future__ import annotations

import itertools
import json
import random
from functools import cache

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlm.cache import BeladyPolicy, NeuronCache, make_policy, policy_state_bytes
from flashlm.engine.trace import Trace, TraceRecorder
from flashlm.errors import ConfigError
from flashlm.sim import ReplayResult, replay

# Silberschatz et al., Operating System Concepts: the reference string of the page-replacement
# chapter. With 3 frames, the optimal (MIN, no bypass) algorithm takes 9 page faults.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
TEXTBOOK_OPT_FAULTS = 9


def make_trace(layers: list[list[list[int]]], num_units: int, unit_bytes: int = 10, kind="ffn") -> Trace:
    """A trace with one kind; `layers[l][s]` are the units layer l needs at step s."""
    recorder = TraceRecorder()
    for layer, steps in enumerate(layers):
        for step, used in enumerate(steps):
            recorder.record(step, layer, kind, torch.tensor(used, dtype=torch.int64))
    return recorder.finish(num_layers=len(layers), num_units={kind: num_units}, unit_bytes={kind: unit_bytes})


def random_steps(rng: random.Random, num_units: int, steps: int) -> list[list[int]]:
    """Multi-unit steps from a drifting hot set plus noise, so policies disagree."""
    hot = rng.sample(range(num_units), max(1, num_units // 4))
    out = []
    for _ in range(steps):
        if rng.random() < 0.3:
            hot[rng.randrange(len(hot))] = rng.randrange(num_units)
        used = {u for u in hot if rng.random() < 0.7}
        used |= set(rng.sample(range(num_units), rng.randrange(num_units // 3 + 1)))
        out.append(sorted(used))
    return out


# ---- independent optima -----------------------------------------------------------------------


def textbook_min(refs: list[int], frames: int, *, bypass: bool) -> int:
    """Belady's MIN over single-page references: on a fault with full frames, evict the page used
    farthest in the future (with bypass, the faulting page itself may be the one not kept)."""
    resident: set[int] = set()
    faults = 0
    for t, page in enumerate(refs):
        if page in resident:
            continue
        faults += 1
        if frames == 0:
            continue
        if len(resident) < frames:
            resident.add(page)
            continue

        def next_use(p: int, t: int = t) -> int:
            return next((s for s in range(t + 1, len(refs)) if refs[s] == p), len(refs))

        pool = resident | {page} if bypass else resident
        victim = max(sorted(pool), key=next_use)
        if victim != page:
            resident.discard(victim)
            resident.add(page)
    return faults


def brute_force_misses(steps: list[list[int]], capacity: int) -> int:
    """Fewest misses over every caching schedule: after each step the cache may hold any
    `capacity` units among its residents and the units that step read (the trace model)."""
    requests = [frozenset(s) for s in steps]

    @cache
    def best(t: int, resident: frozenset[int]) -> int:
        if t == len(requests):
            return 0
        misses = len(requests[t] - resident)
        pool = sorted(resident | requests[t])
        keep_options = itertools.combinations(pool, min(capacity, len(pool)))
        return misses + min(best(t + 1, frozenset(keep)) for keep in keep_options)

    return best(0, frozenset())


def direct_run(steps: list[list[int]], num_units: int, capacity: int, policy: str, window: int = 5):
    """Per-step (hits, misses) of a NeuronCache driven by hand."""
    options = {"window": window} if policy == "window" else {}
    cache = NeuronCache(num_units, capacity, 2, torch.float32, make_policy(policy, num_units, **options))
    out = []
    for step, used in enumerate(steps):
        ids = torch.tensor(used, dtype=torch.int64)
        hit_ids, _, miss_ids = cache.lookup(ids)
        cache.update(ids, miss_ids, torch.zeros(miss_ids.numel(), 2), step)
        out.append((hit_ids.numel(), miss_ids.numel()))
    return out


# ---- Belady -----------------------------------------------------------------------------------


def test_textbook_reference_string() -> None:
    assert textbook_min(TEXTBOOK, 3, bypass=False) == TEXTBOOK_OPT_FAULTS  # the simulation is the textbook's
    steps = [[page] for page in TEXTBOOK]
    trace = make_trace([steps], num_units=8)
    for frames in range(0, 9):
        optimum = brute_force_misses(steps, frames)
        assert textbook_min(TEXTBOOK, frames, bypass=True) == optimum
        assert optimum <= textbook_min(TEXTBOOK, frames, bypass=False)
        result = replay(trace, capacity={(0, "ffn"): frames}, policy="belady")
        assert int(result.misses.sum()) == optimum, frames
    assert brute_force_misses(steps, 3) == 8  # bypass spares one fault of the textbook's 9


@settings(max_examples=120, deadline=None)
@given(num_units=st.integers(1, 7), data=st.data())
def test_belady_is_optimal_on_multi_unit_steps(num_units: int, data: st.DataObject) -> None:
    capacity = data.draw(st.integers(0, min(num_units, 4)), label="capacity")
    step_sets = st.sets(st.integers(0, num_units - 1), max_size=num_units).map(sorted)
    steps = data.draw(st.lists(step_sets, max_size=9), label="steps")
    trace = make_trace([steps], num_units)
    result = replay(trace, capacity={(0, "ffn"): capacity}, policy="belady")
    assert int(result.misses.sum()) == brute_force_misses(steps, capacity)


@pytest.mark.parametrize("seed", range(6))
def test_belady_never_misses_more_than_online_policies(seed: int) -> None:
    rng = random.Random(seed)
    num_units = rng.randrange(8, 80)
    trace = make_trace([random_steps(rng, num_units, 60) for _ in range(3)], num_units)
    for fraction in (0.0, 0.1, 0.25, 0.5, 0.8, 1.0):
        belady = replay(trace, capacity=fraction, policy="belady")
        for policy in ("lru", "lfu", "window", "atu"):
            online = replay(trace, capacity=fraction, policy=policy, window=3)
            assert belady.misses.sum() <= online.misses.sum(), (fraction, policy)
            assert belady.bytes_read.sum() <= online.bytes_read.sum()


def test_belady_priority_follows_the_future() -> None:
    requests = [torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([1]), torch.tensor([0])]
    policy = make_policy("belady", 4, requests=requests)
    assert isinstance(policy, BeladyPolicy)
    assert policy.next_use.tolist() == [0, 0, 1, BeladyPolicy.NEVER]
    policy.record(torch.tensor([0, 1]), 0)
    assert policy.next_use.tolist() == [3, 2, 1, BeladyPolicy.NEVER]
    ranked = sorted(range(4), key=lambda u: -int(policy.priority(torch.tensor([u]))))
    assert ranked == [2, 1, 0, 3]  # sooner first, never-again last
    policy.record(torch.tensor([2]), 1)
    assert policy.next_use[2] == BeladyPolicy.NEVER
    policy.reset()
    assert policy.next_use.tolist() == [0, 0, 1, BeladyPolicy.NEVER]
    assert policy.state_dict() == {}
    assert policy_state_bytes("belady", 4) == 4 * 8  # next_use; the future is input, not state


def test_belady_record_off_the_plan_searches_the_future() -> None:
    """`record` with ids other than the step's planned set (or duplicates) finds the same next uses."""
    rng = random.Random(5)
    steps = random_steps(rng, 30, 40)
    requests = [torch.tensor(used + used[:2], dtype=torch.int64) for used in steps]  # duplicates too
    planned = make_policy("belady", 30, requests=requests)
    searched = make_policy("belady", 30, requests=requests)
    for step, used in enumerate(steps):
        ids = torch.tensor(used, dtype=torch.int64)
        planned.record(ids, step)
        for unit in reversed(used):  # one at a time, off the plan
            searched.record(torch.tensor([unit], dtype=torch.int32), step)
        assert torch.equal(planned.next_use, searched.next_use), step
        later = [s for s in range(step + 1, len(steps)) if 0 in steps[s]]
        if 0 in used:
            assert int(planned.next_use[0]) == (later[0] if later else BeladyPolicy.NEVER)


def test_belady_without_a_future_and_bad_requests() -> None:
    policy = make_policy("belady", 5)
    assert sum(b.numel() * b.element_size() for b in policy.buffers()) == policy_state_bytes("belady", 5)
    assert bool((policy.priority(torch.arange(5)) == -BeladyPolicy.NEVER).all())
    with pytest.raises(ConfigError, match="outside"):
        make_policy("belady", 3, requests=[torch.tensor([0, 3])])
    with pytest.raises(ConfigError):
        make_policy("belady", 3, window=2)


# ---- replay -----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu", "window", "atu"])
@pytest.mark.parametrize("seed", range(3))
def test_replay_equals_a_direct_cache_run(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    num_units = rng.randrange(4, 60)
    layers = [random_steps(rng, num_units, 40) for _ in range(2)]
    trace = make_trace(layers, num_units, unit_bytes=6)
    capacities = {(layer, "ffn"): rng.randrange(num_units + 1) for layer in range(2)}
    result = replay(trace, capacity=capacities, policy=policy, window=3)
    expected = [
        direct_run(steps, num_units, capacities[(layer, "ffn")], policy, 3)
        for layer, steps in enumerate(layers)
    ]
    hits = np.array([[h for h, _ in run] for run in expected]).sum(0)
    misses = np.array([[m for _, m in run] for run in expected]).sum(0)
    assert np.array_equal(result.hits, hits)
    assert np.array_equal(result.misses, misses)
    assert np.array_equal(result.bytes_read, misses * 6)
    assert result.capacities == capacities


def test_atu_replay_misses_whatever_the_previous_step_did_not_use() -> None:
    """ATU's misses at a step are its units the previous step did not use (when steps fit)."""
    rng = random.Random(3)
    steps = random_steps(rng, 40, 30)
    result = replay(make_trace([steps], 40), capacity=1.0, policy="atu")
    expected = [len(set(used) - set(before)) for before, used in zip([[], *steps[:-1]], steps, strict=True)]
    assert result.misses.tolist() == expected
    lru = replay(make_trace([steps], 40), capacity=1.0, policy="lru")
    assert lru.misses.sum() < result.misses.sum()


def test_uncached_ids_are_the_units_not_resident_before_each_step() -> None:
    """What a kind read ahead whole reads: under ATU with room for every unit the previous step's units
    alone stay resident, so the rest are uncached; with room for fewer, the cache pins the block of
    its first units (`read_ahead_block`, as the runtime does), and every other unit is uncached at every
    step whatever the policy, a step's misses among them."""
    rng = random.Random(5)
    steps = random_steps(rng, 40, 30)
    atu = replay(make_trace([steps], 40), capacity=1.0, policy="atu", read_ahead=("ffn",))
    expected = [sorted(set(range(40)) - set(before)) for before in [[], *steps[:-1]]]
    assert [ids.tolist() for ids in atu.uncached_ids[(0, "ffn")]] == expected
    layers = [random_steps(rng, 40, 30) for _ in range(2)]
    lru = replay(make_trace(layers, 40), capacity=0.3, policy="lru", record_misses=True, read_ahead=("ffn",))
    for layer, used in enumerate(layers):
        for step, ids in enumerate(used):
            assert lru.uncached_ids[(layer, "ffn")][step].tolist() == list(range(12, 40))  # 30% of 40 fit
            assert lru.missed_ids[(layer, "ffn")][step].tolist() == sorted(set(ids) - set(range(12)))
    on_demand = replay(make_trace(layers, 40), capacity=0.3, policy="lru")
    assert on_demand.uncached_ids == {} and on_demand.misses.sum() != lru.misses.sum()


def test_none_reads_everything() -> None:
    rng = random.Random(7)
    trace = make_trace([random_steps(rng, 30, 25) for _ in range(2)], 30, unit_bytes=4)
    result = replay(trace, capacity=0.9, policy="none")
    assert result.hit_rate == 0.0
    assert int(result.hits.sum()) == 0
    requested = sum(ids.numel() for layer in range(2) for ids in trace.requests(layer, "ffn"))
    assert int(result.misses.sum()) == requested
    assert result.bytes_per_step == pytest.approx(requested * 4 / trace.num_steps)
    assert set(result.capacities.values()) == {0}


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady"])
def test_full_capacity_has_only_compulsory_misses(policy: str) -> None:
    rng = random.Random(3)
    layers = [random_steps(rng, 50, 40) for _ in range(3)]
    trace = make_trace(layers, 50)
    result = replay(trace, capacity=1.0, policy=policy)
    distinct = sum(len(set().union(*map(set, steps))) for steps in layers)
    assert int(result.misses.sum()) == distinct
    first_seen: set[tuple[int, int]] = set()
    for step in range(trace.num_steps):  # each unit misses exactly at its first use
        new = {(layer, u) for layer, steps in enumerate(layers) for u in steps[step]} - first_seen
        assert result.misses[step] == len(new)
        first_seen |= new


def test_capacity_fraction_and_two_kinds() -> None:
    recorder = TraceRecorder()
    for step in range(10):
        recorder.record(step, 0, "ffn", torch.arange(step % 3, 100, 7))
        recorder.record(step, 0, "head", torch.tensor([step % 4]))
    trace = recorder.finish(
        num_layers=1, num_units={"ffn": 100, "head": 8}, unit_bytes={"ffn": 3, "head": 50}
    )
    result = replay(trace, capacity=0.29, policy="lru")
    assert result.capacities == {(0, "ffn"): 29, (0, "head"): 2}
    solo = [
        replay(make_trace([[r.tolist() for r in trace.requests(0, kind)]], n, b), capacity=0.29, policy="lru")
        for kind, n, b in (("ffn", 100, 3), ("head", 8, 50))
    ]
    assert np.array_equal(result.bytes_read, solo[0].bytes_read + solo[1].bytes_read)
    total = result.hits.sum() + result.misses.sum()
    assert result.hit_rate == pytest.approx(result.hits.sum() / total)


def test_result_to_dict_is_json(tmp_path) -> None:
    rng = random.Random(11)
    trace = make_trace([random_steps(rng, 20, 12)], 20)
    path = tmp_path / "t.safetensors"
    trace.save(path)
    result = replay(Trace.load(path), capacity=0.5, policy="belady", progress=True)
    assert isinstance(result, ReplayResult)
    same = replay(trace, capacity=0.5, policy="belady")
    assert np.array_equal(result.misses, same.misses)
    summary = json.loads(json.dumps(result.to_dict()))
    assert summary["policy"] == "belady"
    assert summary["num_steps"] == trace.num_steps == len(summary["hits"])
    assert summary["capacities"] == {"0/ffn": 10}
    assert summary["total_bytes_read"] == int(result.bytes_read.sum())


def test_replay_rejects_bad_arguments() -> None:
    trace = make_trace([[[0, 1], [2]]], 4)
    with pytest.raises(ConfigError, match="belady"):
        replay(trace, capacity=0.5, policy="fifo")
    for bad in (1.5, -0.1, True, "half"):
        with pytest.raises(ConfigError):
            replay(trace, capacity=bad, policy="lru")
    with pytest.raises(ConfigError, match="missing"):
        replay(trace, capacity={}, policy="lru")
    with pytest.raises(ConfigError, match="unknown"):
        replay(trace, capacity={(0, "ffn"): 1, (1, "ffn"): 1}, policy="lru")
    with pytest.raises(ConfigError):
        replay(trace, capacity={(0, "ffn"): 5}, policy="lru")
    with pytest.raises(ConfigError):
        replay(trace, capacity=0.5, policy="window", window=0)


def test_empty_trace() -> None:
    trace = TraceRecorder().finish(num_layers=2, num_units={"ffn": 5}, unit_bytes={"ffn": 1})
    result = replay(trace, capacity=0.5, policy="belady")
    assert result.num_steps == 0 and result.hit_rate == 0.0 and result.bytes_per_step == 0.0
