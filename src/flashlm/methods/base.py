"""`FlashMLP`: what every flashlm MLP module shares, and the registry of methods (`FlashConfig.method`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ..cache import NeuronCache
from ..errors import ConfigError
from ..registry import Registry

if TYPE_CHECKING:
    from ..engine.runtime import FlashRuntime

METHODS: Registry = Registry("methods", attribute="method")
"""Every `FlashConfig.method`, by name: the module class that computes it (`@register_method`)."""
register_method = METHODS.register


def method_class(name: str) -> type:
    """The module class registered as `name` (`ConfigError` naming the available ones otherwise)."""
    return METHODS[name]


class MethodModule(nn.Module):
    """Base of every registered method's module: what `FlashConfig` asks of a method.

    `OPTIONS` are the method-specific `FlashConfig` options the method takes (others must keep their
    defaults); `check_density` refuses a density the method cannot compute.
    """

    method: ClassVar[str]
    OPTIONS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check_density(cls, density: float) -> None:
        """Raise `ConfigError` if this method cannot run at `density` (any in (0, 1] by default)."""


class DenseOnly:
    """Mixin of the methods that compute with every weight they hold: density 1.0 only."""

    method: ClassVar[str]

    @classmethod
    def check_density(cls, density: float) -> None:
        if density != 1:
            raise ConfigError(
                f"method={cls.method!r} computes with every weight it holds: density must be 1.0, got "
                f"{density}. (Endor's sparsity is in the pruned weights: prune with `flashlm prune`.)"
            )


class FlashMLP(MethodModule):
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

    def _tokens_of(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_states` as `[tokens, d_model]`; the first layer's call starts the runtime's step."""
        x = hidden_states.reshape(-1, self.d_model)
        if self.layer == 0:
            self.runtime.begin_step(x.shape[0])
        return x

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
