"""Predictor-based neuron loading (LLM in a flash §3.1, PowerInfer §5): a low-rank predictor per layer
reads the MLP's input and names the neurons the token will activate; only their bundles are read.

A neuron's bundle (the store's `bundle` kind) is its gate row, up row and down column side by side
(up row and down column in a plain MLP), so one read brings everything one neuron needs (LLM in a
flash §3.2). The bundles pass through the layer's cache like any unit; with `policy="window"` and
`window=k` the cache keeps the neurons the last k tokens used and each token loads only those it
adds (LLM in a flash §3.1's sliding window). A forward of many tokens (prefill) reads the union of
their predicted neurons and computes each token with its own mask.

A neuron the predictor misses contributes nothing; where the activation is ReLU-like (exactly zero
below a threshold) a neuron it rightly skips contributes nothing either, so the method is exact on
the neurons it predicts. The model's activation must be ReLU-like: relufy a SwiGLU model first
(`flashlm train relufy`). `density` caps the neurons kept per token (the highest logits among the
predicted ones); at 1.0 every method is dense streaming.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from ..engine.runtime import FlashRuntime
from ..errors import ConfigError
from ..ops import ColumnProduct, RowProduct
from ..predictors import PREDICTORS_FILE, Predictors
from .base import register_method
from .masking import union_ids
from .mlp import FlashMLP
from .selection import PredictorSelection, selection_options

if TYPE_CHECKING:
    from ..config import FlashConfig
    from ..store import Store

BUNDLE = "bundle"


def zeroes_negatives(act: nn.Module) -> bool:
    """Whether `act` is ReLU-like: exactly zero on negative inputs (ReLU, FATReLU), so a neuron whose
    pre-activation is below zero contributes exactly nothing."""
    probe = torch.tensor([-4.0, -1.0, -1e-3])
    with torch.no_grad():
        return bool((act(probe) == 0).all())


@register_method("predictor")
class PredictorMLP(PredictorSelection, FlashMLP):
    """Reads the bundles of the neurons a layer's low-rank predictor names (see the module docstring).

    Args (beyond `FlashMLP`'s): `predictor`: the layer's `LowRankPredictor` (a submodule: `.to()`
    moves it); `k_max`: neurons kept per token at most; `up_bias`, `down_bias`: a plain MLP's biases.
    """

    KINDS = (BUNDLE,)
    FITTED_FILES = (PREDICTORS_FILE,)

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
        self.bundle_cache = runtime.make_cache(layer, BUNDLE)
        self.register_buffer("up_bias", up_bias, persistent=False)
        self.register_buffer("down_bias", down_bias, persistent=False)
        self._row_bytes = runtime.store.row_file(layer, BUNDLE).row_bytes
        self.down_product = ColumnProduct.measure(self.bundle_cache.rows.dtype, d_model, down_density)
        """How `sum_j coef_j down_j` is computed over bundles where they lie (`ColumnProduct`), measured
        for the share of predicted neurons that fire (`down_density`: the predictor's precision)."""
        self.input_product = RowProduct.measure(self.bundle_cache.rows.dtype, d_model, k_max // 2)
        """How a bundle's gate and up rows are dotted with the tokens where they lie (`RowProduct`), for
        calls of about half the kept neurons (the hits, then the misses)."""

    # ---- how the engine builds it -----------------------------------------------------------

    @classmethod
    def load_fitted(cls, store: Store, *, device: torch.device) -> Predictors:
        return Predictors.load(store, device=device)

    @classmethod
    def make_runtime(cls, store: Store, config: FlashConfig, fitted: Any) -> FlashRuntime:
        return FlashRuntime(
            store, config, cls.KINDS, read_ahead=(), fitted_files=cls.FITTED_FILES, fitted_bytes=fitted.nbytes
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
    ) -> PredictorMLP:
        store = runtime.store
        if not zeroes_negatives(act):
            raise ConfigError(
                f"method='predictor' skips the neurons a predictor expects to be zero, but layer {layer}'s "
                f"activation ({type(act).__name__}) is not zero below 0, so skipping them changes the "
                "output. Relufy the model first (`flashlm train relufy`), or use method='dip'."
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
            down_density=precision,
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
        return (
            f"layer={self.layer}, d_model={self.d_model}, d_ff={self.d_ff}, k_max={self.k_max}, "
            f"capacity={self.bundle_cache.capacity}"
        )

    # ---- the forward ------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        runtime, cache, layer = self.runtime, self.bundle_cache, self.layer
        x = self._tokens_of(hidden_states)
        tokens = x.shape[0]
        started = perf_counter()
        mask = self.select(x)
        ids = union_ids(mask)
        selected = perf_counter()
        runtime.settle(layer, BUNDLE)
        hit_ids, hit_slots, miss_ids = cache.lookup(ids)
        looked_up = perf_counter()
        pending = runtime.submit(layer, BUNDLE, miss_ids)
        submitted = perf_counter()

        out = x.new_zeros(tokens, self.d_model, dtype=torch.float32)
        self._bundles(out, x, mask, cache.rows, hit_ids, hit_slots)
        waiting = perf_counter()
        fetched = pending.result().to(x.device)
        read = perf_counter()
        self._bundles(out, x, mask, fetched.matrix, miss_ids, miss_ids)  # the staging rows are by unit
        if self.down_bias is not None:
            out += self.down_bias
        done = perf_counter()

        step = runtime.step_start
        runtime.update_later(
            layer, (BUNDLE,), lambda: cache.update(ids, miss_ids, fetched.matrix, step, by_unit=True)
        )
        if runtime.trace is not None:
            runtime.trace.record(step, layer, BUNDLE, ids)
        updated = perf_counter()
        runtime.stats.record(
            layer,
            tokens=tokens,
            bytes_read=fetched.bytes_read,
            reads=fetched.reads,
            hits=hit_ids.numel(),
            misses=miss_ids.numel(),
            used_bytes=int(mask.sum()) * self._row_bytes,
            dense_bytes=tokens * runtime.layer_mlp_bytes,
            select_s=selected - started,
            lookup_s=looked_up - selected,
            submit_s=submitted - looked_up,
            io_s=read - waiting,
            io_busy_s=fetched.busy_s,
            update_s=updated - done,
            compute_s=(waiting - submitted) + (done - read),
        )
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
