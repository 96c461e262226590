"""`StreamingMLP`: an MLP whose weights live in the store and pass through budgeted neuron caches.

Dense streaming (`method="dense"`, and every method at density 1.0) needs every weight every step.
It reads two unit kinds, each with its own cache: the intermediate projection by neuron (`gate_up`
row j = gate row j | up row j, or `up` row j for a plain MLP) and the down projection by output
feature (`down` row i = the checkpoint's row i). Every product is then a subset of the rows of the
checkpoint's own matrices, computed by `F.linear` in the dense model's layout — the kernel
transformers uses, fast on every CPU, and exact: a one-token product's outputs do not depend on
which other rows are computed with them.

Every step needs every unit, so priorities never differ and a cache never changes once full: the
first step fills it with units `0 .. capacity-1` in order, and from then on the misses are the rest
of the matrix, read (usually a layer ahead) into the staging buffer at their own rows. A decode step
multiplies the cached rows and the staged rows separately; a multi-token step (prefill), where the
kernel's blocking may depend on the matrix shape, first copies the cached rows into the staging
buffer's head and multiplies the whole matrix at once, exactly as the dense model does.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import NeuronCache
from .base import FlashMLP, register_method

if TYPE_CHECKING:
    from ..runtime import Fetch, FlashRuntime


@register_method("dense")
class StreamingMLP(FlashMLP):
    """Computes one MLP from streamed rows of the checkpoint's matrices. Holds no `nn.Parameter`.

    Args (beyond `FlashMLP`'s):
        hidden_cache: this layer's cache of `gate_up` (gated) or `up` (plain) units.
        down_cache: this layer's cache of `down` rows.
        up_bias, down_bias: biases of plain MLPs, kept resident.
    """

    KINDS = ("gate_up", "down")

    def __init__(
        self,
        layer: int,
        runtime: FlashRuntime,
        hidden_cache: NeuronCache,
        down_cache: NeuronCache,
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
        self.hidden_kind = "gate_up" if gated else "up"
        self.hidden_cache = hidden_cache
        self.down_cache = down_cache
        self.register_buffer("up_bias", up_bias, persistent=False)
        self.register_buffer("down_bias", down_bias, persistent=False)

    @staticmethod
    def kinds_for(gated: bool) -> tuple[str, str]:
        return ("gate_up" if gated else "up", "down")

    @torch.no_grad()
    def reset_state(self) -> None:
        """Refill every buffer from its source: biases from the store, empty caches.

        transformers' loader replaces all non-persistent buffers with uninitialized placeholders
        after weight loading; the quantizer calls this once loading is done.
        """
        super().reset_state()
        resident = self.runtime.store.resident(self.layer)
        for name in ("up_bias", "down_bias"):
            if getattr(self, name) is not None:
                getattr(self, name).copy_(resident[name])

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer}, d_model={self.d_model}, d_ff={self.d_ff}, gated={self.gated}, "
            f"capacity=({self.hidden_cache.capacity}, {self.down_cache.capacity})"
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        runtime = self.runtime
        x = hidden_states.reshape(-1, self.d_model)
        tokens = x.shape[0]
        if self.layer == 0:
            runtime.begin_step(tokens)
        pending = runtime.read_layer(self.layer)
        waiting = perf_counter()
        fetched = pending.result()
        io_s = perf_counter() - waiting
        hidden_fetch, down_fetch = fetched[self.hidden_kind], fetched["down"]

        hits = self.hidden_cache.size + self.down_cache.size
        started = perf_counter()
        hidden = self._hidden(x, hidden_fetch)
        out = self._matrix(hidden, self.down_cache, down_fetch, self.down_bias)
        computed = perf_counter()
        evictions = self._account(self.hidden_cache, hidden_fetch) + self._account(
            self.down_cache, down_fetch
        )
        updated = perf_counter()

        runtime.stats.record(
            self.layer,
            tokens=tokens,
            bytes_read=hidden_fetch.bytes_read + down_fetch.bytes_read,
            reads=hidden_fetch.reads + down_fetch.reads,
            hits=hits,
            misses=hidden_fetch.ids.numel() + down_fetch.ids.numel(),
            evictions=evictions,
            used_bytes=tokens * runtime.layer_mlp_bytes,
            dense_bytes=tokens * runtime.layer_mlp_bytes,
            io_s=io_s,
            io_busy_s=hidden_fetch.busy_s + down_fetch.busy_s,
            update_s=updated - computed,
            compute_s=computed - started,
        )
        return out.reshape(hidden_states.shape)

    def _hidden(self, x: torch.Tensor, fetch: Fetch) -> torch.Tensor:
        """The intermediate activation `[T, d_ff]`: `act(gate x) * up x`, or `act(up x + b)`."""
        if not self.gated:
            return self.act(self._matrix(x, self.hidden_cache, fetch, self.up_bias))
        d = self.d_model
        gate = self._matrix(x, self.hidden_cache, fetch, None, columns=slice(0, d))
        up = self._matrix(x, self.hidden_cache, fetch, None, columns=slice(d, 2 * d))
        return self.act(gate) * up

    def _matrix(
        self,
        x: torch.Tensor,
        cache: NeuronCache,
        fetch: Fetch,
        bias: torch.Tensor | None,
        columns: slice = slice(None),
    ) -> torch.Tensor:
        """`F.linear(x, W, bias)` for the matrix W whose rows are the cache's and the fetch's units
        (`columns` of each row: gate or up of a `gate_up` row)."""
        cached = cache.size
        if fetch.ids.numel() == 0:  # all resident (in unit order): the matrix is the cache's
            return F.linear(x, cache.rows[:cached, columns], bias)
        if not cache.holds_unit_prefix or fetch.start != cached:
            raise RuntimeError(
                f"flashlm internal error: layer {self.layer}'s dense cache does not hold its first "
                f"{cached} units in order; dense streaming cannot assemble its matrix."
            )
        matrix = fetch.buffer[: cache.num_units]
        if cached == 0:
            return F.linear(x, matrix[:, columns], bias)
        if x.shape[0] > 1:
            # Many tokens: one product over the whole matrix, as the dense model computes it.
            matrix[:cached].copy_(cache.rows[:cached])
            return F.linear(x, matrix[:, columns], bias)
        out = x.new_empty(x.shape[0], cache.num_units)
        head, tail = (None, None) if bias is None else (bias[:cached], bias[cached:])
        out[:, :cached] = F.linear(x, cache.rows[:cached, columns], head)
        out[:, cached:] = F.linear(x, matrix[cached:, columns], tail)
        return out

    def _account(self, cache: NeuronCache, fetch: Fetch) -> int:
        """Counters, the trace, and (only while the cache has free slots) admission; returns evictions."""
        runtime = self.runtime
        cache.count(cache.size, fetch.ids.numel())
        kind = self.hidden_kind if cache is self.hidden_cache else "down"
        if runtime.trace is not None:
            runtime.trace.record(runtime.step_start, self.layer, kind, runtime.unit_ids[: cache.num_units])
        if cache.size == cache.capacity or fetch.ids.numel() == 0:
            return 0  # every unit is used every step: a full cache never changes
        evictions = cache.evictions
        cache.update(runtime.unit_ids[: cache.num_units], fetch.ids, fetch.rows, runtime.step_start)
        return cache.evictions - evictions
