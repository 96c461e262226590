"""`FlashMLP`: what every flashlm MLP module shares, and the registry of methods (`FlashConfig.method`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch
from torch import nn

from ..cache import NeuronCache
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..runtime import FlashRuntime

_METHODS: dict[str, type[FlashMLP]] = {}

M = TypeVar("M", bound="type[FlashMLP]")


def register_method(name: str) -> Callable[[M], M]:
    """Class decorator: the module class that computes `FlashConfig(method=name)`."""

    def decorate(cls: M) -> M:
        if name in _METHODS:
            raise ValueError(f"A method named {name!r} is already registered ({_METHODS[name]}).")
        cls.method = name
        _METHODS[name] = cls
        return cls

    return decorate


def method_class(name: str) -> type[FlashMLP]:
    try:
        return _METHODS[name]
    except KeyError:
        raise ConfigError(
            f"Unknown method {name!r}. Available methods: {', '.join(sorted(_METHODS))}."
        ) from None


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
