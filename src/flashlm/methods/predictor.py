"""Predictor-based neuron loading (LLM in a flash §3.1, PowerInfer §5): a low-rank predictor per layer
reads the MLP's input and names the neurons the token will activate; only their bundles are read.

A neuron's bundle (the store's `bundle` kind) is its gate row, up row and down column side by side
(up row and down column in a plain MLP), so one read brings everything one neuron needs (LLM in a
flash §3.2). The bundles pass through the layer's cache like any unit; with `policy="window"` and
`window=k` the cache keeps the neurons the last k tokens used and each token loads only those it
adds (LLM in a flash §3.1's sliding window). A forward of many tokens (prefill) reads the union of
their predicted neurons and computes each token with its own mask. With `read_ahead=True`, while a
decode step computes a layer the reads of the next layer's neurons start: those the next layer's
predictor names for this layer's input, most of which it will name for its own.

A neuron the predictor misses contributes nothing; where the activation is ReLU-like (exactly zero
below a threshold) a neuron it rightly skips contributes nothing either, so the method is exact on
the neurons it predicts. The model's activation must be ReLU-like: relufy a SwiGLU model first
(`flashlm train relufy`). `density` caps the neurons kept per token (the highest logits among the
predicted ones); at 1.0 every method is dense streaming.

`method="predictor-gate"` reads in two rounds instead, for gated models: the gate rows of the predicted
neurons first (a third of their bundles), then the up row and down column (`up_down`) of only those
whose activation `act(gate_j x)` is nonzero. A predicted neuron that does not fire costs a gate row,
not a bundle; the price is a second read that waits on the first. Both compute the same sum over the
same neurons (in another order: results agree to rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from ..cache import NeuronCache
from ..engine.runtime import CacheUpdate, FlashRuntime, Guess
from ..engine.stats import StageTimes
from ..errors import ConfigError
from ..ops import ColumnProduct, RowProduct
from ..predictors import PREDICTORS_FILE, Predictors
from .base import register_method
from .masking import kept_pairs, union_ids
from .mlp import FlashMLP, require_gate
from .selection import PredictorSelection, selection_options

if TYPE_CHECKING:
    from ..config import FlashConfig
    from ..store import Store

BUNDLE = "bundle"
GATE, UP_DOWN = "gate", "up_down"


def zeroes_negatives(act: nn.Module) -> bool:
    """Whether `act` is ReLU-like: exactly zero on negative inputs (ReLU, FATReLU), so a neuron whose
    pre-activation is below zero contributes exactly nothing."""
    probe = torch.tensor([-4.0, -1.0, -1e-3])
    with torch.no_grad():
        return bool((act(probe) == 0).all())


class PredictedNeuronsMLP(PredictorSelection, FlashMLP):
    """What the predictor methods share: the layer's predictor, how they are built and loaded. A subclass
    names its unit kinds and reads them in its `forward`.

    Args (beyond `FlashMLP`'s): `predictor`: the layer's `LowRankPredictor` (a submodule: `.to()`
    moves it); `k_max`: neurons kept per token at most; `down_density`: the share of the neurons whose
    down columns it sums that have a nonzero coefficient (to measure that product for);
    `up_bias`, `down_bias`: a plain MLP's biases.
    """

    FITTED_FILES = (PREDICTORS_FILE,)
    SUMS_ONLY_FIRING: bool
    """Whether the down columns summed are only those of neurons that fire (else of every predicted one:
    the predictor's precision says how many have nonzero coefficients)."""
    READ_SHARE: float
    """The share of a predicted neuron's MLP weights the method reads for it, fired or not (what sizing
    predictors for it weighs: `TrainOptions.read_share`)."""

    def __init__(
        self,
        layer: int,
        runtime: FlashRuntime,
        act: nn.Module,
        predictor: nn.Module,
        *,
        gated: bool,
        d_model: int,
        d_ff: int,
        k_max: int,
        down_density: float = 1.0,
        up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        dense_class: type[nn.Module] | None = None,
    ) -> None:
        super().__init__(
            layer, runtime, act, gated=gated, d_model=d_model, d_ff=d_ff, dense_class=dense_class
        )
        self.predictor = predictor
        self.k_max = k_max
        self.register_buffer("up_bias", up_bias, persistent=False)
        self.register_buffer("down_bias", down_bias, persistent=False)
        self._row_bytes = {kind: runtime.store.row_file(layer, kind).row_bytes for kind in self.KINDS}
        dtype = runtime.store.dtype
        self.down_product = ColumnProduct.measure(dtype, d_model, down_density)
        """How `sum_j coef_j down_j` is computed over rows where they lie (`ColumnProduct`)."""
        self.input_product = RowProduct.measure(dtype, d_model, k_max // 2)
        """How gate and up rows are dotted with the tokens where they lie (`RowProduct`), for calls of
        about half the kept neurons (the hits, then the misses)."""
        self.guesses_ahead = runtime.config.read_ahead is True
        """Whether a decode step starts reading, a layer ahead, the first-round units the next layer's
        predictor names for this layer's input (`_guess_ahead`). Opt-in (`FlashConfig.read_ahead`):
        it paid on relufied SmolLM2, whose small reads wait on latency, and lost on relufied Qwen2.5-1.5B,
        where the second predictor evaluation and the wrongly guessed rows cost more than it saved."""
        if self.guesses_ahead:
            runtime.selections[layer] = self.select

    # ---- how the engine builds it -----------------------------------------------------------

    @classmethod
    def load_fitted(cls, store: Store, *, device: torch.device) -> Predictors:
        return Predictors.load(store, device=device)

    @classmethod
    def make_runtime(cls, store: Store, config: FlashConfig, fitted: Any) -> FlashRuntime:
        return FlashRuntime(
            store,
            config,
            cls.KINDS,
            read_ahead=(),
            fitted_files=cls.FITTED_FILES,
            fitted_bytes=fitted.nbytes,
            cache_split=cls.CACHE_SPLIT,
        )

    @classmethod
    def build(
        cls,
        layer: int,
        runtime: FlashRuntime,
        act: nn.Module,
        *,
        fitted: Predictors,
        dense_class: type[nn.Module] | None,
    ) -> PredictedNeuronsMLP:
        store = runtime.store
        if not zeroes_negatives(act):
            raise ConfigError(
                f"method={runtime.config.method!r} skips the neurons a predictor expects to be zero, but "
                f"layer {layer}'s activation ({type(act).__name__}) is not zero below 0, so skipping them "
                "changes the output. Relufy the model first (`flashlm train relufy`), or use method='dip'."
            )
        resident = store.resident(layer)
        precision = fitted.reports[layer].precision if layer < len(fitted.reports) else 1.0
        return cls(
            layer,
            runtime,
            act,
            fitted[layer],
            gated=store.gated,
            d_model=store.d_model,
            d_ff=store.d_ff,
            **selection_options(runtime.config, layer, store.d_model, store.d_ff, None),
            down_density=1.0 if cls.SUMS_ONLY_FIRING else precision,
            up_bias=resident.get("up_bias"),
            down_bias=resident.get("down_bias"),
            dense_class=dense_class,
        )

    @torch.no_grad()
    def reset_state(self) -> None:
        """Also the predictor's weights, read once from beside the store (checked against it at patching,
        where they were built on the meta device) into the loader's placeholders."""
        super().reset_state()
        prefix = f"layers.{self.layer}."
        with safe_open(str(self.runtime.store.path / PREDICTORS_FILE), framework="pt", device="cpu") as saved:
            names = [name for name in saved.keys() if name.startswith(prefix)]  # noqa: SIM118 (not a dict)
            self.predictor.load_state_dict({name[len(prefix) :]: saved.get_tensor(name) for name in names})

    def own_state_keys(self) -> list[str]:
        return [f"predictor.{key}" for key in self.predictor.state_dict()]

    def extra_repr(self) -> str:
        capacities = ", ".join(str(cache.capacity) for cache in self.caches())
        return (
            f"layer={self.layer}, d_model={self.d_model}, d_ff={self.d_ff}, k_max={self.k_max}, "
            f"capacity=({capacities})"
        )

    # ---- what both forwards do ----------------------------------------------------------------

    def _timed_select(self, x: torch.Tensor, times: StageTimes) -> torch.Tensor:
        started = perf_counter()
        mask = self.select(x)
        times.select_s += perf_counter() - started
        return mask

    def _taken_guess(self, kind: str) -> Guess | None:
        """What the layer before read for this layer's first round (`_guess_ahead`), if anything."""
        return self.runtime.take_guess(self.layer, kind) if self.guesses_ahead else None

    def _guess_ahead(self, x: torch.Tensor, kind: str, taken: Guess | None) -> Callable[[], float] | None:
        """For one token, the start of the next layer's guess: a read of the units of `kind` the next
        layer's predictor names for `x`, into the staging buffer this layer's first round does not use.
        The residual stream changes little from one layer to the next, so most of them will be named
        there (DIP's layer-ahead read; DejaVu's observation that activations can be predicted a layer
        early). A guess only reads early: a layer computes what its own predictor names. The callable
        returns the seconds it spent looking the units up and submitting their read."""
        if not self.guesses_ahead or x.shape[0] != 1:
            return None
        following = self.layer + 1
        select = self.runtime.selections.get(following)
        if select is None:  # the last layer: the next token's first layer sees a new embedding
            return None
        buffer = 1 - (0 if taken is None else taken.buffer)

        def guess() -> float:
            ids = union_ids(select(x))
            started = perf_counter()
            self.runtime.guess(following, kind, ids, buffer)
            return perf_counter() - started

        return guess

    def _round(
        self,
        kind: str,
        cache: NeuronCache,
        ids: torch.Tensor,
        compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        times: StageTimes,
        *,
        taken: Guess | None = None,
        then: Callable[[], float] | None = None,
    ) -> CacheUpdate:
        """Look up and read the units `ids` of `kind`, calling `compute(rows, ids, index)` on the cached ones
        (overlapping the read) and then on the read ones, the row of unit `ids[k]` being `rows[index[k]]`.
        Returns the cache's update (`FlashRuntime.update_caches`).

        `taken`: the guess the layer before read for this round (`_taken_guess`), completed by the
        read. `then` runs once the read is submitted (the next layer's guess, `_guess_ahead`, which
        the I/O thread then reads after it)."""
        runtime, layer = self.runtime, self.layer
        runtime.settle(layer, kind)
        started = perf_counter()
        hit_ids, hit_slots, miss_ids = cache.lookup(ids)
        looked_up = perf_counter()
        if taken is None:
            pending = runtime.submit(layer, kind, miss_ids)
        else:
            pending = runtime.submit_after(taken, *taken.completion(miss_ids))
        submitted = perf_counter()
        guess_submit_s = then() if then is not None else 0.0
        guessed = perf_counter()
        if hit_ids.numel():
            compute(cache.rows, hit_ids, hit_slots)
        waiting = perf_counter()
        fetched = pending.result().to(ids.device)
        read = perf_counter()
        if miss_ids.numel():
            compute(fetched.matrix, miss_ids, miss_ids)  # the staging rows are by unit
        done = perf_counter()
        times.lookup_s += looked_up - started
        # the guess's selection is a selection, its lookup and read's submission a submission
        times.submit_s += submitted - looked_up + guess_submit_s
        times.select_s += guessed - submitted - guess_submit_s
        times.io_s += read - waiting
        times.compute_s += (waiting - guessed) + (done - read)
        times.io_busy_s += fetched.busy_s
        times.bytes_read += fetched.bytes_read
        times.reads += fetched.reads
        if runtime.trace is not None:
            runtime.trace.record(runtime.step_start, layer, kind, ids)
        return CacheUpdate(cache, ids, miss_ids, fetched.matrix, runtime.step_start)

    def _finish(
        self,
        updates: list[CacheUpdate],
        tokens: int,
        before: tuple[int, int, int],
        times: StageTimes,
    ) -> None:
        """Run or queue the caches' `updates` (`FlashRuntime.update_caches`) and record the forward's
        counters and times."""
        updating = perf_counter()
        self.runtime.update_caches(self.layer, self.KINDS, updates)
        times.update_s += perf_counter() - updating
        hits, misses, evictions = (now - then for now, then in zip(self.counters(), before, strict=True))
        self.runtime.stats.record(
            self.layer,
            tokens=tokens,
            hits=hits,
            misses=misses,
            evictions=evictions,
            dense_bytes=tokens * self.runtime.layer_mlp_bytes,
            **vars(times),
        )


@register_method("predictor")
class PredictorMLP(PredictedNeuronsMLP):
    """Reads the bundles of the neurons a layer's low-rank predictor names (see the module docstring)."""

    KINDS = (BUNDLE,)
    SUMS_ONLY_FIRING = False
    READ_SHARE = 1.0  # the whole bundle

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bundle_cache = self.runtime.make_cache(self.layer, BUNDLE)

    # ---- the forward ------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self._tokens_of(hidden_states)
        before, times = self.settled_counters(), StageTimes()
        mask = self._timed_select(x, times)
        out = x.new_zeros(x.shape[0], self.d_model, dtype=torch.float32)

        def bundles(rows: torch.Tensor, ids: torch.Tensor, index: torch.Tensor) -> None:
            self._bundles(out, x, mask, rows, ids, index)

        taken = self._taken_guess(BUNDLE)
        ahead = self._guess_ahead(x, BUNDLE, taken)
        ids = union_ids(mask)
        update = self._round(BUNDLE, self.bundle_cache, ids, bundles, times, taken=taken, then=ahead)
        if self.down_bias is not None:
            out += self.down_bias
        times.used_bytes += kept_pairs(mask, ids) * self._row_bytes[BUNDLE]
        self._finish([update], x.shape[0], before, times)
        return out.to(hidden_states.dtype).reshape(hidden_states.shape)

    def _bundles(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        mask: torch.Tensor,
        rows: torch.Tensor,
        ids: torch.Tensor,
        index: torch.Tensor,
    ) -> None:
        """Add to the float32 `out` `[T, d_model]` the output of the neurons `ids`, whose bundles are
        `rows[index]`, each token's own masked out: `sum_j m_tj act(gate_j x) (up_j x) down_j`, or
        `sum_j m_tj act(up_j x + b_j) down_j`. Every row is used where it lies (no gather where the
        measured products allow)."""
        if ids.numel() == 0:
            return
        d = self.d_model
        first = self.input_product(x, rows[:, :d], index)  # gate rows (gated) or up rows
        if self.gated:
            hidden = self.act(first) * self.input_product(x, rows[:, d : 2 * d], index)
        else:
            hidden = self.act(first if self.up_bias is None else first + self.up_bias[ids])
        self.down_product(out, (hidden * mask[:, ids]).float(), rows[:, -d:], index)


@register_method("predictor-gate")
class PredictedGatesMLP(PredictedNeuronsMLP):
    """Reads the gate rows of the neurons a layer's predictor names, then the up row and down column of
    those that fire (see the module docstring): two caches, one of gate rows, one of `up_down` rows."""

    KINDS = (GATE, UP_DOWN)
    SUMS_ONLY_FIRING = True
    READ_SHARE = 1 / 3  # the gate row of gate | up | down
    CACHE_SPLIT = "profile"  # a gate row is used several times as often as an up_down row

    @classmethod
    def check_store(cls, store: Store, config: FlashConfig) -> None:
        require_gate(store, config.method, "reads the predicted neurons' gate rows first", "predictor")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate_cache = self.runtime.make_cache(self.layer, GATE)
        self.up_down_cache = self.runtime.make_cache(self.layer, UP_DOWN)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self._tokens_of(hidden_states)
        tokens, d = x.shape[0], self.d_model
        before, times = self.settled_counters(), StageTimes()
        predicted = self._timed_select(x, times)
        gate = x.new_zeros(tokens, self.d_ff)

        def gates(rows: torch.Tensor, ids: torch.Tensor, index: torch.Tensor) -> None:
            gate[:, ids] = self.act(self.input_product(x, rows, index))

        taken = self._taken_guess(GATE)
        gate_ids = union_ids(predicted)
        update_gates = self._round(GATE, self.gate_cache, gate_ids, gates, times, taken=taken)
        # A neuron predicted for one token only counts for that token; one that does not fire (its
        # activation exactly zero) contributes nothing, and its up row and down column are not read.
        hidden = gate * predicted
        firing = hidden != 0
        out = x.new_zeros(tokens, d, dtype=torch.float32)

        def up_downs(rows: torch.Tensor, ids: torch.Tensor, index: torch.Tensor) -> None:
            up = self.input_product(x, rows[:, :d], index)
            self.down_product(out, (hidden[:, ids] * up).float(), rows[:, d:], index)

        # the next layer's gate rows are read after this round's up_down rows, which this layer waits for
        ahead = self._guess_ahead(x, GATE, taken)
        firing_ids = union_ids(firing)
        update_up_downs = self._round(UP_DOWN, self.up_down_cache, firing_ids, up_downs, times, then=ahead)
        if self.down_bias is not None:
            out += self.down_bias
        times.used_bytes += (
            kept_pairs(predicted, gate_ids) * self._row_bytes[GATE]
            + kept_pairs(firing, firing_ids) * self._row_bytes[UP_DOWN]
        )
        # The gate cache's update may wait past the second round: it copies from the gate kind's
        # staging matrix, which no read reuses before the next layer's forward (its guess reads into
        # the other one).
        self._finish([update_gates, update_up_downs], tokens, before, times)
        return out.to(hidden_states.dtype).reshape(hidden_states.shape)
