"""`StreamingMLP`: an MLP whose weights live in the store and pass through a budgeted neuron cache.

Every unit (one neuron bundle: gate row ‖ up row ‖ down column, or fc1 row ‖ fc2 column) that a
step needs is either resident in the layer's `NeuronCache` or read from the store into one of the
runtime's staging buffers (usually ahead of time, while the previous layer computed); the MLP is
then computed from the two groups of rows, and the cache policy decides which of the freshly read
units to keep. `method="dense"` needs every unit
every step: exact dense streaming, the baseline every sparse method is measured against.
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
    from ..runtime import FlashRuntime


@register_method("dense")
class StreamingMLP(FlashMLP):
    """Computes one MLP from streamed neuron bundles (`method="dense"`). Holds no `nn.Parameter`.

    Args (beyond `FlashMLP`'s):
        cache: this layer's neuron cache of bundles (a submodule: `.to()` moves its slots).
        up_bias, down_bias: biases of plain MLPs, kept resident.
    """

    KINDS = ("bundle",)

    def __init__(
        self,
        layer: int,
        runtime: FlashRuntime,
        cache: NeuronCache,
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
        self.cache = cache
        self.register_buffer("unit_ids", torch.arange(d_ff), persistent=False)
        self.register_buffer("up_bias", up_bias, persistent=False)
        self.register_buffer("down_bias", down_bias, persistent=False)

    @torch.no_grad()
    def reset_state(self) -> None:
        """Refill every buffer from its source: unit ids, biases from the store, an empty cache.

        transformers' loader replaces all non-persistent buffers with uninitialized placeholders
        after weight loading; the quantizer calls this once loading is done.
        """
        super().reset_state()
        self.unit_ids.copy_(torch.arange(self.d_ff))
        resident = self.runtime.store.resident(self.layer)
        for name in ("up_bias", "down_bias"):
            if getattr(self, name) is not None:
                getattr(self, name).copy_(resident[name])

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer}, d_model={self.d_model}, d_ff={self.d_ff}, gated={self.gated}, "
            f"capacity={self.cache.capacity}"
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        runtime = self.runtime
        x = hidden_states.reshape(-1, self.d_model)
        if self.layer == 0:
            runtime.begin_step(x.shape[0])
        hits_before, misses_before = self.cache.hits, self.cache.misses
        evictions_before = self.cache.evictions

        start = perf_counter()
        self.cache.lookup(self.unit_ids)  # counts the hits and misses
        looked_up = perf_counter()
        fetched = runtime.read_uncached(self.layer, self.KINDS[0]).result()
        read_done = perf_counter()

        groups = [
            (self.cache.rows[: self.cache.size], self.cache.slot_ids[: self.cache.size]),
            (fetched.rows, fetched.ids),
        ]
        out = self._mlp([(rows, ids) for rows, ids in groups if ids.numel()], x)
        computed = perf_counter()
        self.cache.update(self.unit_ids, fetched.ids, fetched.rows, runtime.step_start)
        if runtime.trace is not None:
            runtime.trace.record(runtime.step_start, self.layer, "bundle", self.unit_ids)
        updated = perf_counter()

        runtime.stats.record(
            self.layer,
            tokens=x.shape[0],
            bytes_read=fetched.bytes_read,
            reads=fetched.reads,
            hits=self.cache.hits - hits_before,
            misses=self.cache.misses - misses_before,
            evictions=self.cache.evictions - evictions_before,
            used_bytes=x.shape[0] * runtime.layer_mlp_bytes,
            dense_bytes=x.shape[0] * runtime.layer_mlp_bytes,
            io_s=read_done - looked_up,
            io_busy_s=fetched.busy_s,
            cache_s=(looked_up - start) + (updated - computed),
            compute_s=computed - read_done,
        )
        return out.reshape(hidden_states.shape)

    def _mlp(self, groups: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        """The MLP over the units in `groups` ((rows, unit ids) pairs that together cover what is needed).

        Each unit's intermediate activation is one dot product per input projection, exact in any
        layout. The down projection sums over units, so its rows are assembled in unit order in
        the runtime's workspace: the product is then the same kernel on the same matrix as the
        dense model's (transposed to the dense weight's layout when many tokens share it, where
        the kernel is layout-sensitive), which makes density 1.0 bit-exact.
        """
        if len(groups) == 1 and torch.equal(groups[0][1], self.unit_ids):
            # One group already in unit order (everything cached, or everything read): no assembly.
            rows = groups[0][0].to(device=x.device, dtype=x.dtype, non_blocking=True)
            hidden, down = self._hidden(rows, self.unit_ids, x)
        else:
            hidden = x.new_empty(x.shape[0], self.d_ff)
            down = self.runtime.down_workspace(x.device, x.dtype)
            for rows, ids in groups:
                rows = rows.to(device=x.device, dtype=x.dtype, non_blocking=True)
                ids = ids.to(x.device)
                unit_hidden, unit_down = self._hidden(rows, ids, x)
                hidden.index_copy_(1, ids, unit_hidden)
                down.index_copy_(0, ids, unit_down)
        if x.shape[0] > 1:
            return F.linear(hidden, down.T.contiguous(), self.down_bias)
        return hidden @ down if self.down_bias is None else torch.addmm(self.down_bias, hidden, down)

    def _hidden(
        self, rows: torch.Tensor, ids: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Intermediate activations of the units in `rows`, and their down-projection rows."""
        d = self.d_model
        if self.gated:
            gate, up, down = rows[:, :d], rows[:, d : 2 * d], rows[:, 2 * d :]
            return self.act(F.linear(x, gate)) * F.linear(x, up), down
        up, down = rows[:, :d], rows[:, d:]
        bias = None if self.up_bias is None else self.up_bias[ids.to(self.up_bias.device)]
        return self.act(F.linear(x, up, bias)), down
