"""The MLP methods' side of the engine: `FlashMLP`, the base of every module that replaces a model's MLP
(dense streaming and the sparse methods), and `MLPReplacer`, which puts them into a model and takes
them out again."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..arch import MLPSpec, find_mlps, mlp_weight_names, model_type_of, spec_for
from ..cache import NeuronCache
from ..cache.policies import NO_CACHE
from ..engine.runtime import FlashRuntime
from ..errors import ConfigError
from ..store import ModuleSource, SafetensorsSource, Store, add_kinds, convert, mlp_content_sha256
from ..store.convert import layer_weights
from ..store.location import default_store_path, open_or_convert, store_path
from .base import METHODS, MethodModule, Replacer, Target, method_class

if TYPE_CHECKING:
    from ..config import FlashConfig


def module_class(config: FlashConfig) -> type[FlashMLP]:
    """The module that computes `config`: its method's, except at density 1.0, where every method keeps
    every unit and is dense streaming, computed exactly as the dense model (the DIP paper's density-1
    point; a sparse module would sum its products in another order)."""
    return METHODS["dense"] if config.density == 1 else method_class(config.method)


def require_gate(store: Store, method: str, needs: str, instead: str) -> None:
    """`ConfigError` unless `store`'s MLP is gated: `method` `needs` its gate projection (what it does
    with it), and `instead` names the method to use."""
    if not store.gated:
        raise ConfigError(
            f"method={method!r} {needs}, but {store.model_type}'s MLP is not gated (it has no gate "
            f"projection). Use method={instead!r}."
        )


def streaming_mlps(model: nn.Module) -> list[FlashMLP]:
    """The flashlm MLP modules of `model`, in module order."""
    return [module for module in model.modules() if isinstance(module, FlashMLP)]


def open_checkpoint_store(checkpoint_dir: str | Path, config: FlashConfig, *, progress: bool = True) -> Store:
    """The MLP store of a safetensors checkpoint: opened and checked, or converted first if missing."""
    source = SafetensorsSource(checkpoint_dir)
    fingerprint = source.fingerprint()
    store = _open_mlp_store(source, str(checkpoint_dir), fingerprint, config, progress)
    store.check_matches(model_type=source.model_type, fingerprint=fingerprint)
    return store


def checkpoint_store_path(checkpoint_dir: str | Path, config: FlashConfig) -> Path:
    """Where `open_checkpoint_store` finds the checkpoint's store (or would convert it)."""
    fingerprint = SafetensorsSource(checkpoint_dir).fingerprint()
    return store_path(config.store, str(checkpoint_dir), fingerprint, ".flash")


def _open_mlp_store(
    source: SafetensorsSource | ModuleSource, name: str, key: str, config: FlashConfig, progress: bool
) -> Store:
    """The MLP store of `source`, found under `key` (its fingerprint or content hash) or converted, by
    the one store-opening policy; the caller checks that it matches."""
    return open_or_convert(
        config.store, name, key, ".flash", lambda path: convert(source, path, progress=progress), Store.open
    )


def _checkpoints_store(checkpoint_dir: str, content_sha256: str) -> Store | None:
    """The store already converted from the checkpoint a model in memory was loaded from, if it holds
    the same MLP weights: `flashlm.patch` then shares it (and what was fitted beside it: a calibration,
    predictors) with the checkpoint's loaders, instead of converting a second one keyed by content."""
    if not (Path(checkpoint_dir) / "config.json").is_file():
        return None
    try:
        path = default_store_path(checkpoint_dir, SafetensorsSource(checkpoint_dir).fingerprint(), ".flash")
    except (OSError, ValueError):
        return None  # no safetensors files there: nothing was converted from it
    if not path.exists():
        return None
    store = Store.open(path)
    return store if store.content_sha256 == content_sha256 else None


class MLPReplacer(Replacer):
    """Puts a `FlashMLP` in the place of every MLP of a model, reading the MLP store (`.flash`).

    Where the projections have an owner of their own (`layers.3.mlp`), the owner is replaced. Where
    they sit on the decoder layer (OPT), the input projection is replaced and the activation and
    output projection become identities, so the layer's forward computes
    `identity(identity(streaming_mlp(x)))` unchanged.
    """

    def open_store(
        self, model: nn.Module, config: FlashConfig, checkpoint_dir: Path | None, *, progress: bool = True
    ) -> Store:
        if checkpoint_dir is not None:
            return open_checkpoint_store(checkpoint_dir, config, progress=progress)
        source = ModuleSource(model)
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        content = mlp_content_sha256(source)
        store = _checkpoints_store(name, content) if config.store is None else None
        if store is None:
            store = _open_mlp_store(source, name, content, config, progress)
        store.check_matches(model_type=source.model_type, content_sha256=content)
        return store

    def prepare(
        self, model: nn.Module, store: Store, config: FlashConfig
    ) -> tuple[FlashRuntime, list[Target]]:
        """Unit layouts the module needs and the store lacks are derived from its bundles first; caches are
        allocated on the CPU within `config.memory_budget`."""
        spec = spec_for(model_type_of(model.config))
        owners = find_mlps(model, spec)
        store.check_matches(num_layers=len(owners))
        method_class(config.method).check_store(store, config)
        cls = module_class(config)
        store = add_kinds(store, cls.store_kinds(store))
        _, _, first_mlp = owners[0]
        # Only transformers' loader hands over MLPs without weights (`patch` reads them). It replaces the
        # modules' buffers and fitted weights after loading, so they are built on the meta device then,
        # and `reset_state` fills the loader's.
        loading = any(parameter.is_meta for parameter in first_mlp.parameters())
        with torch.device("cpu"):  # transformers builds the model under a meta-device context
            fitted = cls.load_fitted(store, device=torch.device("meta" if loading else "cpu"))
            runtime = cls.make_runtime(store, config, fitted)
        if loading:
            runtime.slot_device = torch.device("meta")
        targets = []
        for layer, owner_name, owner in owners:
            name, identities = (owner_name, ()) if spec.owner else self._on_layer(spec, owner_name)
            details = {
                "class": cls,
                "act": getattr(owner, spec.act),
                "dense_class": type(owner) if spec.owner else None,
                "fitted": fitted,
            }
            released = tuple(mlp_weight_names(spec, owner_name).values())
            targets.append(Target(name, layer, owner, released, identities, details))
        return runtime, targets

    @staticmethod
    def _on_layer(spec: MLPSpec, owner_name: str) -> tuple[str, tuple[str, ...]]:
        return f"{owner_name}.{spec.up}", (f"{owner_name}.{spec.act}", f"{owner_name}.{spec.down}")

    def create(self, runtime: FlashRuntime, target: Target) -> FlashMLP:
        details = target.details
        with torch.device("cpu"):
            return details["class"].build(
                target.layer,
                runtime,
                details["act"],
                fitted=details["fitted"],
                dense_class=details["dense_class"],
            )

    def dense_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        spec = spec_for(model_type_of(model.config))
        names = {id(module): name for name, module in model.named_modules()}
        weights: dict[str, torch.Tensor] = {}
        for module in streaming_mlps(model):
            tensors = layer_weights(module.runtime.store, module.layer)
            keys = mlp_weight_names(spec, self._owner_name(spec, names[id(module)]))
            if "gate_up" in keys:
                weights[keys["gate_up"]] = torch.cat([tensors["gate"], tensors["up"]]).contiguous()
            else:
                weights[keys["up"]] = tensors["up"].contiguous()
                if "gate" in keys:
                    weights[keys["gate"]] = tensors["gate"].contiguous()
            weights[keys["down"]] = tensors["down"].contiguous()
            if getattr(module, "up_bias", None) is not None:
                weights[keys["up_bias"]] = module.up_bias.detach().clone()
                weights[keys["down_bias"]] = module.down_bias.detach().clone()
        return weights

    @staticmethod
    def _owner_name(spec: MLPSpec, module_name: str) -> str:
        return module_name if spec.owner else module_name.rsplit(".", 1)[0]

    def restore(self, model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        spec = spec_for(model_type_of(model.config))
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, FlashMLP)]:
            dtype = module.runtime.store.dtype
            owner_name = self._owner_name(spec, name)
            if spec.owner:
                with torch.device("meta"):
                    dense = module.dense_class(text_config)
                model.set_submodule(name, dense.to_empty(device="cpu").to(dtype))
            else:
                layer = model.get_submodule(owner_name)
                bias = module.up_bias is not None
                setattr(layer, spec.up, nn.Linear(module.d_model, module.d_ff, bias=bias, dtype=dtype))
                setattr(layer, spec.down, nn.Linear(module.d_ff, module.d_model, bias=bias, dtype=dtype))
                setattr(layer, spec.act, module.act)
            for key in mlp_weight_names(spec, owner_name).values():
                if key in weights:
                    with torch.no_grad():
                        model.get_parameter(key).copy_(weights[key])


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
    FITTED_FILES: ClassVar[tuple[str, ...]] = ()
    """Files beside the store that decide which units the method selects (what `load_fitted` reads)."""
    CACHE_SPLIT: ClassVar[str] = "read-cost"
    """How the budget is shared between the method's caches unless `FlashConfig.cache_split` says."""
    replacer = MLPReplacer()

    @classmethod
    def store_kinds(cls, store: Store) -> tuple[str, ...]:
        """The unit kinds this module reads from `store` (derived by `add_kinds` if missing)."""
        return cls.KINDS

    @classmethod
    def check_store(cls, store: Store, config: FlashConfig) -> None:
        """Raise if `config`'s method cannot compute `store`'s MLP (checked for the configured method even
        at density 1, where the module is dense streaming)."""

    @classmethod
    def needs_unit_profile(cls, config: FlashConfig) -> bool:
        """Whether loading `config` with this module reads a unit profile from beside the store: to pin
        a hot set (`hot_share`), or to split the budget by it (`cache_split="profile"`)."""
        split = config.cache_split or cls.CACHE_SPLIT
        return config.policy != NO_CACHE and (bool(config.hot_share) or split == "profile")

    @classmethod
    def load_fitted(cls, store: Store, *, device: torch.device) -> Any:
        """What the method fitted on data and saved beside the store (DIP's calibration, the activation
        predictors), loaded once for every layer's module; None where it needs nothing. Its tensors go
        to `device`: the meta device under transformers' loader, where only their shapes are read."""
        return None

    @classmethod
    def make_runtime(cls, store: Store, config: FlashConfig, fitted: Any) -> FlashRuntime:
        """The runtime every layer's module of this class shares."""
        raise NotImplementedError

    @classmethod
    def build(
        cls,
        layer: int,
        runtime: FlashRuntime,
        act: nn.Module,
        *,
        fitted: Any,
        dense_class: type[nn.Module] | None,
    ) -> FlashMLP:
        """Layer `layer`'s module, its caches allocated from `runtime`'s budget plan."""
        raise NotImplementedError

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
        return [module for module in self._modules.values() if isinstance(module, NeuronCache)]

    @torch.no_grad()
    def reset_state(self) -> None:
        """Refill every buffer from its source: empty caches (their hot units pinned), a plain MLP's biases
        from the store.

        transformers' loader replaces all non-persistent buffers with uninitialized placeholders
        after weight loading; the quantizer calls this once loading is done.
        """
        self.runtime.reset_caches(self.layer)
        biases = [name for name in ("up_bias", "down_bias") if getattr(self, name, None) is not None]
        if biases:
            resident = self.runtime.store.resident(self.layer)
            for name in biases:
                getattr(self, name).copy_(resident[name])

    def settled_counters(self) -> tuple[int, int, int]:
        """`counters` once the cache updates queued for this layer have run (a forward's starting point:
        a queued update records its own evictions, `FlashRuntime.update_caches`)."""
        for kind in self.KINDS:
            self.runtime.settle(self.layer, kind)
        return self.counters()

    def counters(self) -> tuple[int, int, int]:
        """(hits, misses, evictions) summed over this module's caches."""
        hits = misses = evictions = 0
        for cache in self.caches():
            counts = cache.counters
            hits, misses, evictions = hits + counts.hits, misses + counts.misses, evictions + counts.evictions
        return hits, misses, evictions
