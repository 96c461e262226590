"""Neuron cache, eviction policies and budget split, checked against a pure-Python reference."""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import flashlm.cache.neuron_cache as neuron_cache
from flashlm._utils import format_bytes
from flashlm.cache import (
    BudgetPlan,
    EvictionPolicy,
    NeuronCache,
    available_policies,
    make_policy,
    policy_state_bytes,
    split_budget,
)
from flashlm.cache.policies import NO_CACHE, POLICIES
from flashlm.config import FlashConfig
from flashlm.errors import BudgetTooSmallError, ConfigError

WIDTH = 3


class ReferenceCache:
    """Dict-and-set model of the cache: same policies, same admission rule, no tensors, no slots."""

    def __init__(self, policy: str, capacity: int, window: int = 0) -> None:
        self.policy = policy
        self.capacity = capacity
        self.window = window
        self.last: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.resident: set[int] = set()

    def priority(self, unit: int) -> int:
        if self.policy == "lfu":
            return self.count.get(unit, 0) * 2**32 + self.last.get(unit, -1)
        return self.last.get(unit, -1)

    def expired(self, unit: int, step: int) -> bool:
        window = {"window": self.window, "atu": 1}.get(self.policy)
        return window is not None and self.last.get(unit, -1) <= step - window

    def step(self, used: list[int], step: int) -> tuple[int, int, int]:
        """One decode step; returns (hits, misses, evictions)."""
        misses = [u for u in used if u not in self.resident]
        for u in used:
            self.last[u] = step
            self.count[u] = self.count.get(u, 0) + 1
        evictions = 0
        for u in sorted(self.resident):
            if self.expired(u, step):
                self.resident.remove(u)
                evictions += 1
        for u in sorted(misses, key=lambda u: (-self.priority(u), u)):
            if len(self.resident) < self.capacity:
                self.resident.add(u)
                continue
            if not self.resident:
                break
            weakest = min(self.resident, key=lambda r: (self.priority(r), r))
            if self.priority(u) > self.priority(weakest):
                self.resident.remove(weakest)
                self.resident.add(u)
                evictions += 1
        return len(used) - len(misses), len(misses), evictions


def policy_options(policy: str, window: int) -> dict:
    return {"window": window} if policy == "window" else {}


def make_cache(
    policy: str, num_units: int, capacity: int, window: int = 2, dtype=torch.float32
) -> NeuronCache:
    return NeuronCache(
        num_units, capacity, WIDTH, dtype, make_policy(policy, num_units, **policy_options(policy, window))
    )


def unit_rows(ids: torch.Tensor, cache: NeuronCache) -> torch.Tensor:
    """Each unit's row is filled with its own id, so a slot's content names its unit."""
    return ids[:, None].to(cache.rows.dtype).expand(-1, WIDTH)


def check_invariants(cache: NeuronCache) -> None:
    """Occupied slots are 0..size-1, the two maps are inverse, and every row is its unit's."""
    size = cache.size
    resident = cache.slot_ids[:size]
    assert bool((resident >= 0).all())
    assert bool((cache.slot_ids[size:] == -1).all())
    assert torch.equal(cache.slot_of[resident], torch.arange(size))
    assert int((cache.slot_of >= 0).sum()) == size
    assert torch.equal(cache.rows[:size], unit_rows(resident, cache))


def run_step(cache: NeuronCache, used: list[int], step: int) -> tuple[int, int, int]:
    """Drive the cache through one step as a sparse MLP does; returns the counter increments."""
    before = cache.hits, cache.misses, cache.evictions
    ids = torch.tensor(sorted(used), dtype=torch.int64)
    hit_ids, hit_slots, miss_ids = cache.lookup(ids)
    assert torch.equal(cache.rows[hit_slots], unit_rows(hit_ids, cache))
    cache.update(ids, miss_ids, unit_rows(miss_ids, cache), step)
    check_invariants(cache)
    return cache.hits - before[0], cache.misses - before[1], cache.evictions - before[2]


ADMISSIONS = ["native", "torch"]


@contextlib.contextmanager
def admission(path: str):
    """The cache's record, expiry and admission in one call to C (`flashlm_update`; skipped without a C
    compiler) or the policy's and the cache's torch operators."""
    if path == "native":
        if neuron_cache._native_update() is None:
            pytest.skip("no C compiler: the native admission is not built")
        yield
    else:
        with mock.patch.object(neuron_cache, "_native_update", lambda: None):
            yield


def random_trace(rng: random.Random, num_units: int, steps: int) -> list[list[int]]:
    """Steps drawing mostly from a drifting hot set, so hits, misses and evictions all happen."""
    hot = rng.sample(range(num_units), max(1, num_units // 3))
    trace = []
    for _ in range(steps):
        if rng.random() < 0.2:
            hot[rng.randrange(len(hot))] = rng.randrange(num_units)
        used = {u for u in hot if rng.random() < 0.8}
        used |= set(rng.sample(range(num_units), rng.randrange(num_units // 2 + 1)))
        trace.append(sorted(used))
    return trace


def assert_matches_reference(policy: str, num_units: int, capacity: int, window: int, trace) -> None:
    cache = make_cache(policy, num_units, capacity, window)
    reference = ReferenceCache(policy, capacity, window)
    for step, used in enumerate(trace):
        assert run_step(cache, used, step) == reference.step(used, step), f"step {step}"
        assert set(cache.resident_ids.tolist()) == reference.resident, f"step {step}"


# ---- policies against the reference ---------------------------------------------------------


@pytest.mark.parametrize("path", ADMISSIONS)
@pytest.mark.parametrize("policy", ["lru", "lfu", "window", "atu"])
@pytest.mark.parametrize("seed", range(8))
def test_matches_reference_on_seeded_traces(policy: str, seed: int, path: str) -> None:
    rng = random.Random(seed)
    num_units = rng.randrange(1, 64)
    capacity = rng.randrange(num_units + 1)
    with admission(path):
        assert_matches_reference(
            policy, num_units, capacity, rng.randrange(1, 6), random_trace(rng, num_units, 60)
        )


@pytest.mark.parametrize("staging_dtype", [torch.float32, torch.bfloat16], ids=["same-dtype", "converted"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "window", "atu"])
@pytest.mark.parametrize("seed", range(8))
def test_native_admission_places_every_unit_where_the_torch_one_does(
    policy: str, seed: int, staging_dtype: torch.dtype
) -> None:
    """Same slots, rows, size, evictions and unit-prefix flag after every step, pinned units or not,
    with the rows read in place by unit (`by_unit`, the sparse methods' staging matrices), in the
    cache's dtype (copied in C) or another (converted by torch)."""
    rng = random.Random(seed)
    num_units = rng.randrange(1, 64)
    capacity = rng.randrange(num_units + 1)
    caches = {path: make_cache(policy, num_units, capacity) for path in ADMISSIONS}
    staging = unit_rows(torch.arange(num_units), caches["native"]).to(staging_dtype)
    pinned = torch.tensor(sorted(rng.sample(range(num_units), rng.randrange(capacity // 2 + 1))))
    for path, cache in caches.items():
        if pinned.numel():
            with admission(path):
                cache.pin(pinned, staging)
    for step, used in enumerate(random_trace(rng, num_units, 60)):
        ids = torch.tensor(used, dtype=torch.int64)
        for path, cache in caches.items():
            with admission(path):  # the C update called holding the GIL and releasing it, in turn
                cache.update(
                    ids, cache.find_misses(ids), staging, step, by_unit=True, release_gil=step % 2 == 1
                )
            check_invariants(cache)
        native, reference = caches["native"], caches["torch"]
        assert torch.equal(native.slot_ids, reference.slot_ids), f"step {step}"
        assert torch.equal(native.slot_of, reference.slot_of) and torch.equal(native.rows, reference.rows)
        assert (native.size, native.evictions, native.holds_unit_prefix) == (
            reference.size,
            reference.evictions,
            reference.holds_unit_prefix,
        )
    assert caches["native"].evictions > 0 or capacity in (0, num_units)


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(["lru", "lfu", "window", "atu"]),
    num_units=st.integers(1, 24),
    data=st.data(),
)
def test_matches_reference_on_any_trace(policy: str, num_units: int, data: st.DataObject) -> None:
    capacity = data.draw(st.integers(0, num_units), label="capacity")
    window = data.draw(st.integers(1, 4), label="window")
    step_sets = st.sets(st.integers(0, num_units - 1), max_size=num_units)
    trace = data.draw(st.lists(step_sets.map(sorted), max_size=20), label="trace")
    assert_matches_reference(policy, num_units, capacity, window, trace)


def test_lru_evicts_least_recent_and_keeps_units_used_this_step() -> None:
    cache = make_cache("lru", 8, 3)
    for step, used in enumerate([[0, 1, 2], [0], [3]]):
        run_step(cache, used, step)
    assert set(cache.resident_ids.tolist()) == {0, 2, 3}  # 1 was older than 2 (tie at step 0: lower id first)
    run_step(cache, [4, 5, 6], 3)  # three candidates, three older residents: all replaced
    assert set(cache.resident_ids.tolist()) == {4, 5, 6}


def test_lfu_keeps_frequent_units() -> None:
    cache = make_cache("lfu", 8, 2)
    for step, used in enumerate([[0, 1], [0, 1], [0], [2], [3]]):
        run_step(cache, used, step)
    assert set(cache.resident_ids.tolist()) == {0, 1}  # one use of 2 or 3 never beats two or three


def test_density_one_is_static_after_filling() -> None:
    """Every unit every step: equal priorities never displace each other, so nothing thrashes."""
    for policy in ("lru", "lfu", "window", "atu"):
        cache = make_cache(policy, 16, 5, window=2)
        everything = list(range(16))
        run_step(cache, everything, 0)
        filled = cache.slot_ids.clone()
        for step in range(1, 10):
            hits, misses, evictions = run_step(cache, everything, step)
            assert (hits, misses, evictions) == (5, 11, 0), policy
            assert torch.equal(cache.slot_ids, filled), policy


def test_window_expires_units_without_pressure() -> None:
    window = 3
    cache = make_cache("window", 10, 10, window=window)
    run_step(cache, [0, 1], 0)
    for step in range(1, window):
        run_step(cache, [5], step)
        assert {0, 1} <= set(cache.resident_ids.tolist())
    assert run_step(cache, [5], window)[2] == 2  # last used at step 0: out of the window at step 3
    assert set(cache.resident_ids.tolist()) == {5}
    run_step(cache, [6], window + 1)
    assert set(cache.resident_ids.tolist()) == {5, 6}  # 5 used at steps 1..3: still inside


def test_atu_keeps_exactly_the_units_the_last_step_used() -> None:
    """M2Cache §5.3: after each step ATU holds the units that step used (when they fit), nothing older."""
    steps = [[0, 1, 2], [1, 2, 3], [7], [0, 7, 8, 9], [], [4, 5]]
    cache = make_cache("atu", 10, 4)
    for step, used in enumerate(steps):
        run_step(cache, used, step)
        assert set(cache.resident_ids.tolist()) == set(used), step
    # More units than slots: the step's hits stay, free slots take the lowest missed ids.
    run_step(cache, [4, 5, 6, 7, 8, 9], len(steps))
    assert set(cache.resident_ids.tolist()) == {4, 5, 6, 7}


def test_atu_misses_a_unit_skipped_for_one_step_where_lru_hits() -> None:
    steps = [[0, 1], [2], [0]]
    lru, atu = make_cache("lru", 4, 3), make_cache("atu", 4, 3)
    for step, used in enumerate(steps[:-1]):
        run_step(lru, used, step)
        run_step(atu, used, step)
    assert run_step(lru, steps[-1], 2)[:2] == (1, 0)  # LRU kept 0 through the step that skipped it
    assert run_step(atu, steps[-1], 2)[:2] == (0, 1)  # ATU let it go at that step


def test_swap_delete_moves_last_rows_into_holes() -> None:
    """Expiring the front slots fills them from the tail (LLM in a flash, Fig. 6)."""
    cache = make_cache("window", 10, 10, window=1)
    run_step(cache, [0, 1, 2, 3, 4, 5], 0)
    run_step(cache, [2, 3, 4, 5], 1)  # 0 and 1 expire: slots 0 and 1 take units 4 and 5
    assert cache.slot_ids[: cache.size].tolist() == [4, 5, 2, 3]
    assert cache.rows[:4, 0].tolist() == [4.0, 5.0, 2.0, 3.0]


def test_capacity_zero_misses_everything() -> None:
    for policy in ("lru", "lfu", "window", "atu"):
        cache = make_cache(policy, 6, 0)
        for step in range(3):
            assert run_step(cache, [1, 2, 3], step) == (0, 3, 0)
        assert cache.size == 0
        assert cache.rows.shape == (0, WIDTH)
        # The policy's state serves ranking (never done without a slot to give) and expiry: only the
        # expiring policies record.
        recorded = cache.policy.priority(torch.tensor([1])).item() != -1
        assert recorded == cache.policy.EXPIRES, policy


@pytest.mark.parametrize("path", ADMISSIONS)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_cache_that_never_ranks_records_nothing(policy: str, path: str) -> None:
    """A slot for every unit (or every slot pinned): admission never ranks, so the step's record is
    skipped, and a step with no miss does nothing at all."""
    with admission(path):
        for capacity, pinned in ((6, 0), (3, 3)):
            cache = make_cache(policy, 6, capacity)
            if pinned:
                cache.pin(torch.arange(pinned), unit_rows(torch.arange(6), cache))
            for step in range(3):
                run_step(cache, [1, 2, 4], step)
            assert cache.policy.priority(torch.arange(6)).tolist() == [-1] * 6
            assert cache.resident_ids.tolist() == ([1, 2, 4] if pinned == 0 else [0, 1, 2])
        ranking = make_cache(policy, 6, 5)
        run_step(ranking, [1, 2, 4], 0)
        assert ranking.policy.priority(torch.tensor([1])).item() != -1


def test_clear_and_reset_counters() -> None:
    cache = make_cache("lfu", 8, 4)
    run_step(cache, [1, 2, 3], 0)
    cache.clear()
    check_invariants(cache)
    assert cache.size == 0
    assert int(cache.policy.count.sum()) == 0
    assert cache.misses == 3
    cache.reset_counters()
    assert (cache.hits, cache.misses, cache.evictions) == (0, 0, 0)
    assert run_step(cache, [1], 1) == (0, 1, 0)


def test_rows_are_preallocated_once() -> None:
    cache = make_cache("lru", 32, 8)
    pointer = cache.rows.data_ptr()
    rng = random.Random(0)
    for step, used in enumerate(random_trace(rng, 32, 30)):
        run_step(cache, used, step)
    assert cache.rows.data_ptr() == pointer


# ---- pinned units (the hot set) ------------------------------------------------------------


@pytest.mark.parametrize("path", ADMISSIONS)
@pytest.mark.parametrize("policy", ["lru", "lfu", "window", "atu"])
@pytest.mark.parametrize("seed", range(6))
def test_pinned_units_stay_and_the_rest_is_a_smaller_cache(policy: str, seed: int, path: str) -> None:
    """A cache of capacity C with the units P pinned holds P always, and beside them exactly what a
    cache of C - |P| slots holds when fed the requests without P (the policy never ranks P)."""
    with admission(path):
        check_pinned_units_stay(policy, random.Random(seed))


def check_pinned_units_stay(policy: str, rng: random.Random) -> None:
    num_units, capacity = 24, 12
    pinned = torch.tensor(sorted(rng.sample(range(num_units), rng.randrange(1, capacity + 1))))
    cache = make_cache(policy, num_units, capacity)
    cache.pin(pinned, unit_rows(torch.arange(num_units), cache))
    check_invariants(cache)
    assert cache.pinned == pinned.numel() and torch.equal(cache.slot_ids[: cache.pinned], pinned)
    rest = make_cache(policy, num_units, capacity - pinned.numel())
    pinned_set = set(pinned.tolist())
    for step, used in enumerate(random_trace(rng, num_units, 40)):
        hits, misses, evictions = run_step(cache, used, step)
        others = [u for u in used if u not in pinned_set]
        rest_hits, rest_misses, rest_evictions = run_step(rest, others, step)
        assert (hits - (len(used) - len(others)), misses, evictions) == (
            rest_hits,
            rest_misses,
            rest_evictions,
        )
        assert set(cache.resident_ids.tolist()) == pinned_set | set(rest.resident_ids.tolist()), (
            f"step {step}"
        )
        assert torch.equal(cache.slot_ids[: cache.pinned], pinned)


def test_pin_checks_capacity_and_clear_unpins() -> None:
    cache = make_cache("lfu", 8, 3)
    rows = unit_rows(torch.arange(8), cache)
    with pytest.raises(ConfigError, match="Cannot pin 4 units in a cache of 3 slots"):
        cache.pin(torch.tensor([0, 1, 2, 3]), rows)
    cache.pin(torch.tensor([1, 5, 6]), rows)
    run_step(cache, [0, 2, 3], 0)  # every slot pinned: nothing else is admitted
    assert cache.resident_ids.tolist() == [1, 5, 6]
    cache.clear()
    assert (cache.size, cache.pinned) == (0, 0)
    run_step(cache, [0, 2, 3], 1)
    assert sorted(cache.resident_ids.tolist()) == [0, 2, 3]


# ---- policy construction --------------------------------------------------------------------


def test_unknown_policy_names_the_available_ones() -> None:
    with pytest.raises(ConfigError, match=r"Available eviction policies: .*lfu, lru, window"):
        make_policy("belady-ish", 4)
    with pytest.raises(ConfigError):
        policy_state_bytes("nope", 4)
    with pytest.raises(ConfigError, match="window"):
        make_policy("lru", 4, window=3)
    with pytest.raises(ConfigError):
        make_policy("window", 4, window=0)
    with pytest.raises(ConfigError, match="atu"):
        make_policy("atu", 4, window=2)  # ATU's window is one token, not an option


def test_registry_and_state_bytes_agree_with_allocation() -> None:
    # FlashConfig accepts exactly the registered live policies and NO_CACHE (the cache at capacity 0);
    # an offline one (it needs a trace's future) is refused, naming where it runs.
    for name in (*available_policies(), NO_CACHE):
        if name != NO_CACHE and POLICIES[name].OFFLINE:
            with pytest.raises(ConfigError, match="offline replay"):
                FlashConfig(policy=name)
        else:
            assert FlashConfig(policy=name).policy == name
    assert [name for name in available_policies() if POLICIES[name].OFFLINE] == ["belady"]
    with pytest.raises(ConfigError, match="atu, belady, lfu, lru, window, none"):
        FlashConfig(policy="fifo")
    for name in available_policies():
        policy = make_policy(name, 37)
        assert isinstance(policy, EvictionPolicy)
        assert sum(b.numel() * b.element_size() for b in policy.buffers()) == policy_state_bytes(name, 37)


def test_cache_rejects_inconsistent_arguments() -> None:
    with pytest.raises(ConfigError):
        NeuronCache(4, 5, WIDTH, torch.float32, make_policy("lru", 4))
    with pytest.raises(ConfigError):
        NeuronCache(4, 2, WIDTH, torch.float32, make_policy("lru", 5))


# ---- module behaviour -----------------------------------------------------------------------


def test_to_moves_buffers_and_state_dict_skips_them() -> None:
    holder = nn.Module()
    holder.cache = make_cache("lfu", 12, 4, dtype=torch.float16)
    run_step(holder.cache, [1, 2, 3], 0)
    assert holder.state_dict() == {}

    holder.to(torch.float32)
    cache = holder.cache
    assert cache.rows.dtype == torch.float32
    assert cache.slot_ids.dtype == cache.slot_of.dtype == cache.policy.count.dtype == torch.int64
    holder.to("cpu")
    check_invariants(cache)
    assert run_step(cache, [1, 2, 5, 6], 1) == (2, 2, 1)


@pytest.mark.gpu
def test_cache_runs_on_cuda() -> None:
    cache = make_cache("window", 40, 10).to("cuda")
    assert cache.policy.last_step.is_cuda and cache.rows.is_cuda
    reference = ReferenceCache("window", 10, 2)
    for step, used in enumerate(random_trace(random.Random(1), 40, 20)):
        ids = torch.tensor(used, device="cuda")
        _, _, miss_ids = cache.lookup(ids)
        cache.update(ids, miss_ids, miss_ids[:, None].float().expand(-1, WIDTH), step)
        reference.step(used, step)
        assert set(cache.resident_ids.tolist()) == reference.resident


# ---- budget ---------------------------------------------------------------------------------


def measured_bytes(caches: list[NeuronCache]) -> int:
    """Every byte the caches really allocated: rows, indices and policy state."""
    return sum(b.numel() * b.element_size() for cache in caches for b in cache.buffers())


def build_caches(plan: BudgetPlan, widths, num_units, dtype, policy: str) -> list[NeuronCache]:
    return [
        NeuronCache(n, cap, w, dtype, make_policy(policy, n))
        for n, cap, w in zip(num_units, plan.capacities, widths, strict=True)
    ]


@settings(max_examples=200, deadline=None)
@given(
    layers=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    policy=st.sampled_from(["lru", "lfu", "window"]),
    overhead=st.integers(0, 5000),
    extra=st.integers(0, 200_000),
    costs=st.lists(st.sampled_from([1.0, 1.33, 3.6]), min_size=6, max_size=6),
    profile_seed=st.one_of(st.none(), st.integers(0, 2**16)),
)
def test_budget_is_never_exceeded(
    layers, dtype, policy: str, overhead: int, extra: int, costs, profile_seed
) -> None:
    num_units = [n for n, _ in layers]
    widths = [w for _, w in layers]
    unit_bytes = [w * torch.empty((), dtype=dtype).element_size() for w in widths]
    minimum = overhead + sum(NeuronCache.fixed_bytes(n, policy) for n in num_units)
    budget = minimum + extra

    plan = split_budget(
        budget,
        unit_bytes=unit_bytes,
        num_units=num_units,
        overhead_bytes=overhead,
        policy=policy,
        read_cost=costs[: len(layers)],
        # a unit profile's values: some units never used, the others at random rates
        unit_values=None
        if profile_seed is None
        else [
            torch.rand(n, generator=torch.Generator().manual_seed(profile_seed + i)).sub(0.3).clamp(min=0)
            for i, n in enumerate(num_units)
        ],
    )
    caches = build_caches(plan, widths, num_units, dtype, policy)

    measured = measured_bytes(caches)
    assert measured == plan.cache_bytes + plan.index_bytes
    assert measured + overhead == plan.total_bytes <= budget
    assert sum(c.nbytes + sum(b.nbytes for b in c.policy.buffers()) for c in caches) == measured
    # Nothing wasted: no layer with room could take one more slot.
    for cap, n, u in zip(plan.capacities, num_units, unit_bytes, strict=True):
        assert 0 <= cap <= n
        assert cap == n or NeuronCache.slot_bytes(u) > budget - plan.total_bytes


def test_budget_split_is_proportional_to_layer_size() -> None:
    plan = split_budget(
        30_000 + 2 * NeuronCache.fixed_bytes(1000, "lru"),
        unit_bytes=[92, 192],
        num_units=[1000, 1000],
        overhead_bytes=0,
    )
    small, large = plan.capacities
    assert small == large == 100  # each layer caches the same fraction of itself: 10%
    capped = split_budget(10**9, unit_bytes=[8, 8], num_units=[5, 7], overhead_bytes=100)
    assert capped.capacities == [5, 7]


def test_budget_fills_the_costliest_misses_first() -> None:
    """Caches whose misses cost the disk more per byte fill up before cheaper ones get a slot."""
    num_units, unit_bytes = [100, 100, 50, 50], [64, 64, 1152, 1152]
    fixed = sum(NeuronCache.fixed_bytes(n, "lfu") for n in num_units)
    slots = [NeuronCache.slot_bytes(u) for u in unit_bytes]
    # Room for both costly caches whole and a quarter of the cheap ones.
    budget = fixed + 50 * slots[2] * 2 + 25 * slots[0] * 2
    plan = split_budget(
        budget,
        unit_bytes=unit_bytes,
        num_units=num_units,
        overhead_bytes=0,
        policy="lfu",
        read_cost=[1.0, 1.0, 3.6, 3.6],
    )
    assert plan.capacities == [25, 25, 50, 50]
    by_size = split_budget(budget, unit_bytes=unit_bytes, num_units=num_units, overhead_bytes=0, policy="lfu")
    assert by_size.capacities[2] < 50 and by_size.capacities[0] > 25
    with pytest.raises(ConfigError, match="read_cost"):
        split_budget(budget, unit_bytes=unit_bytes, num_units=num_units, overhead_bytes=0, read_cost=[1.0])


def test_budget_follows_a_unit_profile() -> None:
    """With unit values (a unit profile's disk bytes saved), slots go to the units of most value per slot
    byte, whatever their cache; what has no value is then shared by size."""
    num_units, unit_bytes = [100, 100], [64, 128]
    fixed = sum(NeuronCache.fixed_bytes(n, "lfu") for n in num_units)
    slots = [NeuronCache.slot_bytes(u) for u in unit_bytes]
    # cache 0: 40 units used every token, 60 never; cache 1: every unit a tenth of the tokens
    values = [64 * torch.cat([torch.ones(40), torch.zeros(60)]), 128 * torch.full((100,), 0.1)]

    def plan(budget: int):
        return split_budget(
            budget,
            unit_bytes=unit_bytes,
            num_units=num_units,
            overhead_bytes=0,
            policy="lfu",
            unit_values=values,
        )

    assert plan(fixed + 40 * slots[0] + 30 * slots[1]).capacities == [40, 30]
    assert plan(fixed + 20 * slots[0]).capacities == [20, 0]
    # every used unit fits: the rest of the budget goes by size, here to cache 0's unused units
    roomy = plan(fixed + 70 * slots[0] + 100 * slots[1])
    assert roomy.capacities == [70, 100] and roomy.total_bytes <= fixed + 70 * slots[0] + 100 * slots[1]
    with pytest.raises(ConfigError, match="unit_values"):
        split_budget(
            10**6, unit_bytes=unit_bytes, num_units=num_units, overhead_bytes=0, unit_values=[torch.ones(3)]
        )


def test_too_small_budget_names_the_minimum() -> None:
    num_units, overhead = [100, 50], 4096
    minimum = overhead + sum(NeuronCache.fixed_bytes(n, "lru") for n in num_units)
    assert split_budget(
        minimum, unit_bytes=[64, 64], num_units=num_units, overhead_bytes=overhead
    ).capacities == [
        0,
        0,
    ]
    for budget in (minimum - 1, overhead - 1, 0):
        with pytest.raises(BudgetTooSmallError) as info:
            split_budget(budget, unit_bytes=[64, 64], num_units=num_units, overhead_bytes=overhead)
        message = str(info.value)
        assert str(minimum) in message
        assert format_bytes(minimum) in message
        assert "memory_budget" in message


def test_budget_rejects_inconsistent_arguments() -> None:
    with pytest.raises(ConfigError):
        split_budget(1000, unit_bytes=[8], num_units=[1, 2], overhead_bytes=0)
    with pytest.raises(ConfigError):
        split_budget(1000, unit_bytes=[0], num_units=[1], overhead_bytes=0)
    with pytest.raises(ConfigError, match="lru"):
        split_budget(1000, unit_bytes=[8], num_units=[1], overhead_bytes=0, policy="fifo")


@pytest.mark.parametrize("seed", range(8))
def test_missing_in_c_is_the_torch_expression(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`missing` (C where a compiler is found) returns `ids[slot_of[ids] < 0]`, in order, uncounted."""
    from flashlm.cache import neuron_cache

    generator = torch.Generator().manual_seed(seed)
    cache = NeuronCache(200, 120, WIDTH, torch.float32, make_policy("lfu", 200))
    ids = torch.randperm(200, generator=generator)[:120].sort().values
    cache.update(ids, ids, torch.randn(200, WIDTH, generator=generator), step=0, by_unit=True)
    asked = torch.randperm(200, generator=generator)[: 1 + seed * 20].sort().values
    expected = asked[cache.slot_of[asked] < 0]
    assert torch.equal(cache.missing(asked), expected)
    assert torch.equal(cache.missing(asked[:0]), expected[:0])
    assert (cache.hits, cache.misses) == (0, 0)
    monkeypatch.setattr(neuron_cache, "_native_missing", lambda: None)
    assert torch.equal(cache.missing(asked), expected)


def test_a_cache_of_every_unit_looks_nothing_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache holding its whole layer has no misses and only counts its hits."""
    from flashlm.cache import neuron_cache

    cache = NeuronCache(50, 50, WIDTH, torch.float32, make_policy("lfu", 50))
    every = torch.arange(50)
    cache.update(every, every, torch.randn(50, WIDTH), step=0, by_unit=True)
    monkeypatch.setattr(neuron_cache, "_native_missing", lambda: pytest.fail("looked up"))
    monkeypatch.setattr(cache, "slot_of", None)  # the torch expression would fail too
    asked = torch.tensor([0, 7, 49])
    assert cache.find_misses(asked).numel() == 0
    assert (cache.hits, cache.misses) == (3, 0)


def test_missing_rejects_ids_outside_the_layer() -> None:
    cache = NeuronCache(10, 4, WIDTH, torch.float32, make_policy("lru", 10))
    with pytest.raises(IndexError):
        cache.missing(torch.tensor([3, 10]))


@pytest.mark.parametrize("path", ADMISSIONS)
def test_update_rejects_misses_without_rows_and_ids_outside_the_layer(path: str) -> None:
    """A miss whose row is not among those given, or a unit id outside the layer, is an IndexError; in C
    the cache and its policy are left as they were."""
    with admission(path):
        cache = make_cache("lfu", 10, 4)
        run_step(cache, [1, 2], 0)
        before = (
            cache.slot_ids.clone(),
            cache.rows.clone(),
            cache.policy.priority(torch.arange(10)),
            cache.size,
        )
        ids = torch.tensor([1, 5, 6])
        misses = torch.tensor([5, 6])
        with pytest.raises(IndexError):  # rows for unit 5 only
            cache.update(ids, misses, unit_rows(misses[:1], cache), 1)
        with pytest.raises(IndexError):  # by unit: a staging matrix of 6 rows has no row for unit 6
            cache.update(ids, misses, unit_rows(torch.arange(6), cache), 1, by_unit=True)
        with pytest.raises(IndexError):
            cache.update(torch.tensor([1, 10]), torch.tensor([10]), unit_rows(torch.arange(11), cache), 1)
        if path == "native":
            after = (cache.slot_ids, cache.rows, cache.policy.priority(torch.arange(10)), cache.size)
            assert all(torch.equal(a, b) for a, b in zip(before[:3], after[:3], strict=True))
            assert before[3] == after[3]


def test_native_update_follows_buffers_that_to_replaces() -> None:
    """The C update's standing arguments (buffer pointers) are rebuilt when `.to()` or an assignment
    replaces the cache's or its policy's buffers: the update then writes the new ones."""
    with admission("native"):
        cache = make_cache("lfu", 10, 4)
        run_step(cache, [1, 2], 0)
        cache.to(torch.float64)  # new rows
        run_step(cache, [1, 2, 3, 4, 5], 1)  # 5 displaces nobody: a full cache of equals
        assert cache.rows.dtype == torch.float64
        cache.policy.last_step = cache.policy.last_step.clone()
        run_step(cache, [3, 6], 2)
        assert cache.policy.last_step[6].item() == 2 and cache.policy.count[6].item() == 1
