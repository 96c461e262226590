"""`FlashMLP`: what every flashlm MLP module shares, and the registry of methods (`FlashConfig.method`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ..cache import NeuronCache
from ..registry import Registry

if TYPE_CHECKING:
    from ..engine.runtime import FlashRuntime

METHODS: Registry = Registry("methods", attribute="method")
"""Every `FlashConfig.method`, by name: the module class that computes it (`@register_method`)."""
register_method = METHODS.register


def method_class(name: str) -> type:
    """The module class registered as `name` (`ConfigError` naming the available ones otherwise)."""
    return METHODS[name]


class FlashMLP(nn.Module):
    """Base of the modules that replace a model's MLPs. Holds no `nn.Parameter`.

    Subclasses name the unit kinds they read (`KINDS`, store layouts) and get one `NeuronCache`
    per kind (submodules, so `.to()` moves them); the shared `FlashRuntime` reads, stages and
    counts.

    Args:
        layer: index of the decoder layer, the store's key for this MLP.
        runtime: the model's `FlashRuntime`.
        act: the activation module taken from the original MLP.
        gated: `down(act(gate x) * up x)` if True, else `down(act(up x + b)) + b`.
        dense_class: the class of the MLP module this one replaced, rebuilt by `unpatch` (None
            where the projections sat on the decoder layer itself).
    """

    method: ClassVar[str]
    KINDS: ClassVar[tuple[str, ...]]

    def __init__(
        self,
        layer: int,
        runtime: FlashRuntime,
        act: nn.Module,
        *,
        gated: bool,
        d_model: int,
        d_ff: int,
        dense_class: type[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.runtime = runtime
        self.act = act
        self.gated = gated
        self.d_model = d_model
        self.d_ff = d_ff
        self.dense_class = dense_class

    def caches(self) -> list[NeuronCache]:
        return [module for module in self.children() if isinstance(module, NeuronCache)]

    @torch.no_grad()
    def reset_state(self) -> None:
        """Empty the caches (transformers' loader replaces non-persistent buffers after loading)."""
        self.runtime.drain()
        for cache in self.caches():
            cache.clear()

    def counters(self) -> tuple[int, int, int]:
        """(hits, misses, evictions) summed over this module's caches."""
        caches = self.caches()
        return (
            sum(c.hits for c in caches),
            sum(c.misses for c in caches),
            sum(c.evictions for c in caches),
        )
