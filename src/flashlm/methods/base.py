"""What every method shares: the registry of methods (`FlashConfig.method`), the base of their modules,
and `Replacer`, the hook through which a family of methods puts its modules into a model.

`flashlm.patching` has one create-and-replace walk for every method (peft's `_create_and_replace`
shape): it asks the method's `Replacer` for the store, the runtime and the targets, then replaces
each target with the module the replacer creates. The MLP methods' replacer is in `mlp.py`,
Endor's in `endor.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..errors import ConfigError
from ..registry import Registry

if TYPE_CHECKING:
    from ..config import FlashConfig
    from ..engine.runtime import Runtime

METHODS: Registry = Registry("methods", attribute="method")
"""Every `FlashConfig.method`, by name: the module class that computes it (`@register_method`)."""
register_method = METHODS.register


def method_class(name: str) -> type:
    """The module class registered as `name` (`ConfigError` naming the available ones otherwise)."""
    return METHODS[name]


@dataclass(frozen=True)
class Target:
    """One module a method replaces: where it is, what it is now, and what the replacer needs to build
    its successor."""

    name: str
    """Qualified name of the module replaced (`model.layers.3.mlp`)."""
    layer: int
    module: nn.Module
    released: tuple[str, ...]
    """Checkpoint keys that stop being parameters (their weights live in the store)."""
    identities: tuple[str, ...] = ()
    """Sibling modules that become `nn.Identity` (where the replaced computation spans several)."""
    details: dict[str, Any] = field(default_factory=dict)


class Replacer(ABC):
    """How a family of methods plugs into a model: the store it reads, the runtime its modules share,
    the modules it replaces, the module it creates for each, and the way back to dense weights."""

    @abstractmethod
    def open_store(
        self, model: nn.Module, config: FlashConfig, checkpoint_dir: Path | None, *, progress: bool = True
    ) -> Any:
        """The store for `model`: of the checkpoint in `checkpoint_dir`, or of the weights in memory (None);
        opened and checked against the model, or converted first where it does not exist."""

    @abstractmethod
    def prepare(self, model: nn.Module, store: Any, config: FlashConfig) -> tuple[Runtime, list[Target]]:
        """The runtime the new modules will share, and the targets, in module order (a loud error naming
        what did not match where the model and the store disagree)."""

    @abstractmethod
    def create(self, runtime: Runtime, target: Target) -> nn.Module:
        """The module that takes `target`'s place."""

    @abstractmethod
    def dense_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The weights the replaced modules held, by checkpoint name, read back from the store."""

    @abstractmethod
    def restore(self, model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Put dense modules holding `weights` (`dense_weights`) back in the replaced ones' places."""


class MethodModule(nn.Module):
    """Base of every registered method's module: what `FlashConfig` and `flashlm.patching` ask of a method.

    `OPTIONS` are the method-specific `FlashConfig` options the method takes (others must keep their
    defaults); `check_density` refuses a density the method cannot compute; `replacer` puts the
    method's modules into a model; `runtime` is what the modules of one model share.
    """

    method: ClassVar[str]
    OPTIONS: ClassVar[tuple[str, ...]] = ()
    replacer: ClassVar[Replacer]
    runtime: Runtime

    @classmethod
    def check_density(cls, density: float) -> None:
        """Raise `ConfigError` if this method cannot run at `density` (any in (0, 1] by default)."""

    def reset_state(self) -> None:
        """Refill the buffers transformers' loader replaced with placeholders after loading (none here)."""

    def own_state_keys(self) -> list[str]:
        """Keys of this module's state dict that it loads from beside the store, not from a checkpoint
        (none here)."""
        return []


def flashlm_modules(model: nn.Module) -> list[MethodModule]:
    """The modules flashlm put into `model`, whatever the method, in module order."""
    return [module for module in model.modules() if isinstance(module, MethodModule)]


def runtime_of(model: nn.Module) -> Runtime:
    """The runtime the flashlm modules of `model` share (`ValueError` if it is not patched)."""
    modules = flashlm_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} is not patched by flashlm: call flashlm.patch(model) first."
        )
    return modules[0].runtime


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
