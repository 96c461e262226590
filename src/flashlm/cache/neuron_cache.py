"""`NeuronCache`: one layer's resident units in a preallocated matrix (LLM in a flash §3.3, Fig. 6).

The rows live in a `[capacity, width]` matrix allocated once. Occupied slots are always
`0 .. size-1`, so compute can use `rows[:size]` (with `slot_ids[:size]` naming the units) without
gathering. A unit that leaves is replaced by the last occupied row (swap-delete: one row moved per
deletion, never a reallocation or a shift); a unit that enters is appended at `size`, or, when the
cache is full, written straight into the slot of the resident it displaces.

Which units stay is the policy's call (`policies.py`); the cache applies one admission rule: free
slots are filled first, then a candidate displaces the lowest-priority resident only while its
priority is *strictly* greater. Equal priorities never churn, so when every unit is needed every
step (density 1.0) a full cache stays as it is instead of thrashing.

Units can be pinned (`pin`: PowerInfer's hot set, chosen offline from a unit profile, or the block of a
kind read ahead whole, `read_ahead_block`). Pinned units occupy slots `0 .. pinned-1`; the policy never
ranks them, so they are never displaced or expired, and the rest of the cache follows the policy in the
remaining slots.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .._native import load_library
from ..errors import ConfigError
from .policies import EvictionPolicy, PriorityTerms, policy_state_bytes

INDEX_DTYPE = torch.int64
INDEX_ITEMSIZE = torch.empty((), dtype=INDEX_DTYPE).element_size()


def read_ahead_block(capacity: int, num_units: int) -> torch.Tensor | None:
    """The units a cache of `capacity` slots pins for a kind read ahead whole: the block `0 .. capacity-1`
    (None for a cache of no slots or of every unit).

    Such a kind reads every unit not resident at every step, and the reader reads across gaps shorter
    than its merge gap, so residents scattered as a policy keeps them save few bytes and cost an update
    every step; a block is skipped whole and never changes."""
    return torch.arange(capacity) if 0 < capacity < num_units else None


@functools.cache
def _native_missing() -> Callable[..., int] | None:
    """`flashlm_missing` of `_lookup.c` (called with the GIL held), or None without a C compiler."""
    library = load_library(Path(__file__).with_name("_lookup.c"), "lookup", hold_gil=True)
    if library is None:
        return None
    function = library.flashlm_missing
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    function.restype = ctypes.c_int64
    return function


@dataclass(frozen=True)
class _NativeUpdate:
    """`flashlm_update` of `_lookup.c`, called with the GIL held (an update that copies little: handing
    the GIL over and taking it back would cost more) or released (one that copies much, on the I/O thread:
    the decode thread runs Python meanwhile)."""

    holding_gil: Callable[..., int]
    releasing_gil: Callable[..., int]


@functools.cache
def _native_update() -> _NativeUpdate | None:
    """The C update, for the policies with `priority_terms`; None without a C compiler."""
    functions = []
    for hold_gil in (True, False):
        library = load_library(Path(__file__).with_name("_lookup.c"), "lookup", hold_gil=hold_gil)
        if library is None:
            return None
        pointer, integer = ctypes.c_void_p, ctypes.c_int64
        function = library.flashlm_update
        function.argtypes = (
            [pointer] * 7 + [integer, pointer, integer, integer, pointer, integer, integer, pointer, integer]
        ) + [pointer] * 3
        function.restype = integer
        functions.append(function)
    return _NativeUpdate(*functions)


class _NativeArguments:
    """`flashlm_update`'s arguments that change only with the cache's buffers or its policy: built once,
    since each module attribute lookup and ctypes conversion costs a microsecond, per layer per step.
    `serves` tells whether the cache's and its policy's buffers are still those (`.to()` replaces them)."""

    def __init__(self, cache: NeuronCache, functions: _NativeUpdate, terms: PriorityTerms) -> None:
        self.functions = functions
        self.buffers = (cache.rows, cache.slot_ids, cache.slot_of)
        self.policy = cache.policy
        self.policy_buffers = tuple(cache.policy._buffers.values())
        self.dtype = cache.rows.dtype
        itemsize = cache.rows.element_size()
        self.shape = (ctypes.c_int64 * 7)(
            cache.num_units,
            cache.capacity,
            cache.pinned,
            cache.size,
            terms.window,
            cache.rows.stride(0) * itemsize,
            cache.width * itemsize,
        )
        self.info = (ctypes.c_int64 * 3)()
        """{units that left, the new size, whether the cache holds the unit prefix}"""
        self.pointers = (
            cache.slot_of.data_ptr(),
            cache.slot_ids.data_ptr(),
            None if terms.count is None else terms.count.data_ptr(),
            terms.last_step.data_ptr(),
            self.shape,
            cache.rows.data_ptr(),
        )

    def serves(self, cache: NeuronCache) -> bool:
        buffers, policy = cache._buffers, cache._modules["policy"]
        policy_buffers = policy._buffers.values()
        return (
            buffers["rows"] is self.buffers[0]
            and buffers["slot_ids"] is self.buffers[1]
            and buffers["slot_of"] is self.buffers[2]
            and policy is self.policy
            and len(policy_buffers) == len(self.policy_buffers)
            and all(now is then for now, then in zip(policy_buffers, self.policy_buffers, strict=True))
        )


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class NeuronCache(nn.Module):
    """The resident units of one layer and one unit kind.

    Args:
        num_units: units of the layer (ids are `0 .. num_units-1`).
        capacity: slots (0 disables the cache: every lookup misses).
        width: elements per unit row.
        dtype: element type of the rows.
        policy: eviction policy for `num_units` units (a submodule: `.to()` moves its state).
        device: where the rows and indices live. Unit ids given to the cache may be on any device; those
            it returns are on its own.

    Buffers (non-persistent: moved by `.to()`, absent from `state_dict()`):
        rows: `[capacity, width]` unit rows; slots `0 .. size-1` are occupied.
        slot_ids: `[capacity]` unit in each slot, -1 where free.
        slot_of: `[num_units]` slot of each unit, -1 where not resident (the residency mask).

    Counters (python ints in `counters`, since the last `reset_counters`; also readable as
    attributes): `hits` and `misses` from `lookup`, and
    `evictions` (units that left: displaced or expired). They live in a plain object because
    assigning to a module attribute costs a microsecond or two, every layer, every step.
    """

    rows: torch.Tensor
    slot_ids: torch.Tensor
    slot_of: torch.Tensor

    def __init__(
        self,
        num_units: int,
        capacity: int,
        width: int,
        dtype: torch.dtype,
        policy: EvictionPolicy,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if num_units < 0 or width < 0:
            raise ConfigError(f"num_units and width must be non-negative, got {num_units} and {width}.")
        if not 0 <= capacity <= num_units:
            raise ConfigError(f"capacity must be between 0 and num_units={num_units}, got {capacity}.")
        if policy.num_units != num_units:
            raise ConfigError(f"The policy tracks {policy.num_units} units but the cache has {num_units}.")
        self.num_units = num_units
        self.capacity = capacity
        self.width = width
        self.policy = policy if device is None else policy.to(device)
        self.register_buffer(
            "rows", torch.zeros(capacity, width, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "slot_ids", torch.full((capacity,), -1, dtype=INDEX_DTYPE, device=device), persistent=False
        )
        self.register_buffer(
            "slot_of", torch.full((num_units,), -1, dtype=INDEX_DTYPE, device=device), persistent=False
        )
        self.size = 0
        self.pinned = 0
        """Slots `0 .. pinned-1` hold the pinned units (`pin`), which never leave."""
        self._unit_prefix = True
        self._native_arguments: _NativeArguments | None = None
        self.reset_counters()

    # ---- accounting -------------------------------------------------------------------------
    # The budget plan sizes caches with these two functions; `nbytes` measures the real buffers.

    @staticmethod
    def slot_bytes(unit_bytes: int) -> int:
        """Bytes one slot costs: its row plus its `slot_ids` entry."""
        return unit_bytes + INDEX_ITEMSIZE

    @staticmethod
    def fixed_bytes(num_units: int, policy: str) -> int:
        """Bytes a cache costs whatever its capacity: `slot_of` and the policy's state."""
        return num_units * INDEX_ITEMSIZE + policy_state_bytes(policy, num_units)

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot's row (the dtype the cache holds, which may differ from the store's)."""
        return self.width * self.rows.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes this cache's own buffers hold: rows, `slot_ids`, `slot_of` (not the policy's state)."""
        return sum(t.numel() * t.element_size() for t in (self.rows, self.slot_ids, self.slot_of))

    # ---- counters ---------------------------------------------------------------------------

    def reset_counters(self) -> None:
        """Zero hits, misses and evictions."""
        self.counters = CacheCounters()

    @property
    def hits(self) -> int:
        return self.counters.hits

    @property
    def misses(self) -> int:
        return self.counters.misses

    @property
    def evictions(self) -> int:
        return self.counters.evictions

    # ---- queries ----------------------------------------------------------------------------

    @property
    def admits(self) -> bool:
        """Whether a step's misses can enter: some slot is not pinned."""
        return self.pinned < self.capacity

    @property
    def resident_ids(self) -> torch.Tensor:
        """Units now resident, in slot order (a view: `rows[:size]` holds their rows)."""
        return self.slot_ids[: self.size]

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the sorted unique unit ids `ids` into hits (with their slots) and misses.

        Returns `(hit_ids, hit_slots, miss_ids)`, each in the order of `ids`, on the cache's device;
        counts hits and misses.
        """
        ids = ids.to(self.slot_of.device)
        slots = self.slot_of[ids]
        hit = slots >= 0
        hit_ids, hit_slots, miss_ids = ids[hit], slots[hit], ids[~hit]
        self.count(hit_ids.numel(), miss_ids.numel())
        return hit_ids, hit_slots, miss_ids

    def find_misses(self, ids: torch.Tensor) -> torch.Tensor:
        """The units of the sorted unique `ids` that are not resident (in order); counts hits and misses."""
        miss_ids = self.missing(ids)
        self.count(ids.shape[0] - miss_ids.shape[0], miss_ids.shape[0])
        return miss_ids

    def missing(self, ids: torch.Tensor) -> torch.Tensor:
        """The units of `ids` that are not resident, in the order of `ids` (not counted), on the cache's
        device. On the CPU, one call to C (`_lookup.c`) where a compiler is found; none at all while
        every unit is resident."""
        if self.size == self.num_units:
            return ids[:0].to(self.slot_ids.device)
        native, slot_of = _native_missing(), self.slot_of
        if ids.device != slot_of.device:  # a no-op `.to` still costs an operator call
            ids = ids.to(slot_of.device)
        if native is None or not slot_of.is_cpu or ids.dtype != INDEX_DTYPE or ids.dim() != 1:
            return ids[slot_of[ids] < 0]
        if not ids.is_contiguous():
            ids = ids.contiguous()
        n = ids.shape[0]
        out = torch.empty(n, dtype=INDEX_DTYPE)
        count = native(slot_of.data_ptr(), self.num_units, ids.data_ptr(), n, out.data_ptr())
        if count < 0:
            raise IndexError(f"unit ids must lie in [0, {self.num_units}), got {ids.min()}..{ids.max()}.")
        return out[:count]

    def count(self, hits: int, misses: int) -> None:
        """Add to the hit and miss counters (for callers that know them without a lookup)."""
        self.counters.hits += hits
        self.counters.misses += misses

    @property
    def holds_unit_prefix(self) -> bool:
        """Whether slot s holds unit s for every occupied slot: `rows[:size]` is the layer's matrix
        of units `0 .. size-1`, in unit order (how a cache that every step reads whole fills up)."""
        return self._unit_prefix

    # ---- changes ----------------------------------------------------------------------------

    def update(
        self,
        used_ids: torch.Tensor,
        miss_ids: torch.Tensor,
        miss_rows: torch.Tensor,
        step: int,
        *,
        row_ids: torch.Tensor | None = None,
        by_unit: bool = False,
        release_gil: bool = False,
    ) -> None:
        """End decode step `step`: record what it used, drop expired units, admit the misses it read.

        `used_ids` are all units the step needed (hits and misses); `miss_rows[i]` is the row of
        `miss_ids[i]`; with `row_ids` (sorted, a superset of `miss_ids`: a read of more than the
        misses), of `row_ids[i]`; with `by_unit`, `miss_rows[u]` is the row of unit `u` (a staging
        matrix read in place). Which misses are kept, and whom they displace, follows the admission
        rule in the module docstring. `release_gil` lets other Python threads run while the C update
        copies rows (an update queued on the I/O thread).
        """
        # The policy's state is read only to rank residents against candidates, which a cache with a slot
        # for every unit (or none to give) never does, and to expire units.
        records = (self.admits and self.capacity < self.num_units) or self.policy.EXPIRES
        if not records and (miss_ids.shape[0] == 0 or not self.admits):
            return  # nothing to record, nor to admit (a cache all pinned never changes)
        row_ids = None if by_unit else miss_ids if row_ids is None else row_ids
        arguments = self._native_update_arguments()
        native = arguments is not None and used_ids.is_cpu and miss_ids.is_cpu
        if native and used_ids.dtype == miss_ids.dtype == INDEX_DTYPE:
            used_ids = used_ids if records else None
            self._update_natively(arguments, used_ids, miss_ids, miss_rows, row_ids, step, release_gil)
            return
        device = self.slot_of.device
        if used_ids.device != device or miss_ids.device != device:  # a no-op `.to` still costs an operator
            used_ids, miss_ids = used_ids.to(device), miss_ids.to(device)
        if records:
            self.policy.record(used_ids, step)
        if self.size > self.pinned and self.policy.EXPIRES:
            self._delete(self.policy.expired(self.resident_ids[self.pinned :], step))
        self._admit(miss_ids, miss_rows, row_ids)

    def clear(self) -> None:
        """Empty the cache, pinned units too, and forget the policy's history; counters stay."""
        self.slot_of.fill_(-1)
        self.slot_ids.fill_(-1)
        self.size = 0
        self.pinned = 0
        self._unit_prefix = True
        self.policy.reset()

    def pin(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Empty the cache and pin the sorted unique units `ids` (`rows[u]` is the row of unit `u`):
        they stay resident whatever the policy says, in slots `0 .. len(ids)-1`."""
        if ids.numel() > self.capacity:
            raise ConfigError(f"Cannot pin {ids.numel()} units in a cache of {self.capacity} slots.")
        self.clear()
        self._append(ids.to(self.slot_of.device), rows, None)
        self.pinned = ids.numel()

    def _admit(self, ids: torch.Tensor, rows: torch.Tensor, row_ids: torch.Tensor | None) -> None:
        """Admit the non-resident units among the sorted `ids`: free slots first, then displace weaker
        residents. `rows[i]` is the row of unit `row_ids[i]`, or of unit `i` with `row_ids` None.

        Cheap paths first: candidates that all fit go into the free slots in unit order (no ranking);
        a full cache whose best candidate is no better than its weakest resident changes nothing (two
        reductions). Otherwise one stable sort of residents and candidates decides who stays.
        """
        if self.capacity == self.pinned or ids.numel() == 0:
            return
        fresh = self.missing(ids.to(self.slot_of.device))
        free = self.capacity - self.size
        if fresh.numel() <= free:
            self._append(fresh, rows, row_ids)
            return
        unpinned = self.resident_ids[self.pinned :]
        weakest_resident = self.policy.priority(unpinned).min() if free == 0 else None
        if weakest_resident is not None and self.policy.priority(fresh).max() <= weakest_resident:
            return
        # Rank the unpinned residents and the candidates by priority in one stable sort. Ties keep their
        # order in the union: residents first (a candidate must be strictly better), residents by
        # descending id (the lowest id leaves first), then candidates by ascending id (the lowest id
        # enters first).
        residents = torch.nonzero(self.slot_of >= self.pinned).squeeze(1).flip(0)
        union = torch.cat([residents, fresh])
        order = torch.sort(self.policy.priority(union), descending=True, stable=True).indices
        room = self.capacity - self.pinned
        staying, leaving = order[:room], order[room:]
        entering = union[staying[staying >= residents.numel()]]
        evicted = union[leaving[leaving < residents.numel()]]
        if evicted.numel():
            slots = self.slot_of[evicted]
            self.slot_of[evicted] = -1
            self._place(slots, entering[: evicted.numel()], rows, row_ids)
            self.counters.evictions += evicted.numel()
            self._unit_prefix = False
        self._append(entering[evicted.numel() :], rows, row_ids)

    def _native_update_arguments(self) -> _NativeArguments | None:
        """The C update's standing arguments for this cache (built again after `.to()`), or None where
        it does not serve: no compiler, a cache off the CPU, a policy without `priority_terms`."""
        native = _native_update()
        if native is None:
            return None
        arguments = self._native_arguments
        if arguments is not None and arguments.serves(self):
            return arguments
        terms = self.policy.priority_terms()
        serves = terms is not None and self.slot_of.is_cpu
        self._native_arguments = _NativeArguments(self, native, terms) if serves else None
        return self._native_arguments

    def _update_natively(
        self,
        arguments: _NativeArguments,
        used_ids: torch.Tensor | None,
        miss_ids: torch.Tensor,
        rows: torch.Tensor,
        row_ids: torch.Tensor | None,
        step: int,
        release_gil: bool,
    ) -> None:
        """`update` in one call to C (`flashlm_update`: the policy's record (of `used_ids`, unless None) and
        expiry, the admission rule, the index, and the entering rows where they need no conversion), with
        no torch operator: it runs on the decode thread at every layer and kind of every step, where each
        call costs several times what a micro-benchmark's loop shows (`benchmarks/cache_update.py`: ~24 µs
        per SmolLM2 `dip_in` update there, 50-110 in a decode, `per_token_path.py`)."""
        miss_ids = miss_ids.contiguous()
        if used_ids is not None:
            used_ids = used_ids.contiguous()
        if row_ids is not None:
            row_ids = row_ids.to("cpu", INDEX_DTYPE).contiguous()
        copy = rows.is_cpu and rows.dtype == arguments.dtype and rows.dim() == 2 and rows.stride(1) == 1
        copy = copy and rows.shape[1] == self.width
        placed = None if copy else torch.empty(2, self.capacity, dtype=INDEX_DTYPE)  # units entering, slots
        shape, info = arguments.shape, arguments.info
        shape[2], shape[3], info[2] = self.pinned, self.size, self._unit_prefix
        functions = arguments.functions
        entered = (functions.releasing_gil if release_gil else functions.holding_gil)(
            *arguments.pointers,
            None if used_ids is None else used_ids.data_ptr(),
            0 if used_ids is None else used_ids.shape[0],
            miss_ids.data_ptr(),
            miss_ids.shape[0],
            step,
            rows.data_ptr() if copy else None,
            rows.stride(0) * rows.element_size() if copy else 0,
            rows.shape[0] if row_ids is None else min(row_ids.shape[0], rows.shape[0]),
            None if row_ids is None else row_ids.data_ptr(),
            int(copy),
            None if placed is None else placed[0].data_ptr(),
            None if placed is None else placed[1].data_ptr(),
            info,
        )
        if entered == -1:
            ids = miss_ids if used_ids is None else torch.cat([used_ids, miss_ids])
            raise IndexError(f"unit ids must lie in [0, {self.num_units}), got {ids.min()}..{ids.max()}.")
        if entered == -2:
            raise MemoryError("The cache's update could not allocate its scratch memory.")
        if entered == -3:
            raise IndexError(f"A missed unit's row is not among the {rows.shape[0]} rows given.")
        self.counters.evictions += info[0]
        self.size, self._unit_prefix = info[1], bool(info[2])
        if placed is not None and entered:
            self._copy_rows(placed[1, :entered], placed[0, :entered], rows, row_ids)

    def _append(self, ids: torch.Tensor, rows: torch.Tensor, row_ids: torch.Tensor | None) -> None:
        """Put units `ids` (ascending) into the free slots after the occupied ones."""
        if ids.numel() == 0:
            return
        first = self.size
        slots = torch.arange(first, first + ids.numel(), device=self.slot_ids.device)
        self._place(slots, ids, rows, row_ids)
        self.size += ids.numel()
        if self._unit_prefix:
            self._unit_prefix = bool(ids[0] == first) and bool(ids[-1] == self.size - 1)

    def _place(
        self, slots: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, row_ids: torch.Tensor | None
    ) -> None:
        """Write units `ids` into `slots`, their rows gathered from `rows` (row `i` holds unit
        `row_ids[i]`, ascending), and index them. Only the rows that enter are gathered."""
        self._copy_rows(slots, ids, rows, row_ids)
        self.slot_ids[slots] = ids
        self.slot_of[ids] = slots

    def _copy_rows(
        self, slots: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, row_ids: torch.Tensor | None
    ) -> None:
        """Write the rows of units `ids` into `slots` (row `i` of `rows` holds unit `row_ids[i]`, ascending,
        or unit `i` without `row_ids`): a gather and a scatter, converted to the cache's dtype and device."""
        at = ids if row_ids is None else torch.searchsorted(row_ids.to(ids.device), ids)
        self.rows[slots] = rows[at.to(rows.device)].to(device=self.rows.device, dtype=self.rows.dtype)

    def _delete(self, doomed: torch.Tensor) -> None:
        """Remove the residents flagged in `doomed` (a mask over the unpinned slots `pinned .. size-1`)
        by swap-delete.

        Doomed slots below the new size are holes; they receive, in order, the surviving rows from
        the tail `new_size .. size-1`. Both sets have the same count, so one vectorized move keeps
        the occupied slots contiguous.
        """
        n_doomed = int(doomed.sum())
        if n_doomed == 0:
            return
        new_size = self.size - n_doomed
        kept = new_size - self.pinned  # unpinned slots left
        self.slot_of[self.resident_ids[self.pinned :][doomed]] = -1
        holes = torch.nonzero(doomed[:kept]).squeeze(1) + self.pinned
        movers = torch.nonzero(~doomed[kept:]).squeeze(1) + new_size
        self.rows[holes] = self.rows[movers]
        self.slot_ids[holes] = self.slot_ids[movers]
        self.slot_of[self.slot_ids[holes]] = holes
        self.slot_ids[new_size : self.size] = -1
        self.size = new_size
        self.counters.evictions += n_doomed
        self._unit_prefix = self._unit_prefix and holes.numel() == 0

    def extra_repr(self) -> str:
        return (
            f"num_units={self.num_units}, capacity={self.capacity}, width={self.width}, "
            f"dtype={self.rows.dtype}, size={self.size}, pinned={self.pinned}"
        )
