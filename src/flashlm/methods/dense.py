"""`StreamingMLP`: an MLP whose weights live in the store and pass through budgeted neuron caches.

Dense streaming (`method="dense"`, and every method at density 1.0) needs every weight every step.
It reads one unit kind per projection, each with its own cache: `gate` and `up` by neuron (row j of
the projection) and `down` by output feature (row i of the down projection). Every product is then
a contiguous block of rows of the checkpoint's own matrix, computed by `F.linear` in the dense
model's layout — the kernel transformers uses, fast on every CPU, and exact: a one-token product's
outputs do not depend on which other rows are computed with them.

Every step needs every unit, so priorities never differ and a cache never changes once full: the
first step fills it with units `0 .. capacity-1` in order, and from then on the misses are the rest
of the matrix, read (usually a layer ahead) in place into the staging matrix, at their own rows. A
decode step multiplies the cached rows and the staged rows separately, the cached gate and up rows
while the layer's read is still finishing; a multi-token step (prefill),
where the kernel's blocking may depend on the matrix shape, first copies the cached rows into the
staging matrix's head and multiplies the whole matrix at once, exactly as the dense model does; so
does every step on a GPU, where a split product's outputs can differ in the last bit.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..cache import NeuronCache
from ..engine.runtime import FlashRuntime
from ..ops.linear import linear_in_dtype
from ..store.format import dense_kinds
from .base import DenseOnly, register_method
from .mlp import FlashMLP

if TYPE_CHECKING:
    from ..config import FlashConfig
    from ..engine.runtime import Fetch
    from ..store import Store


@register_method("dense")
class StreamingMLP(DenseOnly, FlashMLP):
    """Computes one MLP from streamed rows of the checkpoint's matrices. Holds no `nn.Parameter`.

    Args (beyond `FlashMLP`'s):
        caches: this layer's cache of each kind of `StreamingMLP.kinds_for(gated)`, by kind.
        up_bias, down_bias: biases of plain MLPs, kept resident.
    """

    KINDS = ("gate", "up", "down")
    # A dense cache holds a prefix of its units, so each kind's misses are one contiguous read, whose cost
    # per byte does not depend on the row size; but each kind split between cache and staging costs two
    # products and a concatenation instead of one product. Filled one kind after another, and a kind one
    # layer after another (spread over the model), at most one cache of the model is split. Against
    # one split kind in every layer, alternated in one process on a 2-core AMD EPYC at a 50% budget:
    # SmolLM2 1.16x tok/s (compute 29.2 against 31.3 ms per token) with default kernels, 1.05x (13.2
    # against 20.8 ms) with AVX2's; Qwen2.5-1.5B 1.06x and 1.02x; layers filled front to back instead
    # of spread, Qwen2.5-1.5B 0.90-0.97x (its reads a layer ahead turned uneven).
    CACHE_SPLIT = "in-order"

    @classmethod
    def needs_unit_profile(cls, config: FlashConfig) -> bool:
        return False  # every unit every token: nothing to place by how often it is used

    def __init__(
        self,
        layer: int,
        runtime: FlashRuntime,
        caches: dict[str, NeuronCache],
        act: nn.Module,
        *,
        gated: bool,
        d_model: int,
        d_ff: int,
        up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        dense_class: type[nn.Module] | None = None,
    ) -> None:
        super().__init__(
            layer, runtime, act, gated=gated, d_model=d_model, d_ff=d_ff, dense_class=dense_class
        )
        self.gate_cache = caches.get("gate")
        self.up_cache = caches["up"]
        self.down_cache = caches["down"]
        self.register_buffer("up_bias", up_bias, persistent=False)
        self.register_buffer("down_bias", down_bias, persistent=False)
        self._kind_caches = [(kind, caches[kind]) for kind in self.kinds_for(gated)]
        """(kind, cache) pairs in store order (references to the submodules above)."""

    @staticmethod
    def kinds_for(gated: bool) -> tuple[str, ...]:
        return dense_kinds(gated)

    @classmethod
    def store_kinds(cls, store: Store) -> tuple[str, ...]:
        return cls.kinds_for(store.gated)

    @classmethod
    def make_runtime(cls, store: Store, config: FlashConfig, fitted: Any) -> FlashRuntime:
        return FlashRuntime(
            store,
            config,
            read_ahead=None if config.read_ahead is not False else (),
            cache_split=cls.CACHE_SPLIT,
        )

    @classmethod
    def build(
        cls,
        layer: int,
        runtime: FlashRuntime,
        act: nn.Module,
        *,
        fitted: Any,
        dense_class: type[nn.Module] | None,
    ) -> StreamingMLP:
        store = runtime.store
        resident = store.resident(layer)
        return cls(
            layer,
            runtime,
            {kind: runtime.make_cache(layer, kind) for kind in cls.kinds_for(store.gated)},
            act,
            gated=store.gated,
            d_model=store.d_model,
            d_ff=store.d_ff,
            up_bias=resident.get("up_bias"),
            down_bias=resident.get("down_bias"),
            dense_class=dense_class,
        )

    def extra_repr(self) -> str:
        capacities = ", ".join(f"{kind}={cache.capacity}" for kind, cache in self._kind_caches)
        return (
            f"layer={self.layer}, d_model={self.d_model}, d_ff={self.d_ff}, gated={self.gated}, "
            f"capacity=({capacities})"
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        runtime = self.runtime
        x = self._tokens_of(hidden_states)
        tokens = x.shape[0]
        if runtime.every_unit_resident and runtime.trace is None:
            return self._resident_forward(x).reshape(hidden_states.shape)
        submitting = perf_counter()
        pending = runtime.read_layer(self.layer, self.kinds_for(self.gated), ahead=bool(runtime.read_ahead))
        started = perf_counter()
        # The cached rows' products of a split product need no read: they run while it finishes.
        split = self._splits(x)
        up_head = self._head(x, self.up_cache, self.up_bias) if split else None
        gate_head = self._head(x, self.gate_cache, None) if split and self.gated else None
        waiting = perf_counter()
        fetched = {kind: fetch.to(x.device) for kind, fetch in pending.result().items()}
        resumed = perf_counter()

        hits = sum(cache.size for _, cache in self._kind_caches)
        up = self._matrix(x, self.up_cache, fetched["up"], self.up_bias, up_head)
        if self.gated:
            hidden = self.act(self._matrix(x, self.gate_cache, fetched["gate"], None, gate_head)) * up
        else:
            hidden = self.act(up)
        out = self._matrix(hidden, self.down_cache, fetched["down"], self.down_bias)
        computed = perf_counter()
        evictions = sum(self._account(kind, cache, fetched[kind]) for kind, cache in self._kind_caches)
        updated = perf_counter()

        runtime.stats.record(
            self.layer,
            tokens=tokens,
            bytes_read=sum(fetch.bytes_read for fetch in fetched.values()),
            reads=sum(fetch.reads for fetch in fetched.values()),
            hits=hits,
            misses=sum(fetch.ids.numel() for fetch in fetched.values()),
            evictions=evictions,
            used_bytes=tokens * runtime.layer_mlp_bytes,
            dense_bytes=tokens * runtime.layer_mlp_bytes,
            io_s=resumed - waiting,
            io_busy_s=sum(fetch.busy_s for fetch in fetched.values()),
            submit_s=started - submitting,
            update_s=updated - computed,
            compute_s=(waiting - started) + (computed - resumed),
        )
        return out.reshape(hidden_states.shape)

    def _resident_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every unit of every layer in its cache, in unit order: the dense model's three products on
        the caches' matrices, and nothing else but the counters (the decode path of a budget that
        holds the whole MLP)."""
        started = perf_counter()
        up = linear_in_dtype(x, self.up_cache.rows, self.up_bias)
        hidden = self.act(linear_in_dtype(x, self.gate_cache.rows)) * up if self.gated else self.act(up)
        out = linear_in_dtype(hidden, self.down_cache.rows, self.down_bias)
        computed = perf_counter()
        units = 0
        for _, cache in self._kind_caches:
            cache.count(cache.num_units, 0)
            units += cache.num_units
        tokens = x.shape[0]
        self.runtime.stats.record(
            self.layer,
            tokens=tokens,
            hits=units,
            used_bytes=tokens * self.runtime.layer_mlp_bytes,
            dense_bytes=tokens * self.runtime.layer_mlp_bytes,
            compute_s=computed - started,
        )
        return out

    @staticmethod
    def _splits(x: torch.Tensor) -> bool:
        """Whether the products of `x` (one token, on the CPU) multiply the cached rows and the read rows
        apart: a row's output does not depend on the rows computed beside it, so this equals the whole
        matrix's product."""
        return x.shape[0] == 1 and x.device.type == "cpu"

    def _head(self, x: torch.Tensor, cache: NeuronCache, bias: torch.Tensor | None) -> torch.Tensor | None:
        """One token's outputs of the cached rows (units `0 .. size-1`, in order), or None when the
        cache holds none."""
        cached = cache.size
        if cached == 0:
            return None
        rows = cache.rows if cached == cache.rows.shape[0] else cache.rows[:cached]
        return linear_in_dtype(x, rows, None if bias is None else bias[:cached])

    def _matrix(
        self,
        x: torch.Tensor,
        cache: NeuronCache,
        fetch: Fetch,
        bias: torch.Tensor | None,
        head: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`linear_in_dtype(x, W, bias)` for the matrix W whose rows are the cache's and the fetch's
        units; `head`, when given, is `_head`'s product of the cached rows, computed already."""
        cached = cache.size
        if fetch.ids.numel() == 0:  # all resident (in unit order): the matrix is the cache's
            return head if head is not None else linear_in_dtype(x, cache.rows[:cached], bias)
        if not cache.holds_unit_prefix or fetch.ids.numel() != cache.num_units - cached:
            raise RuntimeError(
                f"flashlm internal error: layer {self.layer}'s dense cache does not hold its first "
                f"{cached} units in order; dense streaming cannot assemble its matrix."
            )
        matrix = fetch.matrix  # units cached .. num_units - 1 at their own rows
        if cached == 0:
            return linear_in_dtype(x, matrix, bias)
        if not self._splits(x):
            # One product over the whole matrix, as the dense model computes it: for many tokens, and
            # on a GPU, whose kernels may split the reduction by the matrix's shape (on an H200, split
            # products gave Qwen2.5-1.5B other bf16 greedy tokens). There the copy is on-device.
            matrix[:cached].copy_(cache.rows[:cached])
            return linear_in_dtype(x, matrix, bias)
        # The cached rows' outputs, then the read rows'.
        if head is None:
            head = self._head(x, cache, bias)
        tail_bias = None if bias is None else bias[cached:]
        return torch.cat((head, linear_in_dtype(x, matrix[cached:], tail_bias)), 1)

    def _account(self, kind: str, cache: NeuronCache, fetch: Fetch) -> int:
        """Counters, the trace, and (only while the cache has free slots) admission; returns evictions."""
        runtime = self.runtime
        cache.count(cache.size, fetch.ids.numel())
        if runtime.trace is not None:
            runtime.trace.record(runtime.step_start, self.layer, kind, runtime.unit_ids[: cache.num_units])
        if cache.size == cache.capacity or fetch.ids.numel() == 0:
            return 0  # every unit is used every step: a full cache never changes
        evictions = cache.evictions
        cache.update(
            runtime.unit_ids[: cache.num_units], fetch.ids, fetch.matrix, runtime.step_start, by_unit=True
        )
        runtime.refresh_residency()
        return cache.evictions - evictions
