"""`patch` / `unpatch`: swap every MLP of a model for a `StreamingMLP`, and back.

`replace_mlps` is the one create-and-replace walk, shared by `patch` (a model already in memory)
and the transformers quantizer (a model still on the meta device, before weight loading).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from transformers.quantizers.auto import AutoHfQuantizer

from ._utils import cache_dir
from .arch import MLPSpec, find_mlps, mlp_weight_names, model_type_of, spec_for
from .config import FlashConfig
from .endor.codec import decompress
from .endor.store import EndorStore, convert_endor, endor_layout
from .engine.runtime import FlashRuntime
from .engine.stats import FlashStats
from .engine.trace import Trace
from .errors import ConfigError, StoreMismatchError, UnsupportedArchitectureError
from .methods import FlashMLP, StreamingMLP, build_sparse_mlp, method_class, reads_ahead
from .methods.calibration import Calibration
from .methods.endor import EndorLinear, endor_linears, replace_linears
from .store import ModuleSource, SafetensorsSource, Store, add_kinds, convert, mlp_content_sha256
from .store.convert import layer_weights
from .store.format import update_content_hash

logger = logging.getLogger(__name__)
S = TypeVar("S")


def default_store_path(name: str, key: str, suffix: str = ".flash") -> Path:
    """Where a store lives when the config names none: `<cache>/stores/<name>-<key[:16]><suffix>`
    (`.flash` for MLP stores, `.endor` for Endor stores)."""
    safe_name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name or "model")
    return cache_dir() / "stores" / f"{safe_name}-{key[:16]}{suffix}"


def _open_or_convert(
    config: FlashConfig,
    name: str,
    key: str,
    suffix: str,
    convert_to: Callable[[Path], object],
    open_at: Callable[[Path], S],
) -> S:
    """The one store-opening policy: the store at `config.store`, or at the default path for `name`
    and `key` (a fingerprint or content hash); converted first (`convert_to(path)`, which writes to a
    temporary name and renames) if nothing is there. The caller checks that it matches the model."""
    path = Path(config.store).expanduser() if config.store else default_store_path(name, key, suffix)
    if not path.exists():
        logger.warning("flashlm: no store at %s; converting %s (one pass over the weights).", path, name)
        convert_to(path)
    return open_at(path)


def open_store_for_checkpoint(
    checkpoint_dir: str | Path, config: FlashConfig, *, progress: bool = True
) -> Store:
    """The MLP store of a safetensors checkpoint: opened and checked, or converted first if missing."""
    source = SafetensorsSource(checkpoint_dir)
    fingerprint = source.fingerprint()
    store = _open_or_convert(
        config,
        str(checkpoint_dir),
        fingerprint,
        ".flash",
        lambda path: convert(source, path, progress=progress),
        Store.open,
    )
    store.check_matches(model_type=source.model_type, fingerprint=fingerprint)
    return store


def open_store_for_module(model: nn.Module, config: FlashConfig, *, progress: bool = True) -> Store:
    """The MLP store of a model already in memory: opened and checked against its MLP weights, or
    converted."""
    source = ModuleSource(model)
    content = mlp_content_sha256(source)
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    store = _open_or_convert(
        config, name, content, ".flash", lambda path: convert(source, path, progress=progress), Store.open
    )
    store.check_matches(model_type=source.model_type, content_sha256=content)
    return store


def open_endor_store(
    source: SafetensorsSource | ModuleSource, model: nn.Module, config: FlashConfig, *, progress: bool = True
) -> EndorStore:
    """The Endor store of a (pruned) checkpoint or a model in memory: opened and checked, or compressed
    first."""
    fingerprint = source.fingerprint()
    name = source.path or getattr(model.config, "_name_or_path", "") or type(model).__name__
    key = fingerprint or _decoder_weights_sha256(source, model)
    store = _open_or_convert(
        config,
        str(name),
        key,
        ".endor",
        lambda path: convert_endor(source, path, endor_layout(model), progress=progress),
        EndorStore.open,
    )
    store.check_matches(model_type=source.model_type, fingerprint=fingerprint)
    if fingerprint is None and store.content_sha256 != key:
        raise StoreMismatchError(
            f"The Endor store {store.path} was compressed from other weights than this model's. Delete it or "
            "pass another `store=` path."
        )
    return store


def _decoder_weights_sha256(source: ModuleSource, model: nn.Module) -> str:
    """sha256 of the decoder linears' weights in layout order, as `convert_endor` records it."""
    digest = hashlib.sha256()
    for prefix, names in endor_layout(model):
        for name in names:
            update_content_hash(digest, {name: source.get(f"{prefix}.{name}.weight").contiguous()})
    return digest.hexdigest()


def patch_for_loading(model: nn.Module, checkpoint_dir: str | Path, config: FlashConfig) -> list[str]:
    """Swap `model`'s modules (still on the meta device) for flashlm's, reading the checkpoint's store
    (converted first if missing); returns the checkpoint keys that are no longer parameters."""
    if config.method == "endor":
        store = open_endor_store(SafetensorsSource(checkpoint_dir), model, config)
        return replace_linears(model, store, config)[1]
    spec = spec_for(model_type_of(model.config))
    owner_names = [name for _, name, _ in find_mlps(model, spec)]
    replace_mlps(model, open_store_for_checkpoint(checkpoint_dir, config), config)
    return [key for owner in owner_names for key in mlp_weight_names(spec, owner).values()]


def _target(spec: MLPSpec, owner_name: str) -> tuple[str, list[str]]:
    """Name of the module a `StreamingMLP` replaces, and sibling names that become `nn.Identity`.

    Where the projections have an owner of their own (`layers.3.mlp`), the owner is replaced.
    Where they sit on the decoder layer (OPT), the input projection is replaced and the
    activation and output projection become identities, so the layer's forward computes
    `identity(identity(streaming_mlp(x)))` unchanged.
    """
    if spec.owner:
        return owner_name, []
    return f"{owner_name}.{spec.up}", [f"{owner_name}.{spec.act}", f"{owner_name}.{spec.down}"]


def replace_mlps(model: nn.Module, store: Store, config: FlashConfig) -> FlashRuntime:
    """Swap every MLP of `model` for the module of `config.method` reading `store`; returns the runtime.

    Works on a model on the meta device (nothing of the MLPs is read) or in memory (the dense
    MLP weights are released). Unit layouts the method needs and the store lacks are derived
    from its bundles first. Caches are allocated on the CPU within `config.memory_budget`.
    """
    spec = spec_for(model_type_of(model.config))
    owners = find_mlps(model, spec)
    store.check_matches(num_layers=len(owners))
    cls = module_class(config)
    sparse = cls is not StreamingMLP
    if config.method != "dense" and not store.gated:
        raise ConfigError(
            f"method={config.method!r} prunes the projections of a gated (SwiGLU) MLP, but "
            f"{store.model_type}'s MLP is not gated. Use method='dense'."
        )
    if sparse and store.has_bias:
        raise UnsupportedArchitectureError(
            f"method={config.method!r} does not support MLP biases ({store.model_type} has them)."
        )
    kinds = cls.KINDS if sparse else StreamingMLP.kinds_for(store.gated)
    store = add_kinds(store, kinds)
    calibration = Calibration.load(store.path, store.content_sha256) if sparse else None
    with torch.device("cpu"):
        if sparse:
            read_ahead = (cls.INPUT_KIND,) if reads_ahead(config, store, calibration) else ()
            runtime = FlashRuntime(store, config, kinds, read_ahead, cls.slot_dtypes(store))
        else:
            runtime = FlashRuntime(store, config, read_ahead=None if config.read_ahead is not False else ())
        for layer, owner_name, owner in owners:
            act = getattr(owner, spec.act)
            dense_class = type(owner) if spec.owner else None
            if sparse:
                module = build_sparse_mlp(
                    config, layer, runtime, act, calibration=calibration, dense_class=dense_class
                )
                module.measure_products()  # at load, not in the first forward
            else:
                resident = store.resident(layer)
                module = StreamingMLP(
                    layer,
                    runtime,
                    {kind: runtime.make_cache(layer, kind) for kind in kinds},
                    act,
                    gated=store.gated,
                    d_model=store.d_model,
                    d_ff=store.d_ff,
                    up_bias=resident.get("up_bias"),
                    down_bias=resident.get("down_bias"),
                    dense_class=dense_class,
                )
            target, identities = _target(spec, owner_name)
            model.set_submodule(target, module)
            for name in identities:
                model.set_submodule(name, nn.Identity())
    return runtime


def module_class(config: FlashConfig) -> type[FlashMLP]:
    """The module that computes `config`: its method's, except at density 1.0, where every method keeps
    every unit and is dense streaming, computed exactly as the dense model (the DIP paper's density-1
    point; a sparse module would sum its products in another order)."""
    return StreamingMLP if config.density == 1 else method_class(config.method)


def streaming_mlps(model: nn.Module) -> list[FlashMLP]:
    """The flashlm MLP modules of `model`, in module order."""
    return [module for module in model.modules() if isinstance(module, FlashMLP)]


def _runtime_of(model: nn.Module) -> FlashRuntime:
    modules = streaming_mlps(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} is not patched by flashlm: call flashlm.patch(model) first."
        )
    return modules[0].runtime


def patch(model: nn.Module, config: FlashConfig | None = None, *, progress: bool = True) -> nn.Module:
    """Swap the MLPs of an already-loaded model for streaming ones, in place; returns the model.

    The store named by `config.store` (or a default one in flashlm's cache) is checked against the
    model's MLP weights, or converted from them if it does not exist. Use this to stack flashlm on
    a model whose quantization slot is taken (bitsandbytes); otherwise prefer
    `from_pretrained(..., quantization_config=FlashConfig(...))`, which never loads the MLPs.
    """
    config = config or FlashConfig()
    if streaming_mlps(model) or endor_linears(model):
        raise ValueError("The model is already patched by flashlm; call flashlm.unpatch(model) first.")
    spec_for(model_type_of(model.config))  # an unsupported architecture fails before any hashing
    if config.method == "endor":
        replace_linears(
            model, open_endor_store(ModuleSource(model), model, config, progress=progress), config
        )
    else:
        replace_mlps(model, open_store_for_module(model, config, progress=progress), config)
    if getattr(model, "hf_quantizer", None) is None and hasattr(model, "config"):
        # transformers' registry holds flashlm's quantizer (`integrations.transformers.register`):
        # saving the model then goes through it, as after `from_pretrained`.
        model.hf_quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
        model.config.quantization_config = config
        model.is_quantized = True
    return model


def dense_mlp_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The original MLP tensors (checkpoint names), read back from the store: for saving and unpatching."""
    spec = spec_for(model_type_of(model.config))
    names = {id(module): name for name, module in model.named_modules()}
    weights: dict[str, torch.Tensor] = {}
    for module in streaming_mlps(model):
        tensors = layer_weights(module.runtime.store, module.layer)
        name = names[id(module)]
        owner_name = name if spec.owner else name.rsplit(".", 1)[0]
        keys = mlp_weight_names(spec, owner_name)
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


def endor_dense_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of an Endor-offloaded model's `EndorLinear`s, decompressed, by checkpoint name
    (each layer's file read once)."""
    layers: dict[int, dict] = {}
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, EndorLinear):
            if module.layer not in layers:
                layers[module.layer] = module.runtime.store.load_layer(module.layer)
            weights[f"{name}.weight"] = decompress(layers[module.layer][module.name])
    return weights


def _unpatch_endor(model: nn.Module) -> None:
    runtime = endor_linears(model)[0].runtime
    weights = endor_dense_weights(model)
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, EndorLinear)]:
        linear = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        linear.weight = nn.Parameter(weights[f"{name}.weight"], requires_grad=False)
        linear.bias = module.bias
        model.set_submodule(name, linear)
    runtime.close()


def unpatch(model: nn.Module) -> nn.Module:
    """Put dense MLPs (or, for Endor, dense linears) back, weights read from the store, in place; returns
    the model."""
    if endor_linears(model):
        _unpatch_endor(model)
        _forget_quantizer(model)
        return model
    spec = spec_for(model_type_of(model.config))
    weights = dense_mlp_weights(model)
    runtime = _runtime_of(model)
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, FlashMLP)]:
        dtype = runtime.store.dtype
        if spec.owner:
            with torch.device("meta"):
                dense = module.dense_class(text_config)
            dense = dense.to_empty(device="cpu").to(dtype)
            model.set_submodule(name, dense)
            owner_name = name
        else:
            owner_name = name.rsplit(".", 1)[0]
            layer = model.get_submodule(owner_name)
            d_model, d_ff = module.d_model, module.d_ff
            bias = module.up_bias is not None
            setattr(layer, spec.up, nn.Linear(d_model, d_ff, bias=bias, dtype=dtype))
            setattr(layer, spec.down, nn.Linear(d_ff, d_model, bias=bias, dtype=dtype))
            setattr(layer, spec.act, module.act)
        for key in mlp_weight_names(spec, owner_name).values():
            if key in weights:
                target = model.get_parameter(key)
                with torch.no_grad():
                    target.copy_(weights[key])
    runtime.close()
    _forget_quantizer(model)
    return model


def _forget_quantizer(model: nn.Module) -> None:
    quantizer = getattr(model, "hf_quantizer", None)
    if isinstance(getattr(quantizer, "quantization_config", None), FlashConfig):
        del model.hf_quantizer
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False


def stats(model: nn.Module, *, reset: bool = False) -> FlashStats:
    """Counters since the last reset: bytes read, reads, hits/misses, I/O / cache / compute time
    (for an Endor-offloaded model: bytes read and moved, read / move / decompress / compute time).

    `reset=True` clears them after taking the snapshot (also the caches' counters).
    """
    if linears := endor_linears(model):
        snapshot = linears[0].runtime.snapshot()
        if reset:
            linears[0].runtime.reset_stats()
        return snapshot
    modules = streaming_mlps(model)
    runtime = _runtime_of(model)
    runtime.drain()  # queued cache updates hold evictions not yet counted
    snapshot = runtime.snapshot()
    if reset:
        runtime.stats.reset()
        if runtime.trace is not None:
            runtime.trace.reset()
        for module in modules:
            for cache in module.caches():
                cache.reset_counters()
    return snapshot


def trace(model: nn.Module) -> Trace:
    """Which units each layer used at each step since the last reset (`record_trace=True` runs only)."""
    runtime = _runtime_of(model)
    runtime.drain()
    if runtime.trace is None:
        raise ValueError("This model records no trace: patch it with FlashConfig(record_trace=True).")
    store = runtime.store
    return runtime.trace.finish(
        num_layers=store.num_layers,
        num_units={kind: store.row_file(0, kind).rows for kind in runtime.kinds},
        unit_bytes={kind: store.row_file(0, kind).row_bytes for kind in runtime.kinds},
        metadata={"model_type": store.model_type, **runtime.config.to_dict()},
    )
