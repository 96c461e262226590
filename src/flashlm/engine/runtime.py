"""The runtimes: what the flashlm modules of one model share.

`Runtime` is the part every method has — the store, the config, the budget, the reader (whose C pool
reads in the background), one background I/O thread (for what the pool cannot take), the stats
recorder — and the lifecycle `flashlm.stats`, `unpatch` and the eval harness drive (`drain`,
`snapshot`, `reset_stats`, `close`). Methods read in one of two granularities: `FlashRuntime`
streams units (neuron rows and columns) through per-layer caches (dense streaming and the sparse
methods); Endor's runtime (`methods/endor.py`) reads whole compressed layers.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch

from .._utils import format_bytes
from ..cache import BudgetPlan, NeuronCache, make_policy, read_ahead_block, split_budget
from ..cache.placement import Placement, place_hot_neurons
from ..cache.policies import NO_CACHE
from ..cache.profile import UnitProfile
from ..ops import TokenColumns
from ..ops.select import TopUnits
from ..store import RowFile, Store, StoreReader
from ..store.disk import DiskProfile, disk_profile
from ..store.format import dense_kinds
from ..store.reader import InPlaceReads, PendingRead, pin_for_gpu, row_matrices
from .io_thread import IOThread
from .stats import FlashStats, StatsRecorder
from .trace import TraceRecorder

if TYPE_CHECKING:
    from pathlib import Path

    from ..config import FlashConfig

logger = logging.getLogger(__name__)


QUEUED_UPDATE_MIN_BYTES = 8 << 20
"""A decode step's cache updates for one layer that copy fewer row bytes than this run at once, on the
decode thread; larger ones go to the I/O thread (`FlashRuntime.update_caches`). A task on that thread
costs the decode thread more than its own work: each Python step of the task takes the GIL from the
decode thread, and a core the task takes stalls torch's parallel regions. On a 2-core AMD EPYC, SmolLM2's
updates (DIP at a 50% budget: a median 1.8 MB, 0.4 ms, per layer) queued there slowed its decode from
11-13 tok/s run at once to 9-10, and its attention ran 2-3x slower beside them; Qwen2.5-1.5B's (DIP-CA,
a median 26 MB per layer) ran 3% faster queued (`benchmarks/per_token_path.py`)."""


@dataclass(frozen=True)
class CacheUpdate:
    """One cache's update at the end of a decode step: the units `used_ids` the step used, `miss_ids` those
    it read into the staging matrix `rows` (by unit: `rows[u]` is unit u's row), at cache clock `step`."""

    cache: NeuronCache
    used_ids: torch.Tensor
    miss_ids: torch.Tensor
    rows: torch.Tensor
    step: int
    selection: TopUnits | None = None
    """The fused-selection buffers that `used_ids` and `miss_ids` are views of (None: tensors of their
    own): an update queued past its layer's forward holds them until it has run
    (`FlashRuntime.selection_units`)."""

    @property
    def copy_bytes(self) -> int:
        """The row bytes it may copy: its misses' rows (whether the cache admits them is its call)."""
        return self.miss_ids.shape[0] * self.cache.row_bytes

    def run(self, queued: bool) -> None:
        """Update the cache; `queued` when on the I/O thread, where it lets the decode thread run Python
        while it copies."""
        self.cache.update(
            self.used_ids, self.miss_ids, self.rows, self.step, by_unit=True, release_gil=queued
        )


@dataclass(frozen=True)
class Fetch:
    """One kind's missed units of a layer, read in place into a staging matrix: `matrix[u]` is the row
    of unit `u` for every `u` in `ids` (other rows hold whatever the read or earlier reads put there,
    always rows of this kind's files, so finite)."""

    ids: torch.Tensor
    matrix: torch.Tensor
    bytes_read: int
    reads: int
    busy_s: float

    def to(self, device: torch.device) -> Fetch:
        """This fetch with its ids and read rows on `device` (itself where they are there already):
        reads land in host memory, and a module computes where its caches are. Only the read rows
        cross (`copy_rows`: half of a dense staging matrix at a 50% budget, a sparse step's few
        percent), into a matrix of the staging shape whose other rows are zeros; where one copy of
        the whole staging matrix costs less (`crosses_whole`: scattered rows of a small matrix, or
        half of a large one), it crosses whole, its other rows as the staging matrix holds them."""
        if self.matrix.device == device:
            return self
        # A new matrix per fetch, not one persistent device copy per staging buffer: the cache update
        # queued on the I/O thread reads it later, and the I/O queue, which orders the host buffer's
        # reuse, does not order this copy (made here, on the decode thread).
        run = run_bounds(self.ids)
        if crosses_whole(self.matrix, self.ids, run):
            matrix = self.matrix.to(device)
        else:
            matrix = torch.zeros(self.matrix.shape, dtype=self.matrix.dtype, device=device)
            copy_rows(matrix, self.matrix, self.ids, run)
        return dataclasses.replace(self, ids=self.ids.to(device), matrix=matrix)


class PoolFetch:
    """The `Future[Fetch]` of reads the reader's C pool serves (`StoreReader.submit_in_place`), into one
    staging matrix: `result()` waits for them with the GIL released. No Python thread runs on the reads'
    behalf, so none takes the GIL from the decode thread or delays the result once the bytes are in."""

    def __init__(self, ids: torch.Tensor, matrix: torch.Tensor, reads: list[PendingRead]) -> None:
        self.ids, self.matrix, self.reads = ids, matrix, reads
        self._fetch: Fetch | None = None

    def result(self) -> Fetch:
        if self._fetch is None:
            done = [read.result() for read in self.reads]
            self._fetch = Fetch(
                self.ids,
                self.matrix,
                sum(d.bytes_read for d in done),
                sum(d.reads for d in done),
                sum(d.seconds for d in done),
            )
        return self._fetch


class PoolLayerFetch:
    """The `Future[LayerFetch]` of a layer's reads on the C pool, one `PoolFetch` per kind."""

    def __init__(self, fetches: dict[str, PoolFetch]) -> None:
        self.fetches = fetches

    def result(self) -> LayerFetch:
        return {kind: fetch.result() for kind, fetch in self.fetches.items()}


WHOLE_COPY_BYTES = 4 * 2**20
"""Scattered rows of a staging matrix this small cross to another device with the whole of it: on an
H100, 1.8 MB crossed in one copy in 0.05 ms, and 1-75% of its rows, scattered, in 0.07-0.14 ms."""
WHOLE_COPY_SHARE = 0.5
"""Scattered rows from this share of a larger staging matrix up cross with the whole of it: on the
same H100, 27.5 MB crossed whole in 0.52 ms, a quarter of its rows scattered in 0.45 ms, half in
0.67 ms, three quarters in 0.85 ms (`benchmarks/gpu_staging.py`, pinned staging)."""


GOLDEN_RATIO_INVERSE = (5**0.5 - 1) / 2


def spread_ranks(count: int) -> list[int]:
    """The rank of each of `count` layers in an order whose every prefix is spread over the model:
    by the fractional part of the layer times the golden ratio's inverse (the three-gap theorem: any
    prefix's gaps take at most three sizes; for up to 64 layers, none over twice the mean)."""
    order = sorted(range(count), key=lambda layer: (layer * GOLDEN_RATIO_INVERSE) % 1.0)
    ranks = [0] * count
    for rank, layer in enumerate(order):
        ranks[layer] = rank
    return ranks


def run_bounds(ids: torch.Tensor) -> tuple[int, int] | None:
    """`(first, last)` where the unique `ids` are every id from first to last, else None (none too)."""
    if ids.numel() == 0:
        return None
    first, last = int(ids.min()), int(ids.max())
    return (first, last) if last - first + 1 == ids.numel() else None


def crosses_whole(matrix: torch.Tensor, ids: torch.Tensor, run: tuple[int, int] | None) -> bool:
    """Whether rows `ids` of `matrix` (`run`: their `run_bounds`) move to another device faster with
    the whole matrix than alone: when they are scattered, and the matrix is small or they are
    `WHOLE_COPY_SHARE` of it or more (a run crosses as one slice at the bus's speed)."""
    if ids.numel() == 0 or run is not None:
        return False
    return matrix.nbytes <= WHOLE_COPY_BYTES or ids.numel() >= WHOLE_COPY_SHARE * matrix.shape[0]


def copy_rows(
    target: torch.Tensor, source: torch.Tensor, ids: torch.Tensor, run: tuple[int, int] | None
) -> None:
    """`target[ids] = source[ids]` for unique row ids on `source`'s device (`run`: their `run_bounds`),
    moving only those rows: a run (dense streaming's uncached tail) as one slice, others gathered
    first, into pinned memory where `source` is pinned, so that they cross at the same speed."""
    if ids.numel() == 0:
        return
    if run is not None:
        first, last = run
        target[first : last + 1].copy_(source[first : last + 1])
        return
    rows = torch.empty((ids.numel(), *source.shape[1:]), dtype=source.dtype, pin_memory=source.is_pinned())
    torch.index_select(source, 0, ids, out=rows)
    target.index_copy_(0, ids.to(target.device), rows.to(target.device))


LayerFetch = dict[str, Fetch]
"""A layer's fetches, by kind."""
PendingFetch = Future[Fetch] | PoolFetch
"""A read under way, on the reader's C pool or the I/O thread: `result()` waits for its `Fetch`."""
PendingLayerFetch = Future[LayerFetch] | PoolLayerFetch
"""The same for a layer's reads of several kinds."""


@dataclass(frozen=True)
class Guess:
    """A read, started a layer early, of the units a layer will probably select (`FlashRuntime.guess`):
    `ids` land in place in staging buffer `buffer` of `kind`."""

    layer: int
    kind: str
    buffer: int
    ids: torch.Tensor
    pending: PendingFetch
    selected: torch.Tensor | None = None
    """Every unit the guess selected, cached or not, as a bool mask (`[1, units]`), where its selection ran
    fused (`FlashRuntime.guess_units`): the guessed layer's own selection counts them as resident. A
    buffer that the guess after next reuses."""
    span: torch.Tensor | None = None
    """Where `ids` are the first of a buffer of every unit's length (a fused selection's), that buffer:
    the guessed layer's fused selection writes the misses the guess did not read right after them
    (`room`, `extended`), so that the fetch's ids are one view, not a concatenation."""

    @property
    def room(self) -> torch.Tensor | None:
        """The part of `span` after `ids` (None without a span)."""
        return None if self.span is None else self.span[self.ids.shape[0] :]

    def extended(self, unread: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(further, ids)` for `FlashRuntime.submit_after`, given the misses the guess did not read as the
        guessed layer's fused selection wrote them into `room`."""
        return unread, self.span[: self.ids.shape[0] + unread.shape[0]]

    def completion(self, miss_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(further, ids)` for `FlashRuntime.submit_after`: the misses `miss_ids` of the guessed layer that
        the guess did not read, and the ids of a fetch of both (the guessed ones first)."""
        miss_ids = miss_ids if miss_ids.is_cpu else miss_ids.cpu()
        further = miss_ids[torch.isin(miss_ids, self.ids, invert=True)]
        return further, torch.cat((self.ids, further))


def reader_disk_profile(config: FlashConfig, paths: list[Path]) -> DiskProfile | None:
    """The profile of the disk under the store files `paths` that sets a runtime's reader threads and merge
    gap (`disk_profile`); None where `io_threads` is given or O_DIRECT is off: the reader's defaults."""
    if config.io_threads is None and config.direct_io is not False:
        return disk_profile(paths)
    return None


class Runtime:
    """What the modules of one patched model share whatever their method (see the module docstring).

    Subclasses set `budget_bytes` and implement `resident_bytes`; `files` are the store's files the
    reader may read (none: no reader, no I/O thread).
    """

    def __init__(
        self, store: object, config: FlashConfig, files: dict[object, RowFile], thread_name: str
    ) -> None:
        self.store = store
        self.config = config
        self.budget_bytes = 0
        self.stats = StatsRecorder()
        self.reader: StoreReader | None = None
        self._io: IOThread | None = None
        self.disk: DiskProfile | None = None
        """The measured profile of the store's disk that set the reader's threads and merge gap (None:
        the reader's defaults, or `io_threads` given)."""
        if files:
            self.disk = reader_disk_profile(config, [f.path for f in files.values()])
            self.reader = StoreReader(
                files,
                direct_io=config.direct_io,
                threads=config.io_threads if self.disk is None else self.disk.threads,
                chunk_bytes=config.io_chunk_bytes,
                merge_gap_bytes=None if self.disk is None else self.disk.merge_gap_bytes,
                buffer_bytes=0,  # every read lands in place in a buffer of the runtime's own
            )
            self._io = IOThread(thread_name)

    @property
    def io_mode(self) -> str:
        """How the store is read: `direct` (O_DIRECT), `buffered (<why>)`, or `none` (nothing on disk)."""
        if self.reader is None:
            return "none"
        if self.reader.mode == "direct":
            return "direct"
        return f"buffered ({self.reader.fallback_reason or 'asked'})"

    def resident_bytes(self) -> int:
        """Bytes the runtime really allocated within the budget."""
        raise NotImplementedError

    def drain(self) -> None:
        """Wait for the background work in flight (before the model's state is read or changed outside a
        forward). Nothing by default."""

    def snapshot(self) -> FlashStats:
        """The counters since the last reset (`flashlm.stats`)."""
        return self.stats.snapshot(
            io_mode=self.io_mode,
            resident_bytes=self.resident_bytes(),
            budget_bytes=self.budget_bytes,
            **self._snapshot_details(),
        )

    def _snapshot_details(self) -> dict[str, Any]:
        """Method-specific fields of the snapshot."""
        return {}

    def reset_stats(self) -> None:
        """Clear the counters (after `drain`: queued work may still count)."""
        self.stats.reset()

    def close(self) -> None:
        """Stop the I/O thread and close the store's files; the model is unusable after."""
        self.drain()
        if self._io is not None:
            self._io.shutdown()
        if self.reader is not None:
            self.reader.close()


def saved_bytes(profile: UnitProfile, key: tuple[int, str], row_file: RowFile) -> torch.Tensor:
    """Disk bytes per token that holding each unit of cache `key` in memory saves: the share of tokens
    that used it in `profile`, times what a read of it alone moves (`RowFile.read_amplification`)."""
    return profile.frequencies[key].double() * row_file.row_bytes * row_file.read_amplification


class FlashRuntime(Runtime):
    """Owns the reader and the shared buffers; builds each layer's cache from one memory budget.

    `kinds` are the unit kinds the model's method reads (default: dense streaming's, `dense_kinds`,
    both read ahead; a sparse method names one per stage). Each (layer, kind) gets a cache.
    `fitted_files` are the files beside the store the method's selection depends on (its calibration,
    its predictors): a hot set's unit profile must have been measured with them as they are.
    `fitted_bytes` is what the method keeps in memory of them (the predictors' weights): it comes out
    of the budget first, so that methods compared at one budget hold the same memory. `cache_split` is
    the method's way of sharing the budget between its caches (`FlashMLP.CACHE_SPLIT`), used where
    `config.cache_split` names none.

    The budget covers everything flashlm allocates for streaming: the staging buffers (two per kind,
    one layer's units each, so the next layer's reads land while this layer computes: dense streaming
    reads every kind ahead, a sparse method its first stage, and both stages in a multi-token
    forward), every cache's slots and indices, and the buffers of each `selection_kinds` stage's fused
    selection and lookup (`TopUnits`, a few bytes per unit, two sets taken in turn; two more for each of
    the `guess_kinds`, whose next layer's units a decode step guesses) and of each `column_kinds`
    stage's decode product (`TokenColumns`, one row's sum and result). Reads land in place in the
    staging matrices, so the reader needs no I/O buffer of its own.

    Reads run on one background thread (which fans out over the reader's pool), one at a time, so
    counters measured around a read belong to it alone. For the `read_ahead` kinds (dense
    streaming's both; a sparse method's first stage), once a layer has its rows the read of the next
    layer's uncached units starts, overlapping this layer's compute and the next layer's attention;
    it is valid because a layer's cache changes only in that layer's forward.
    """

    def __init__(
        self,
        store: Store,
        config: FlashConfig,
        kinds: tuple[str, ...] | None = None,
        read_ahead: tuple[str, ...] | None = None,
        slot_dtypes: dict[str, torch.dtype] | None = None,
        fitted_files: tuple[str, ...] = (),
        fitted_bytes: int = 0,
        cache_split: str = "read-cost",
        selection_kinds: tuple[str, ...] = (),
        column_kinds: tuple[str, ...] = (),
        guess_kinds: tuple[str, ...] = (),
    ) -> None:
        dense = kinds is None
        kinds = dense_kinds(store.gated) if dense else kinds
        read_ahead = (kinds if dense else ()) if read_ahead is None else read_ahead
        self.kinds = kinds
        self.slot_dtypes = {kind: (slot_dtypes or {}).get(kind, store.dtype) for kind in kinds}
        """The dtype each kind's cache holds its rows in (`ops.columns.slot_dtype`; default the store's)."""
        row_files = {
            (layer, kind): store.row_file(layer, kind) for layer in range(store.num_layers) for kind in kinds
        }
        super().__init__(store, config, row_files, "flashlm-prefetch")
        self.num_layers = store.num_layers
        self.d_model = store.d_model
        self.layer_mlp_bytes = (3 if store.gated else 2) * store.d_model * store.d_ff * store.dtype.itemsize
        """Bytes of one layer's dense MLP weights: what a token uses at density 1."""
        shapes = [(store.row_file(0, kind).rows, store.row_file(0, kind).width) for kind in kinds]
        matrices = row_matrices(
            [shape for shape in shapes for _ in range(2)], store.dtype, pinned=pin_for_gpu()
        )
        self.staging = {kind: matrices[2 * i : 2 * i + 2] for i, kind in enumerate(kinds)}
        """Each kind's two staging matrices, all in one allocation where it is not pinned (`row_matrices`)."""

        def two_sets(kind: str) -> tuple[TopUnits, TopUnits]:
            return TopUnits(store.row_file(0, kind).rows), TopUnits(store.row_file(0, kind).rows)

        self.top_units = {kind: two_sets(kind) for kind in selection_kinds}
        """Each of the `selection_kinds`' two sets of buffers for a decode token's selection fused with its
        lookup (`SparseMLP._stage`), which the layers take in turn (`selection_units`)."""
        self._in_place: dict[tuple[int, str, int], InPlaceReads | None] = {}
        """The C pool's reads into each (layer, kind, staging buffer), made on first use."""
        self._top_units_turn = dict.fromkeys(selection_kinds, 0)
        self._held: dict[TopUnits, Future[None]] = {}
        """The cache update queued on the I/O thread that still reads each set's buffers (`update_caches`)."""
        self.token_columns = {
            kind: TokenColumns(store.row_file(0, kind).width, store.dtype) for kind in column_kinds
        }
        """The same for each of the `column_kinds`' decode products (`TokenColumns`)."""
        self.guess_units = {kind: two_sets(kind) for kind in guess_kinds}
        """The same for each of the `guess_kinds`' selections a layer ahead (`guess`), apart from
        `top_units` (the guessed layer's own selection reads the guess's mask), one set per staging buffer:
        a guess's ids and mask stay valid until the guess after next, when the layer it guessed for has
        run."""
        self.budget_bytes = config.budget.resolve(self.num_layers * self.layer_mlp_bytes)
        self.fitted_bytes = fitted_bytes
        self._cache_keys = list(row_files)
        unit_bytes = [row_files[key].width * self.slot_dtypes[key[1]].itemsize for key in self._cache_keys]
        split = config.cache_split or cache_split
        unit_values = None
        if split == "profile" and not dense and config.policy != NO_CACHE:
            profile = UnitProfile.of(store, config, fitted_files, needed_by="cache_split='profile'")
            unit_values = [saved_bytes(profile, key, row_files[key]) for key in self._cache_keys]
        self.plan: BudgetPlan = split_budget(
            self.budget_bytes,
            unit_bytes=unit_bytes,
            num_units=[row_files[key].rows for key in self._cache_keys],
            overhead_bytes=self._staging_bytes() + self._decode_buffer_bytes() + fitted_bytes,
            policy=self._policy_name,
            cache_units=config.policy != NO_CACHE,
            read_cost=self._filling_order(split, row_files),
            unit_values=unit_values,
        )
        capacities = self.capacities
        self.read_ahead = tuple(
            kind
            for kind in read_ahead
            if dense
            or any(
                capacities[(layer, kind)] < row_files[(layer, kind)].rows for layer in range(self.num_layers)
            )
        )
        """The kinds whose next layer is read while this layer computes, into the other of two buffers. Not a
        sparse method's kind whose caches hold every unit: it reads each unit when first selected and keeps
        it, where reading ahead whole would read the units no token selects again at every token. A cache
        of these kinds with room for some of its units pins a block of them (`read_ahead_block`)."""
        self.hot_set: Placement | None = None
        """The pinned units of every cache (`FlashConfig.hot_share`), in the order of `_cache_keys`."""
        self.hot_set_summary: dict[str, float] = {}
        """Units and bytes pinned, and the share of the profiled unit uses they cover (`flashlm.stats`)."""
        if config.hot_share and not dense and config.policy != NO_CACHE:
            self.hot_set = self._place_hot_set(row_files, unit_bytes, fitted_files)
        self.caches: dict[tuple[int, str], NeuronCache] = {}
        self.slot_device = torch.device("cpu")
        """Where `make_cache` puts a cache's slots. The meta device for a model transformers is loading:
        its loader replaces every non-persistent buffer afterwards, so slots allocated now would only
        double the peak memory; `reset_state` then empties and pins the loader's buffers."""
        self.unit_ids = torch.arange(max(f.rows for f in row_files.values()))
        """0, 1, 2, ...: sliced for 'every unit of a layer' instead of allocating a range per step."""
        self._nothing = {
            (buffer, kinds): self._finished({kind: self._empty_fetch(kind, buffer) for kind in kinds})
            for kinds in {self.read_ahead, self.kinds}
            for buffer in range(2)
        }
        """Finished reads of nothing, for layers whose caches hold every unit (no I/O thread hop)."""
        self._nothing_of_kind = {
            (kind, buffer): self._finished(self._empty_fetch(kind, buffer))
            for kind in self.kinds
            for buffer in range(2)
        }
        """The same for one kind (`submit` of no units)."""
        self._pending: PendingLayerFetch | None = None
        self._pending_for: tuple[int, int, tuple[str, ...]] | None = None
        """(layer, buffer, kinds) of the read `_pending` is doing."""
        self._updates: dict[tuple[int, str], Future[None]] = {}
        """The cache update each (layer, kind) has queued on the I/O thread (`update_caches`)."""
        self._last_update: Future[None] | None = None
        """The update queued last: the I/O thread runs its queue in order, so once it is done, all are."""
        self._guess: Guess | None = None
        """The read `guess` started for the next layer, until that layer `take_guess`es it."""
        self.selections: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        """Each layer's own selection (tokens `[T, d_model]` -> `[T, units]` mask of its first read), for
        methods whose guess of the next layer's units needs that layer's selector (a predictor's weights)
        rather than their own; the modules register it when built."""
        self.trace = TraceRecorder() if config.record_trace else None
        self.every_unit_resident = False
        """True once every cache holds every unit of its layer (a budget that fits the whole MLP): then
        nothing is ever read again, and the modules skip the reader altogether."""
        self.clock = 0
        self.step_start = 0
        """Cache clock: one tick per token position processed, so policies count tokens."""

    def begin_step(self, tokens: int) -> int:
        """Start a forward pass of `tokens` token positions (called by layer 0); returns its first tick."""
        self.stats.begin_step()
        start, self.clock = self.clock, self.clock + tokens
        self.step_start = start
        return start

    @property
    def capacities(self) -> dict[tuple[int, str], int]:
        """The slots the budget plan gives each (layer, kind) cache."""
        return dict(zip(self._cache_keys, self.plan.capacities, strict=True))

    def _place_hot_set(
        self, row_files: dict[tuple[int, str], RowFile], unit_bytes: list[int], fitted_files: tuple[str, ...]
    ) -> Placement:
        """Choose the units to pin, `hot_share` of the cache bytes across every layer and kind, for the
        most disk bytes saved per token (a unit's frequency times the bytes a miss of it reads).

        A cache pins at most its planned capacity, its most frequent units; one that holds every unit
        of its layer pins nothing (everything stays resident there anyway), nor does one of a kind read
        ahead whole (it pins its block)."""
        config = self.config
        profile = UnitProfile.of(self.store, config, fitted_files, needed_by="hot_share")
        values = []
        for key, capacity in self.capacities.items():
            frequency = profile.frequencies[key]
            value = saved_bytes(profile, key, row_files[key])
            if capacity < frequency.numel() and key[1] not in self.read_ahead:
                # only the `capacity` most frequent units are candidates
                value[frequency.argsort(descending=True, stable=True)[capacity:]] = 0
            else:
                value.zero_()
            values.append(value)
        started = perf_counter()
        # No per-layer minimum here (PowerInfer's C_l prices a GPU synchronization flashlm does not
        # have): the greedy knapsack is then within one unit of the ILP's optimum, in well under a
        # second where the ILP over a 1.5B model's 300k units would take its time limit at every load.
        placement = place_hot_neurons(
            values,
            [NeuronCache.slot_bytes(b) for b in unit_bytes],
            int(config.hot_share * self.plan.cache_bytes),
            solver="greedy",
        )
        uses = sum(float(profile.frequencies[key].sum()) for key in self._cache_keys)
        pinned_uses = sum(
            float(profile.frequencies[key][hot].sum())
            for key, hot in zip(self._cache_keys, placement.hot, strict=True)
        )
        self.hot_set_summary = {
            "units": sum(placement.counts),
            "bytes": placement.bytes_used,
            "profiled_uses": pinned_uses / max(uses, 1e-12),
        }
        logger.info(
            "flashlm: hot set of %d units (%s) placed in %.2f s: %.1f%% of the profiled unit uses",
            sum(placement.counts),
            format_bytes(placement.bytes_used),
            perf_counter() - started,
            100 * self.hot_set_summary["profiled_uses"],
        )
        return placement

    def make_cache(self, layer: int, kind: str) -> NeuronCache:
        """Layer `layer`'s cache of `kind` units, with the capacity the budget plan gives it (on
        `slot_device`), its hot units pinned (where the slots are real)."""
        num_units = self.store.row_file(layer, kind).rows
        policy = make_policy(self._policy_name, num_units, **self._policy_options())
        cache = NeuronCache(
            num_units,
            self.plan.capacities[self._cache_keys.index((layer, kind))],
            self.store.row_file(layer, kind).width,
            self.slot_dtypes[kind],
            policy,
            device=self.slot_device,
        )
        self.caches[(layer, kind)] = cache
        if not cache.rows.is_meta:
            self._pin(layer, kind)
        return cache

    def reset_caches(self, layer: int) -> None:
        """Empty layer `layer`'s caches and pin their units again (read from the store). The slots
        are written once here, so that the pages of new buffers (the loader's) are faulted in at load
        rather than while decoding."""
        self.drain()
        for (cache_layer, kind), cache in self.caches.items():
            if cache_layer == layer:
                cache.rows.zero_()
                cache.clear()
                self._pin(layer, kind)

    def _pin(self, layer: int, kind: str) -> None:
        """Pin a cache's fixed units: for a kind read ahead whole its block (`read_ahead_block`), for any
        other its hot set (`hot_share`), if it has one."""
        cache = self.caches[(layer, kind)]
        if kind in self.read_ahead:
            ids = read_ahead_block(cache.capacity, cache.num_units)
        elif self.hot_set is not None:
            ids = self.hot_set.hot[self._cache_keys.index((layer, kind))]
        else:
            return
        if ids is not None and ids.numel():
            cache.pin(ids, self.read(layer, kind, ids).matrix)

    @property
    def _policy_name(self) -> str:
        """The eviction policy's name; `NO_CACHE` keeps LRU's bookkeeping on zero slots."""
        return "lru" if self.config.policy == NO_CACHE else self.config.policy

    def _policy_options(self) -> dict:
        return {"window": self.config.window} if self.config.policy == "window" else {}

    def refresh_residency(self) -> None:
        """Recompute `every_unit_resident` (after a cache admitted units)."""
        self.every_unit_resident = all(cache.size == cache.num_units for cache in self.caches.values())

    def read(self, layer: int, kind: str, ids: torch.Tensor, buffer: int = 0) -> Fetch:
        """Read units `ids` of `layer`'s `kind` matrix now, in place into that kind's staging buffer
        `buffer` (no gather: the reader's runs land at their own rows). The fetch is in host memory,
        whatever device `ids` are on (`Fetch.to` moves it)."""
        staging = self.staging[kind][buffer]
        ids = ids.cpu()
        started = perf_counter()
        done = self.reader.read_in_place((layer, kind), ids, staging)
        return Fetch(ids, staging, done.bytes_read, done.reads, perf_counter() - started)

    def update_caches(self, layer: int, kinds: tuple[str, ...], updates: list[CacheUpdate]) -> None:
        """Run `layer`'s cache `updates` (one per kind of `kinds`: admission and eviction, row copies that
        grow with the misses) now, or, when they copy at least `QUEUED_UPDATE_MIN_BYTES`, on the I/O
        thread, off the decode's critical path, as one task. That queue is first in, first out, and no
        read goes to the reader's C pool while an update is queued (`_submit_to_pool`), so a queued
        update runs before any later read that could reuse the staging rows it copies from;
        `settle` waits for it before any of those caches is read again. A queued update records its
        evictions itself (a forward counts from `FlashMLP.settled_counters`, so not twice)."""
        updates = [update for update in updates if update.cache.admits]  # a cache all pinned never changes
        if sum(update.copy_bytes for update in updates) < QUEUED_UPDATE_MIN_BYTES:
            for update in updates:
                update.run(False)
            return
        caches = [self.caches[(layer, kind)] for kind in kinds]

        def run_and_count() -> None:
            # The forward that queued this recorded its counters already: the evictions are recorded here.
            before = sum(cache.evictions for cache in caches)
            for update in updates:
                update.run(True)
            self.stats.record(layer, evictions=sum(cache.evictions for cache in caches) - before)

        done = self._io.submit(run_and_count)
        for kind in kinds:
            self._updates[(layer, kind)] = done
        for update in updates:
            if update.selection is not None:
                self._held[update.selection] = done
        self._last_update = done

    def selection_units(self, kind: str) -> TopUnits:
        """The buffers for a decode token's fused selection of `kind` units (`TopUnits`): the two sets in
        turn, so that a layer's cache update queued past its forward (which reads the set it selected
        into) stays valid while the next layer selects. A set still held by a queued update is waited
        for (its error is raised where its layer settles)."""
        self._top_units_turn[kind] ^= 1
        units = self.top_units[kind][self._top_units_turn[kind]]
        held = self._held.pop(units, None)
        if held is not None:
            wait((held,))
        return units

    def settle(self, layer: int, kind: str) -> None:
        """Wait for the update `update_caches` queued for this cache, if any (raising its error)."""
        pending = self._updates.pop((layer, kind), None)
        if pending is not None:
            pending.result()

    def uncached(self, layer: int, kind: str) -> torch.Tensor:
        """Ids of `layer`'s `kind` units not in its cache, ascending."""
        self.settle(layer, kind)
        cache = self.caches[(layer, kind)]
        if cache.holds_unit_prefix:
            return self.unit_ids[cache.size : cache.num_units]
        return cache.missing(self.unit_ids[: cache.num_units])

    def read_layer(
        self, layer: int, kinds: tuple[str, ...] | None = None, *, ahead: bool = True
    ) -> PendingLayerFetch:
        """Every uncached unit of `layer`'s `kinds` (default: the `read_ahead` kinds): the read started
        a layer ahead when there is one (completed with any kind it lacks), else one started now. Then,
        with `ahead`, the same kinds of the next layer start reading, into the other staging buffers
        (a caller whose next forward will not ask for them passes False: a read left waiting would go
        stale as other reads reuse the buffers)."""
        kinds = self.read_ahead if kinds is None else kinds
        pending, key, self._pending = self._pending, self._pending_for, None
        if pending is not None and key[0] == layer:
            buffer = key[1]
            missing = () if kinds == key[2] else tuple(kind for kind in kinds if kind not in key[2])
            if missing:
                plan = {kind: self.uncached(layer, kind) for kind in missing}
                pending = self._read_more(pending, layer, plan, buffer)
        else:
            if pending is not None:
                pending.result()
            buffer = 0
            pending = self._submit_layer(layer, buffer, kinds)
        if ahead:
            following = (layer + 1) % self.num_layers
            self._pending = self._submit_layer(following, 1 - buffer, kinds)
            self._pending_for = (following, 1 - buffer, kinds)
        return pending

    def _read_more(
        self, started: PendingLayerFetch, layer: int, plan: dict[str, torch.Tensor], buffer: int
    ) -> PendingLayerFetch:
        """`started`, a read of some of `layer`'s kinds, completed with the units `plan[kind]` of others: on
        the C pool where `started` runs there too, else on the I/O thread after it."""
        more = self._submit_to_pool(layer, plan, buffer) if isinstance(started, PoolLayerFetch) else None
        if more is not None:
            return PoolLayerFetch({**started.fetches, **more.fetches})
        return self._io.submit(lambda: {**started.result(), **self._read_kinds(layer, plan, buffer)})

    def _submit_layer(self, layer: int, buffer: int, kinds: tuple[str, ...]) -> PendingLayerFetch:
        """Start reading every uncached unit of `layer`'s `kinds` into staging buffer `buffer`. Which ones
        is decided here, on the decode thread (a C lookup of microseconds): on the I/O thread the same
        Python waited for the GIL while the decode thread ran, and took it from it in turn."""
        for kind in kinds:
            self.settle(layer, kind)  # a queued update may still expire units
        if all(self.caches[(layer, kind)].size == self.caches[(layer, kind)].num_units for kind in kinds):
            return self._nothing[(buffer, kinds)]  # nothing to read, found without a tensor operator
        plan = {kind: self.uncached(layer, kind) for kind in kinds}
        if not any(ids.numel() for ids in plan.values()):
            return self._nothing[(buffer, kinds)]
        on_pool = self._submit_to_pool(layer, plan, buffer)
        return on_pool if on_pool is not None else self._io.submit(self._read_kinds, layer, plan, buffer)

    def _submit_to_pool(
        self, layer: int, plan: dict[str, torch.Tensor], buffer: int
    ) -> PoolLayerFetch | None:
        """Start reading units `plan[kind]` of `layer` into staging buffer `buffer` on the reader's C pool,
        with no Python thread on the way. None, with nothing started, where the pool cannot take them: no C
        library, or a cache update still queued on the I/O thread, which must copy its rows out of a
        staging buffer before any later read may reuse it (the I/O thread's queue orders the two; the
        pool would not)."""
        if self._last_update is not None and not self._last_update.done():
            return None
        fetches = {}
        # the pool's threads are woken once, by the last read submitted
        waking = next((kind for kind in reversed(plan) if plan[kind].numel()), None)
        for kind, ids in plan.items():
            ids = ids if ids.is_cpu else ids.cpu()  # a no-op `.cpu()` still costs an operator
            reads = []
            if ids.numel():
                into = self._in_place_reads(layer, kind, buffer)
                if into is None:
                    return None  # no C pool: nothing was submitted (every call answers the same)
                reads.append(into.submit(ids, start=kind == waking))
            fetches[kind] = PoolFetch(ids, self.staging[kind][buffer], reads)
        return PoolLayerFetch(fetches)

    def _in_place_reads(self, layer: int, kind: str, buffer: int) -> InPlaceReads | None:
        """The C pool's reads of `layer`'s `kind` rows into staging buffer `buffer` (None: no C pool), made
        on first use and kept: the decode thread submits through them with no checks repeated."""
        key = (layer, kind, buffer)
        if key not in self._in_place:
            self._in_place[key] = self.reader.in_place_reads((layer, kind), self.staging[kind][buffer])
        return self._in_place[key]

    def _empty_fetch(self, kind: str, buffer: int) -> Fetch:
        return Fetch(self.unit_ids[:0], self.staging[kind][buffer], 0, 0, 0.0)

    @staticmethod
    def _finished(result: object) -> Future:
        done: Future = Future()
        done.set_result(result)
        return done

    def _read_kinds(self, layer: int, plan: dict[str, torch.Tensor], buffer: int) -> LayerFetch:
        return {kind: self.read(layer, kind, ids, buffer) for kind, ids in plan.items()}

    def submit(self, layer: int, kind: str, ids: torch.Tensor, buffer: int = 0) -> PendingFetch:
        """`read` in the background: on the reader's C pool (`_submit_to_pool`), else on the I/O thread;
        with nothing to read, a finished one without either."""
        if not ids.numel():
            return self._nothing_of_kind[(kind, buffer)]
        on_pool = self._submit_to_pool(layer, {kind: ids}, buffer)
        if on_pool is not None:
            return on_pool.fetches[kind]
        return self._io.submit(self.read, layer, kind, ids, buffer)

    def guess(self, layer: int, kind: str, ids: torch.Tensor, buffer: int) -> None:
        """Start reading the uncached ones of units `ids` of `layer`'s `kind`, which its forward will
        probably select, into staging buffer `buffer` (one the forward running now does not use). Queued
        after the reads and cache updates already submitted, so it overlaps the compute between here and
        that layer."""
        self.settle(layer, kind)
        self.guess_uncached(layer, kind, self.caches[(layer, kind)].missing(ids).cpu(), buffer)

    def guess_uncached(
        self,
        layer: int,
        kind: str,
        uncached: torch.Tensor,
        buffer: int,
        selected: torch.Tensor | None = None,
        span: torch.Tensor | None = None,
    ) -> None:
        """`guess`, given the guess's `uncached` units and, where its selection ran fused with its lookup
        (`guess_units[kind][buffer]`), the mask of every unit it `selected` and the buffer whose head
        `uncached` is (`Guess.span`). Their buffers must stay unchanged until the guessed layer has run."""
        self.take_guess(-1, kind)  # one guess at a time: an unclaimed one is waited for and dropped
        pending = self.submit(layer, kind, uncached, buffer)
        self._guess = Guess(layer, kind, buffer, uncached, pending, selected, span)

    def take_guess(self, layer: int, kind: str) -> Guess | None:
        """The guess started for `layer`'s `kind`, if that is the one outstanding (any other is waited for
        and dropped: its bytes were read, but no forward will use them)."""
        guess, self._guess = self._guess, None
        if guess is not None and (guess.layer, guess.kind) == (layer, kind):
            return guess
        if guess is not None:
            wasted = guess.pending.result()
            self.stats.record(guess.layer, bytes_read=wasted.bytes_read, reads=wasted.reads)
        return None

    def submit_after(self, guess: Guess, further: torch.Tensor, ids: torch.Tensor) -> PendingFetch:
        """The read of a layer's misses whose guess was `guess`: `further`, those the guess did not read,
        land beside the guessed ones in the same staging buffer. The fetch covers `ids`, the guessed and
        the further ones (`Guess.extended` or `Guess.completion` gives both; the guessed units the layer
        did not select get zero coefficients), and counts both reads. With nothing further, the guess's
        own read is that fetch, with no task for the I/O thread (as `submit` returns a finished read
        when there is nothing to read)."""
        if further.shape[0] == 0:
            return guess.pending
        if isinstance(guess.pending, PoolFetch):
            # Submitted now, it is read after the guess and before any later guess.
            on_pool = self._submit_to_pool(guess.layer, {guess.kind: further}, guess.buffer)
            if on_pool is not None:
                read = on_pool.fetches[guess.kind]
                return PoolFetch(ids, read.matrix, [*guess.pending.reads, *read.reads])

        def complete() -> Fetch:
            guessed = guess.pending.result()
            read = self.read(guess.layer, guess.kind, further, guess.buffer)
            return Fetch(
                ids,
                guessed.matrix,
                guessed.bytes_read + read.bytes_read,
                guessed.reads + read.reads,
                guessed.busy_s + read.busy_s,
            )

        return self._io.submit(complete)

    def drain(self) -> None:
        """Wait for and drop an outstanding prefetch or guess, and for queued cache updates (before the
        caches are read or changed outside a forward)."""
        pending, self._pending, self._pending_for = self._pending, None, None
        if pending is not None:
            pending.result()
        self.take_guess(-1, "")
        for key in list(self._updates):
            self.settle(*key)

    def _snapshot_details(self) -> dict[str, Any]:
        return {"hot_set": self.hot_set_summary}

    def resident_bytes(self) -> int:
        """Bytes really allocated: caches (slots, indices, policy), staging matrices, selection buffers,
        fitted weights."""
        cache_bytes = sum(
            cache.nbytes + sum(b.numel() * b.element_size() for b in cache.policy.buffers())
            for cache in self.caches.values()
        )
        return cache_bytes + self._staging_bytes() + self._decode_buffer_bytes() + self.fitted_bytes

    def _filling_order(self, split: str, row_files: dict[tuple[int, str], RowFile]) -> list[float] | None:
        """`split_budget`'s `read_cost` for `split`: the caches of the highest cost are filled first."""
        if split == "size":
            return None
        if split == "in-order":
            kinds, layers, rank = len(self.kinds), self.num_layers, spread_ranks(self.num_layers)
            return [
                float((kinds - self.kinds.index(kind)) * layers + layers - rank[layer])
                for layer, kind in self._cache_keys
            ]
        return [row_files[key].read_amplification for key in self._cache_keys]

    def _staging_bytes(self) -> int:
        """The staging buffers' bytes: their allocations (storages), each counted once, with the spare
        blocks `row_matrices` adds and, pinned, the rest of the allocator's blocks."""
        storages = (b.untyped_storage() for bufs in self.staging.values() for b in bufs)
        return sum({storage.data_ptr(): storage.nbytes() for storage in storages}.values())

    def _decode_buffer_bytes(self) -> int:
        buffers = [
            *(units for sets in (*self.top_units.values(), *self.guess_units.values()) for units in sets),
            *self.token_columns.values(),
        ]
        return sum(buffer.nbytes for buffer in buffers)

    def reset_stats(self) -> None:
        super().reset_stats()
        for cache in self.caches.values():
            cache.reset_counters()
