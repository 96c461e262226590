"""The DIP paper's sparse MLPs for gated (SwiGLU) models: DIP, DIP-CA and its baselines.

Each method runs in two stages over two unit kinds of the store, each kind with its own cache:

| method | stage 1 reads (kind)                 | selects stage 2 by             | stage 2 reads (kind)     |
|--------|--------------------------------------|--------------------------------|--------------------------|
| dip    | top-k of |x|: up/gate cols (dip_in)  | top-k of the pruned GLU        | down cols (dip_down)     |
| glu    | every up/gate column (dip_in)        | top-k of the full GLU (oracle) | down cols (dip_down)     |
| up     | every up row (up)                    | top-k of |up x|                | gate row, down col       |
|        |                                      |                                | (gate_down)              |
| gate   | every gate row (gate)                | top-k of |act(gate x)|         | up row, down col         |
|        |                                      |                                | (up_down)                |
| cats   | every gate row (gate)                | |act(gate x)| > layer threshold | up row, down col         |
|        |                                      |                                | (up_down)                |

With `cache_aware=γ < 1` (DIP-CA, Algorithm 1) both of DIP's selections rank by
`|v| (c + γ(1-c)) / ||v||_inf`, c the stage's cache residency, so units already in memory win
close calls.

A forward of T tokens computes every token with its own masks, as T decode steps would; the
reads cover the union of what the tokens need (prefill therefore reads about everything, like
dense), and each stage is one product over that union with per-token coefficients. Masks that
depend on the cache see it as it was when the forward began, unless `sequential_prefill` asks for
the exact token-by-token evolution (the perplexity harness does): then each stage reads its whole
matrix once and replays the cache token by token.

Products run on the rows where they lie (cache slots, staging buffers), never on a copy: a row unit
(`up`, `gate`, the first half of a `gate_down` row) is a row of the checkpoint's matrix, computed by
`F.linear` as the dense model computes it; a column unit (a `dip_in` or `dip_down` row, the down
half of a bundle) is summed over by `flashlm.ops.ColumnProduct`, whose implementation is measured
on the machine at load. At density 1.0 no sparse module is built: every method is then dense
streaming (`flashlm.methods.mlp.module_class`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..activations import is_silu
from ..cache import NeuronCache
from ..engine.runtime import CacheUpdate, FlashRuntime, reader_disk_profile
from ..engine.stats import StageTimes
from ..errors import ConfigError, UnsupportedArchitectureError
from ..ops import ColumnProduct, RowProduct
from ..ops.columns import slot_dtype
from ..store.reader import DEFAULT_MERGE_GAP_BYTES, merged_read_cost
from .base import method_class, register_method
from .calibration import CALIBRATION_FILE, Calibration
from .masking import kept_pairs, union_ids
from .mlp import FlashMLP, require_gate
from .selection import (
    CATSSelection,
    DIPSelection,
    GLUSelection,
    Selection,
    TopK,
    dip_split,
    selection_options,
)

if TYPE_CHECKING:
    from ..config import FlashConfig
    from ..engine.runtime import Fetch, PendingFetch, PendingLayerFetch
    from ..store import Store

logger = logging.getLogger(__name__)

Parts = Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
"""(matrix, unit ids, index) triples that together hold every unit a stage needs: the row of unit
`ids[k]` is `matrix[index[k]]`, or `matrix[k]` without an index (cache slots; a staging matrix read in
place is indexed by the unit ids themselves)."""


class _Parts:
    """A stage's rows: the cached ones at once, then the misses once their read (in flight) lands
    (for a kind read ahead: every uncached unit, a superset the coefficients mask).

    Iterating computes over the cached rows first, overlapping that work with the read; the wait for
    the read is timed once, as I/O, and left out of the compute time.
    """

    def __init__(
        self,
        cached_rows: torch.Tensor,
        cached_ids: torch.Tensor,
        pending: PendingFetch | PendingLayerFetch,
        kind: str,
        miss_ids: torch.Tensor,
        times: StageTimes,
        whole: torch.Tensor | None = None,
    ) -> None:
        self.cached = (cached_rows, cached_ids)
        self.pending = pending
        self.kind = kind
        self.miss_ids = miss_ids
        self.times = times
        self.whole = whole
        """Every unit id of the layer, when the read covers every uncached unit (a multi-token forward):
        the cached rows then join the staging matrix and the stage is one product over all of it."""
        self._fetched: Fetch | None = None

    @property
    def fetched(self) -> Fetch:
        if self._fetched is None:
            waiting = perf_counter()
            result = self.pending.result()
            fetched = result[self.kind] if isinstance(result, dict) else result
            self._fetched = fetched.to(self.cached[0].device)
            self.times.io_s += perf_counter() - waiting
            self.times.io_busy_s += self._fetched.busy_s
            self.times.bytes_read += self._fetched.bytes_read
            self.times.reads += self._fetched.reads
        return self._fetched

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        if self.whole is not None:
            matrix = self.fetched.matrix
            rows, ids = self.cached
            if ids.numel():
                matrix.index_copy_(0, ids, rows.to(matrix.dtype))
            yield matrix[: self.whole.numel()], self.whole, None
            return
        if self.cached[1].numel():
            yield (*self.cached, None)
        if self.miss_ids.numel():
            # the misses, or every uncached unit read ahead, each at its own row of the staging matrix
            yield self.fetched.matrix, self.fetched.ids, self.fetched.ids


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Selected:
    """What a stage selected: its `[T, units]` mask (None: every unit), and where the selection ran fused
    with its lookup (`TopUnits`, one decode token) the values it ranked, masked, in fp32."""

    mask: torch.Tensor | None
    coef: torch.Tensor | None = None

    def coefficients(self, values: torch.Tensor) -> torch.Tensor:
        """`values` where the mask keeps them and 0 elsewhere, in fp32 (`values` are what was ranked)."""
        if self.coef is not None:
            return self.coef
        return (values if self.mask is None else values * self.mask).float()


class SparseMLP(Selection, FlashMLP):
    """A two-stage sparse MLP (see the module docstring). Subclasses define the four hooks.

    Args (beyond `FlashMLP`'s): `k_out`: units kept per token by the second selection (the
    subclass decides what it ranks); `gamma`: cache-aware re-weighting (1.0: off).
    """

    INPUT_KIND: str
    OUTPUT_KIND: str

    FITTED_FILES = (CALIBRATION_FILE,)
    COLUMN_KINDS: tuple[str, ...] = ()
    """Kinds whose every row is a column unit (a cache of them may hold fp32 rows, `slot_dtypes`)."""

    @classmethod
    def check_store(cls, store: Store, config: FlashConfig) -> None:
        require_gate(store, config.method, "prunes the projections of a gated (SwiGLU) MLP", "dense")
        if store.has_bias and config.density < 1:
            raise UnsupportedArchitectureError(
                f"method={config.method!r} does not support MLP biases ({store.model_type} has them)."
            )

    @classmethod
    def load_fitted(cls, store: Store, *, device: torch.device) -> Calibration | None:
        return Calibration.load(store.path, store.content_sha256)  # numbers, no tensors

    @classmethod
    def make_runtime(cls, store: Store, config: FlashConfig, fitted: Calibration | None) -> FlashRuntime:
        paths = [store.row_file(layer, kind).path for layer in range(store.num_layers) for kind in cls.KINDS]
        disk = reader_disk_profile(config, paths)
        merge_gap = DEFAULT_MERGE_GAP_BYTES if disk is None else disk.merge_gap_bytes
        read_ahead = (cls.INPUT_KIND,) if reads_ahead(config, store, fitted, merge_gap) else ()
        return FlashRuntime(
            store,
            config,
            cls.KINDS,
            read_ahead,
            cls.slot_dtypes(store),
            cls.FITTED_FILES,
            cache_split=cls.CACHE_SPLIT,
            selection_kinds=cls.KINDS,
            column_kinds=cls.COLUMN_KINDS,
            guess_kinds=(cls.INPUT_KIND,) if cls.guesses(config, read_ahead) else (),
        )

    @classmethod
    def guesses(cls, config: FlashConfig, read_ahead: tuple[str, ...]) -> bool:
        """Whether a decode step reads, a layer ahead, the input units the next layer would select for
        this layer's input (`_guess_next_layer`), with `read_ahead` the kinds read ahead whole."""
        return False

    @classmethod
    def build(
        cls,
        layer: int,
        runtime: FlashRuntime,
        act: nn.Module,
        *,
        fitted: Calibration | None,
        dense_class: type[nn.Module] | None,
    ) -> SparseMLP:
        """The module of the runtime's configured method (`build_sparse_mlp`), its column products measured
        now, at load, rather than in the first forward."""
        module = build_sparse_mlp(
            runtime.config, layer, runtime, act, calibration=fitted, dense_class=dense_class
        )
        module.measure_products()
        return module

    @classmethod
    def slot_dtypes(cls, store: Store) -> dict[str, torch.dtype]:
        """The dtype each column kind's cache holds, measured here (`ops.columns.slot_dtype`)."""
        return {kind: slot_dtype(store.dtype, store.row_file(0, kind).width) for kind in cls.COLUMN_KINDS}

    def column_products_needed(self) -> dict[int, float]:
        """Width of each column product the method computes (a sum over units of `coef * row`) and the
        share of those units it keeps: here the down half of a bundle, `k_out` of the neurons."""
        return {self.d_model: self.k_out / self.d_ff}

    def row_products_needed(self) -> tuple[int, ...]:
        """Width of each row product the method computes (kept units' rows dotted with the tokens): here
        the other projection's half of a bundle."""
        return (self.d_model,)

    def measure_products(self) -> None:
        """Choose, by timing them here, how each column and row product is computed (`ColumnProduct`,
        `RowProduct`)."""
        dtype = self.runtime.store.dtype
        for width, density in self.column_products_needed().items():
            self.column_products[width] = ColumnProduct.measure(dtype, width, density)
        for width in self.row_products_needed():
            self.row_products[width] = RowProduct.measure(dtype, width, self.k_out // 2)  # hits, then misses

    def _product(self, width: int) -> ColumnProduct:
        if width not in self.column_products:
            self.measure_products()
        return self.column_products[width]

    def _row_product(self, width: int) -> RowProduct:
        if width not in self.row_products:
            self.measure_products()
        return self.row_products[width]

    def __init__(
        self,
        layer: int,
        runtime: FlashRuntime,
        act: nn.Module,
        *,
        d_model: int,
        d_ff: int,
        k_out: int,
        gamma: float = 1.0,
        dense_class: type[nn.Module] | None = None,
    ) -> None:
        super().__init__(layer, runtime, act, gated=True, d_model=d_model, d_ff=d_ff, dense_class=dense_class)
        self.k_out = k_out
        self.gamma = gamma
        self.input_cache = runtime.make_cache(layer, self.INPUT_KIND)
        self.output_cache = runtime.make_cache(layer, self.OUTPUT_KIND)
        self._row_bytes = {
            kind: runtime.store.row_file(layer, kind).row_bytes
            for kind in (self.INPUT_KIND, self.OUTPUT_KIND)
        }
        self.guesses_ahead = self.INPUT_KIND in runtime.guess_units
        """Whether a decode step's first stage reads the next layer's likely input units
        (`_guess_next_layer`): as `guesses` told `make_runtime`, which sized the guess's buffers."""
        self.column_products: dict[int, ColumnProduct] = {}
        """The measured implementation of each width of column product this method computes
        (`measure_products`, which `build` calls at load; else measured on first use)."""
        self.row_products: dict[int, RowProduct] = {}
        """The same for its row products."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.KINDS = (cls.INPUT_KIND, cls.OUTPUT_KIND)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer}, d_model={self.d_model}, d_ff={self.d_ff}, k_out={self.k_out}, "
            f"gamma={self.gamma}, capacity=({self.input_cache.capacity}, {self.output_cache.capacity})"
        )

    # ---- the four hooks: select_input and select_output (`Selection`), compute_input, compute_output --

    def compute_input(self, x: torch.Tensor, selected: Selected, parts: Parts) -> torch.Tensor:
        """Stage 1: the `[T, d_ff]` activation the second selection ranks."""
        raise NotImplementedError

    def compute_output(
        self, x: torch.Tensor, a: torch.Tensor, selected: Selected, parts: Parts
    ) -> torch.Tensor:
        """Stage 2: the MLP's `[T, d_model]` output."""
        raise NotImplementedError

    # ---- the engine ---------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        runtime = self.runtime
        x = self._tokens_of(hidden_states)
        tokens = x.shape[0]
        before = self.settled_counters()
        times = StageTimes()
        sequential = tokens > 1 and runtime.config.sequential_prefill

        early = None
        if tokens > 1 and not sequential:
            # Many tokens need about every unit of both stages: read every uncached one of both kinds a
            # layer ahead, as dense streaming does (the last layer reads the first one ahead only if
            # decoding will ask for it).
            started = perf_counter()
            ahead = self.layer + 1 < runtime.num_layers or bool(runtime.read_ahead)
            early = runtime.read_layer(self.layer, self.KINDS, ahead=ahead)
            times.submit_s += perf_counter() - started

        in_selected, in_parts, finish_in = self._stage(
            self.INPUT_KIND,
            self.input_cache,
            self.select_input,
            self.input_topk(),
            x,
            times,
            sequential,
            early,
        )
        a = self._timed(times, lambda: self.compute_input(x, in_selected, in_parts))
        update_in = finish_in()

        out_selected, out_parts, finish_out = self._stage(
            self.OUTPUT_KIND,
            self.output_cache,
            self.select_output,
            self.output_topk(),
            a,
            times,
            sequential,
            early,
        )
        out = self._timed(times, lambda: self.compute_output(x, a, out_selected, out_parts))
        update_out = finish_out()
        if update_in is not None:
            updating = perf_counter()
            # Deferring the input cache's update past the output stage is safe: it copies from the
            # input kind's staging buffer, which no read reuses before the next layer's forward.
            runtime.update_caches(self.layer, self.KINDS, [update_in, update_out])
            times.update_s += perf_counter() - updating

        hits, misses, evictions = (now - then for now, then in zip(self.counters(), before, strict=True))
        runtime.stats.record(
            self.layer,
            tokens=tokens,
            bytes_read=times.bytes_read,
            reads=times.reads,
            hits=hits,
            misses=misses,
            evictions=evictions,
            used_bytes=times.used_bytes,
            dense_bytes=tokens * runtime.layer_mlp_bytes,
            select_s=times.select_s,
            lookup_s=times.lookup_s,
            submit_s=times.submit_s,
            io_s=times.io_s,
            io_busy_s=times.io_busy_s,
            update_s=times.update_s,
            compute_s=times.compute_s,
        )
        return out.reshape(hidden_states.shape)

    @staticmethod
    def _timed(times: StageTimes, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`compute()`, its time added to `compute_s` less the read wait inside it (counted as I/O)."""
        started, io_before = perf_counter(), times.io_s
        result = compute()
        times.compute_s += perf_counter() - started - (times.io_s - io_before)
        return result

    def _stage(
        self,
        kind,
        cache: NeuronCache,
        select,
        topk: TopK | None,
        values: torch.Tensor,
        times: StageTimes,
        sequential: bool,
        early: PendingLayerFetch | None = None,
    ):
        """Select (`select(values, residency)`), look up and read one stage's units (`early`: a read of
        every uncached unit of the layer's kinds, already submitted). A decode step's top-k selection
        (`topk`, the rule `select` applies) runs fused with its lookup, in one call (`TopUnits`).

        Returns (selected, parts, finish); `finish()`, once the stage's rows are computed, returns the
        cache's update (None where the stage updated the cache itself), for the runtime to run before
        any later read reuses the staging buffer (`FlashRuntime.update_caches`).
        """
        runtime, layer = self.runtime, self.layer
        runtime.settle(layer, kind)
        if sequential:
            return self._sequential_stage(kind, cache, select, values, times)
        started = perf_counter()
        guess = runtime.take_guess(layer, kind) if kind == self.INPUT_KIND and self.guesses_ahead else None
        fused = units = unread = None
        gamma = self._fused_gamma(topk, kind)
        # With a guess, the selection counts the guessed units as resident: fused where it has their mask.
        guessed = None if guess is None else guess.selected
        if topk is not None and values.shape[0] == 1 and (guess is None or guessed is not None or gamma == 1):
            units = runtime.selection_units(kind)
            room = None if guessed is None else guess.room
            fused = units(values, topk.k, cache.slot_of, gamma, guessed, room)
        if fused is not None:
            mask, coef, ids, miss_ids, unread = fused
            cache.count(ids.shape[0] - miss_ids.shape[0], miss_ids.shape[0])
            selected = looked_up = perf_counter()  # one call: the lookup is timed with the selection
        else:
            coef = None
            resident = self._residency(cache, kind)
            if guess is not None and resident is not None:
                # guessed units are read already, too
                resident = resident.index_fill(0, guess.ids.to(resident.device), True)
            mask = select(values, resident)
            ids = runtime.unit_ids[: cache.num_units] if mask is None else union_ids(mask)
            selected = perf_counter()
            miss_ids = cache.find_misses(ids)
            looked_up = perf_counter()
        if early is not None:
            pending: PendingLayerFetch | PendingFetch = early  # every uncached unit, read ahead
        elif kind in runtime.read_ahead:
            # Every uncached unit, needed or not: the unneeded ones get zero coefficients.
            pending = runtime.read_layer(layer)
        elif guess is not None:
            further, fetch_ids = guess.completion(miss_ids) if unread is None else guess.extended(unread)
            pending = runtime.submit_after(guess, further, fetch_ids)
        else:
            pending = runtime.submit(layer, kind, miss_ids)
        submitted = perf_counter()
        guess_submit_s = 0.0
        if kind == self.INPUT_KIND and self.guesses_ahead and values.shape[0] == 1:
            guess_submit_s = self._guess_next_layer(values, 1 - (0 if guess is None else guess.buffer))
        # the guess's selection is a selection, its read's submission a submission
        times.select_s += selected - started + perf_counter() - submitted - guess_submit_s
        times.lookup_s += looked_up - selected
        times.submit_s += submitted - looked_up + guess_submit_s
        self._count_used(times, kind, cache, values.shape[0], mask, ids)
        whole = runtime.unit_ids[: cache.num_units] if early is not None else None
        parts = _Parts(
            cache.rows[: cache.size], cache.slot_ids[: cache.size], pending, kind, miss_ids, times, whole
        )

        def finish() -> CacheUpdate:
            fetched = parts.fetched
            if runtime.trace is not None:
                runtime.trace.record(runtime.step_start, layer, kind, ids)
            selection = None if fused is None else units  # the buffers `ids` and `miss_ids` are views of
            return CacheUpdate(cache, ids, miss_ids, fetched.matrix, runtime.step_start, selection)

        return Selected(mask, coef), parts, finish

    def _guess_next_layer(self, x: torch.Tensor, buffer: int) -> float:
        """Start reading the input units the next layer would select for this layer's input `x`, into the
        staging buffer this layer does not use (DIP's layer-ahead read). The residual stream changes
        little from one layer to the next, so most of them will be selected there (and with cache-aware
        selection, the units read this way count as resident, which pulls the selection towards them).
        Returns the seconds spent handing the read to the runtime (its lookup, where not fused with the
        selection, and submission)."""
        runtime, following = self.runtime, self.layer + 1
        if following == runtime.num_layers:
            return 0.0  # the next token's first layer sees a new embedding: nothing to guess from
        runtime.settle(following, self.INPUT_KIND)
        cache = runtime.caches[(following, self.INPUT_KIND)]
        topk, guess_units = self.input_topk(), runtime.guess_units.get(self.INPUT_KIND)
        if topk is not None and guess_units is not None:
            units = guess_units[buffer]  # unchanged until the guess after next, when its layer has run
            fused = units(x, topk.k, cache.slot_of, self._fused_gamma(topk, self.INPUT_KIND))
            if fused is not None:
                started = perf_counter()
                runtime.guess_uncached(
                    following, self.INPUT_KIND, fused.misses, buffer, fused.mask, span=units.miss_ids
                )
                return perf_counter() - started
        mask = self.select_input(x, self._residency(cache, self.INPUT_KIND))
        ids = runtime.unit_ids[: cache.num_units] if mask is None else union_ids(mask)
        started = perf_counter()
        runtime.guess(following, self.INPUT_KIND, ids, buffer)
        return perf_counter() - started

    def _sequential_stage(self, kind, cache: NeuronCache, select, values: torch.Tensor, times: StageTimes):
        """Read the whole matrix, then select and update the cache token by token, as decoding would."""
        runtime, layer = self.runtime, self.layer
        all_ids = runtime.unit_ids[: cache.num_units]
        runtime.drain()  # a read ahead may be filling the staging buffer this read uses
        started = perf_counter()
        fetched = runtime.read(layer, kind, all_ids).to(cache.rows.device)
        read_done = perf_counter()
        times.io_s += read_done - started
        times.io_busy_s += fetched.busy_s
        times.bytes_read += fetched.bytes_read
        times.reads += fetched.reads
        depends = self._cache_aware(kind)
        mask = None if depends else select(values, self._residency(cache, kind))
        every = torch.ones(cache.num_units, dtype=torch.bool)
        token_masks = []
        for t in range(values.shape[0]):
            if depends:
                token_mask = select(values[t : t + 1], self._residency(cache, kind))[0]
                token_masks.append(token_mask)
            else:
                token_mask = every if mask is None else mask[t]
            ids = token_mask.nonzero().squeeze(1)
            miss_ids = cache.find_misses(ids)
            cache.update(ids, miss_ids, fetched.matrix, runtime.step_start + t, by_unit=True)
            if runtime.trace is not None:
                runtime.trace.record(runtime.step_start + t, layer, kind, ids)
        times.update_s += perf_counter() - read_done
        if depends:
            mask = torch.stack(token_masks)
        self._count_used(times, kind, cache, values.shape[0], mask)
        return Selected(mask), [(fetched.matrix, all_ids, None)], lambda: None  # updated token by token above

    def _count_used(
        self,
        times: StageTimes,
        kind: str,
        cache: NeuronCache,
        tokens: int,
        mask: torch.Tensor | None,
        ids: torch.Tensor | None = None,
    ) -> None:
        """Add the bytes of the (token, unit) pairs a stage used to `times.used_bytes`: every unit of
        every token without a mask (`ids`: the mask's `union_ids`, if the caller has them)."""
        pairs = tokens * cache.num_units if mask is None else kept_pairs(mask, ids)
        times.used_bytes += pairs * self._row_bytes[kind]

    def _cache_aware(self, kind: str) -> bool:
        """Whether the selection of `kind` units weighs their residency (DIP-CA's `gamma`). Not for a kind
        read ahead whole: it reads every unit not resident whatever the mask, so preferring resident
        units there would cost accuracy and save no read."""
        return self.gamma < 1 and kind not in self.runtime.read_ahead

    def _fused_gamma(self, topk: TopK | None, kind: str) -> float:
        """The cache-aware weight a fused top-k selection (`TopUnits`) of `kind` units applies: 1.0 (none)
        unless that selection is cache-aware."""
        return topk.gamma if topk is not None and self._cache_aware(kind) else 1.0

    def _residency(self, cache: NeuronCache, kind: str) -> torch.Tensor | None:
        """The residency mask of `kind`'s cache, for a cache-aware selection only (None otherwise: not
        computed)."""
        return cache.slot_of >= 0 if self._cache_aware(kind) else None

    # ---- shared arithmetic --------------------------------------------------------------------

    def _columns(self, coef: torch.Tensor, parts: Parts) -> torch.Tensor:
        """`coef @ W` where unit i is row i of W: an input column of the projection, summed over the kept
        units in fp32 (`coef`, fp32, is indexed by unit id, never gathered; zero coefficients cost
        nothing)."""
        width = self._row_width(parts)
        product = self._product(width)
        out = coef.new_zeros(coef.shape[0], width)
        in_unit_order = isinstance(parts, _Parts) and parts.whole is not None  # one part: every unit
        for rows, ids, index in parts:
            product(out, coef, rows, index, None if in_unit_order else ids)
        return out

    def _token_columns(
        self, coef: torch.Tensor, parts: Parts, dtype: torch.dtype, *, glu: bool
    ) -> torch.Tensor | None:
        """`_columns(coef, parts)` rounded to `dtype` (with `glu`: DIP's `up * act(gate)` of its two
        halves) for one decode token, in C calls (`TokenColumns`) where torch would run five to seven
        operators; None where those cannot serve (another dtype, another activation, torch's product
        measured faster here), and torch's path computes it."""
        if not isinstance(parts, _Parts) or parts.whole is not None:
            return None
        token = self.runtime.token_columns.get(parts.kind)
        rows, ids = parts.cached
        if (
            token is None
            or token.dtype != dtype
            or not token.serves(coef, rows)
            or (glu and not is_silu(self.act))
            or self._product(token.width).decode != "native"
        ):
            return None
        if not parts.miss_ids.numel():
            return token.result(coef, rows, ids, start=True, glu=glu)
        token.add(coef, rows, ids, start=True)  # the cached rows, while the read finishes
        fetched = parts.fetched
        return token.result(coef, fetched.matrix, fetched.ids, fetched.ids, start=False, glu=glu)

    @staticmethod
    def _row_width(parts: Parts) -> int:
        if isinstance(parts, _Parts):
            return parts.cached[0].shape[1]
        return parts[0][0].shape[1]

    def _bundled(
        self, x: torch.Tensor, a: torch.Tensor, mask: torch.Tensor, parts: Parts, other_act: Callable
    ) -> torch.Tensor:
        """Stage 2 over bundles (row j of the other projection | down column j): the sum over kept j
        of `a_j * other_act(row_j · x) * down_j`."""
        d = self.d_model
        product, row_product = self._product(d), self._row_product(d)
        out = x.new_zeros(x.shape[0], d, dtype=torch.float32)
        for rows, ids, index in parts:
            other = row_product(x, rows[:, :d], index)
            coef = (a[:, ids] * other_act(other) * mask[:, ids]).float()
            product(out, coef, rows[:, d:], index)
        return out.to(x.dtype)

    @staticmethod
    def _rows(x: torch.Tensor, parts: Parts, num_units: int) -> torch.Tensor:
        """`x @ W.T` where unit j is row j of W (an output row of the projection): placed by unit id."""
        out = x.new_empty(x.shape[0], num_units)
        for rows, ids, index in parts:
            out[:, ids] = F.linear(x, rows if index is None else rows.index_select(0, index))
        return out


@register_method("dip")
class DIPMLP(DIPSelection, SparseMLP):
    """Dynamic Input Pruning (eqs. 7-8), cache-aware with `gamma < 1` (eq. 10, Algorithm 1).

    `k_in` input columns of up/gate per token (or those above `input_threshold`, for the paper's
    per-layer and global thresholds), then `k_out` down columns by the pruned GLU's magnitude.
    """

    INPUT_KIND = "dip_in"
    OUTPUT_KIND = "dip_down"
    COLUMN_KINDS = ("dip_in", "dip_down")
    OPTIONS = ("input_density", "cache_aware", "threshold")

    def row_products_needed(self) -> tuple[int, ...]:
        return ()  # every product of DIP's is a column product

    def column_products_needed(self) -> dict[int, float]:
        # a dip_in row (up and gate columns), a down column
        kept_inputs = self.k_in / self.d_model if self.k_in else 1.0  # the GLU oracle keeps every input
        return {2 * self.d_ff: kept_inputs, self.d_model: self.k_out / self.d_ff}

    def __init__(self, *args, k_in: int, input_threshold: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.k_in = k_in
        self.input_threshold = input_threshold

    @classmethod
    def guesses(cls, config: FlashConfig, read_ahead: tuple[str, ...]) -> bool:
        # Only DIP-CA guesses: plain DIP's selection does not count guessed units as resident, so it reads
        # whatever the guess missed besides every guessed unit it does not select (Qwen2.5-1.5B at 50%:
        # 1.10 against 0.88 GB per token, and 14-30% fewer tokens/s than without the guess).
        return config.cache_aware < 1 and config.read_ahead is not False and cls.INPUT_KIND not in read_ahead

    def extra_repr(self) -> str:
        threshold = "" if self.input_threshold is None else f", input_threshold={self.input_threshold:.4g}"
        return f"{super().extra_repr()}, k_in={self.k_in}{threshold}"

    def compute_input(self, x: torch.Tensor, selected: Selected, parts: Parts) -> torch.Tensor:
        coef = selected.coefficients(x)
        if (a := self._token_columns(coef, parts, x.dtype, glu=True)) is not None:
            return a
        # dip_in row i: up[:, i] | gate[:, i]; rounded to the model's dtype as its projections are
        up_gate = self._columns(coef, parts).to(x.dtype)
        return up_gate[:, : self.d_ff] * self.act(up_gate[:, self.d_ff :])

    def compute_output(
        self, x: torch.Tensor, a: torch.Tensor, selected: Selected, parts: Parts
    ) -> torch.Tensor:
        coef = selected.coefficients(a)
        if (out := self._token_columns(coef, parts, x.dtype, glu=False)) is not None:
            return out
        return self._columns(coef, parts).to(x.dtype)


@register_method("glu")
class GLUPruningMLP(GLUSelection, DIPMLP):
    """GLU pruning, the oracle (eq. 4): the full GLU from every up/gate column, top-k down columns."""

    OPTIONS = ()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, k_in=0, **kwargs)


class WholeFirstStage:
    """Mixin of the methods that read one projection whole every token (a third of the MLP): the
    density must leave something to prune after it."""

    method: ClassVar[str]
    INPUT_KIND: ClassVar[str]

    @classmethod
    def check_density(cls, density: float) -> None:
        if not density > 1 / 3:
            raise ConfigError(
                f"method={cls.method!r} reads the whole {cls.INPUT_KIND} projection (a third of the MLP) "
                f"every token: density must be above 1/3, got {density}."
            )


@register_method("up")
class UpPruningMLP(WholeFirstStage, SparseMLP):
    """Up pruning (eq. 5 with up for gate): the full `up x`; its top-k picks gate rows and down columns."""

    INPUT_KIND = "up"
    OUTPUT_KIND = "gate_down"

    def compute_input(self, x: torch.Tensor, selected: Selected, parts: Parts) -> torch.Tensor:
        return self._rows(x, parts, self.d_ff)

    def compute_output(
        self, x: torch.Tensor, a: torch.Tensor, selected: Selected, parts: Parts
    ) -> torch.Tensor:
        return self._bundled(x, a, selected.mask, parts, self.act)  # gate_down row j: gate[j, :] | down[:, j]


@register_method("gate")
class GatePruningMLP(WholeFirstStage, SparseMLP):
    """Gate pruning (eq. 5): the full `act(gate x)`; its top-k picks up rows and down columns."""

    INPUT_KIND = "gate"
    OUTPUT_KIND = "up_down"

    def compute_input(self, x: torch.Tensor, selected: Selected, parts: Parts) -> torch.Tensor:
        return self.act(self._rows(x, parts, self.d_ff))

    def compute_output(
        self, x: torch.Tensor, a: torch.Tensor, selected: Selected, parts: Parts
    ) -> torch.Tensor:
        return self._bundled(x, a, selected.mask, parts, _identity)  # up_down row j: up[j, :] | down[:, j]


@register_method("cats")
class CATSMLP(CATSSelection, GatePruningMLP):
    """CATS: gate pruning by a per-layer threshold on |act(gate x)|, calibrated from its distribution."""

    def __init__(self, *args, threshold: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threshold = threshold

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, threshold={self.threshold:.4g}"


def build_sparse_mlp(
    config: FlashConfig,
    layer: int,
    runtime: FlashRuntime,
    act: nn.Module,
    *,
    calibration: Calibration | None,
    dense_class: type[nn.Module] | None = None,
) -> SparseMLP:
    """The module of `config.method` for one layer, its unit counts derived from `config.density`.
    (`SparseMLP.build` then has it measure its column products: `SparseMLP.measure_products`.)

    Raises `CalibrationMissingError` when the method needs thresholds that were never calibrated.
    """
    store = runtime.store
    cls = method_class(config.method)
    options = selection_options(config, layer, store.d_model, store.d_ff, calibration, store.path)
    return cls(
        layer, runtime, act, d_model=store.d_model, d_ff=store.d_ff, dense_class=dense_class, **options
    )


READ_AHEAD_MIN_COST = 0.7
"""Read ahead when a read of only the needed units would cost the disk at least this share of the time a
read of every uncached unit takes (`merged_read_cost`). Measured at a 50% budget (`benchmarks/alternate.py`,
DIP across this VM's 72 KiB merge gap, reading ahead against on demand): Qwen2.5-1.5B's 35 KiB input
columns at ρ_in 0.3 (cost 0.66) 0.87x as fast, 0.35 (0.73) 0.98x, 0.4 (0.79) 1.02x, 0.45 (0.84) 1.13x,
0.6 (0.94) 1.4x; SmolLM2's 6 KiB ones at ρ_in 0.05 (0.49) 0.70x, 0.1 (0.75) 1.13x, 0.2 (0.95) 1.58x, 0.3
(0.99) 2.17x."""


def reads_ahead(
    config: FlashConfig,
    store: Store,
    calibration: Calibration | None,
    merge_gap_bytes: int = DEFAULT_MERGE_GAP_BYTES,
) -> bool:
    """Whether the first stage reads every uncached unit of the next layer a layer ahead (`read_ahead`).

    Methods whose first stage needs every unit always do: nothing read is wasted. DIP needs only
    ρ_in of its input columns, but a read of only those costs the disk more than their bytes: its reader
    reads across gaps of up to `merge_gap_bytes` (the disk profile's, `FlashRuntime.disk`), and each run
    is a request that costs as much as such a gap (`merged_read_cost`). Read on demand, that read stalls
    the layer after its selection; read ahead whole, it runs while the layer before computes, in one run.
    So DIP reads ahead where on demand would cost at least `READ_AHEAD_MIN_COST` of the time anyway. (At
    ρ_in 0.6 across a 72 KiB gap: SmolLM2's 6 KiB input columns 1.00, Qwen2.5-1.5B's 35 KiB ones 0.94.)
    """
    if config.read_ahead is not None:
        return config.read_ahead
    if config.method != "dip":
        return True
    rho_in, _ = dip_split(config, calibration, store.path)
    row_bytes = store.row_file(0, DIPMLP.INPUT_KIND).row_bytes
    cost = merged_read_cost(rho_in, row_bytes, merge_gap_bytes)
    ahead = cost >= READ_AHEAD_MIN_COST
    logger.info(
        "flashlm: DIP reads its uncached input columns %s: at ρ_in %.2f a read of only the needed ones "
        "would cost the disk %.0f%% of the time of reading them all (merge gap %d KiB, columns of %d bytes)",
        "ahead, every one" if ahead else "when needed",
        rho_in,
        100 * cost,
        merge_gap_bytes // 1024,
        row_bytes,
    )
    return ahead
