"""`patch` / `unpatch`: put flashlm's modules into a model in place of what its method replaces, and back.

`replace_modules` is the one create-and-replace walk for every method (peft's `_create_and_replace`
shape), shared by `patch` (a model already in memory) and the transformers quantizer (a model still on
the meta device, before weight loading). Each method family's `Replacer` (`methods/mlp.py`,
`methods/endor.py`) says which store it reads, which modules it replaces and what it puts there.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.quantizers.auto import AutoHfQuantizer

from .activations import restore_relufication
from .arch import model_type_of, spec_for
from .config import FlashConfig
from .engine.runtime import Runtime
from .engine.stats import FlashStats
from .engine.trace import Trace
from .methods import method_class
from .methods.base import Replacer, flashlm_modules, runtime_of
from .methods.mlp import streaming_mlps

__all__ = [
    "dense_weights",
    "flashlm_modules",
    "patch",
    "patch_for_loading",
    "replace_modules",
    "replacer_of",
    "runtime_of",
    "stats",
    "streaming_mlps",
    "trace",
    "unpatch",
]


def replacer_of(config: FlashConfig) -> Replacer:
    """The `Replacer` of `config.method`'s family."""
    return method_class(config.method).replacer


def replace_modules(model: nn.Module, store: object, config: FlashConfig) -> tuple[Runtime, list[str]]:
    """Replace every module `config.method` replaces in `model` with the method's module reading `store`.

    Works on a model on the meta device (nothing of what is replaced is read) or in memory (the
    replaced weights are released). Returns the runtime the new modules share and the checkpoint keys
    that are no longer parameters.
    """
    replacer = replacer_of(config)
    runtime, targets = replacer.prepare(model, store, config)
    for target in targets:
        model.set_submodule(target.name, replacer.create(runtime, target))
        for name in target.identities:
            model.set_submodule(name, nn.Identity())
    return runtime, [key for target in targets for key in target.released]


def patch_for_loading(model: nn.Module, checkpoint_dir: str | Path, config: FlashConfig) -> list[str]:
    """Swap `model`'s modules (still on the meta device) for flashlm's, reading the checkpoint's store
    (converted first if missing); returns the checkpoint keys that are no longer parameters. A relufied
    checkpoint (built from its `buildable_config`) gets its FATReLU thresholds back first."""
    restore_relufication(model)
    store = replacer_of(config).open_store(model, config, Path(checkpoint_dir))
    return replace_modules(model, store, config)[1]


def patch(model: nn.Module, config: FlashConfig | None = None, *, progress: bool = True) -> nn.Module:
    """Swap the MLPs of an already-loaded model for streaming ones, in place; returns the model.

    The store named by `config.store` (or a default one in flashlm's cache) is checked against the
    model's MLP weights, or converted from them if it does not exist. Use this to stack flashlm on
    a model whose quantization slot is taken (bitsandbytes); otherwise prefer
    `from_pretrained(..., quantization_config=FlashConfig(...))`, which never loads the MLPs.
    """
    config = config or FlashConfig()
    if flashlm_modules(model):
        raise ValueError("The model is already patched by flashlm; call flashlm.unpatch(model) first.")
    spec_for(model_type_of(model.config))  # an unsupported architecture fails before any hashing
    replacer = replacer_of(config)
    replace_modules(model, replacer.open_store(model, config, None, progress=progress), config)
    if getattr(model, "hf_quantizer", None) is None and hasattr(model, "config"):
        # transformers' registry holds flashlm's quantizer (`integrations.transformers.register`):
        # saving the model then goes through it, as after `from_pretrained`.
        model.hf_quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
        model.config.quantization_config = config
        model.is_quantized = True
    return model


def dense_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights flashlm's modules replaced, by checkpoint name, read back from the store: for saving a
    complete checkpoint and for unpatching."""
    return _replacer_and_runtime(model)[0].dense_weights(model)


def unpatch(model: nn.Module) -> nn.Module:
    """Put the dense modules back, weights read from the store, in place; returns the model."""
    replacer, runtime = _replacer_and_runtime(model)
    replacer.restore(model, replacer.dense_weights(model))
    runtime.close()
    _forget_quantizer(model)
    return model


def _replacer_and_runtime(model: nn.Module) -> tuple[Replacer, Runtime]:
    runtime = runtime_of(model)  # a model flashlm did not patch gets the error that says so
    return type(flashlm_modules(model)[0]).replacer, runtime


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
    runtime = runtime_of(model)
    runtime.drain()  # queued cache updates hold evictions not yet counted
    snapshot = runtime.snapshot()
    if reset:
        runtime.reset_stats()
    return snapshot


def trace(model: nn.Module, *, reset: bool = False) -> Trace:
    """Which units each layer used at each step since the model was loaded (`record_trace=True` runs
    only), prefill steps included: replayed from empty caches (`flashlm.sim.replay`), it gives the run's
    own hits and misses (a run without a pinned hot set, which the replay does not pin).
    `flashlm.stats(model, reset=True)` does not clear it: leave earlier steps out of the simulator's
    means with its `warmup`.

    `reset=True` forgets the steps after taking the trace: the next one then starts from caches that
    are not empty, so a replay of it from empty ones only approximates the run.
    """
    runtime = runtime_of(model)
    if getattr(runtime, "trace", None) is None:
        raise ValueError("This model records no trace: patch it with FlashConfig(record_trace=True).")
    runtime.drain()
    store = runtime.store
    recorded = runtime.trace.finish(
        num_layers=store.num_layers,
        num_units={kind: store.row_file(0, kind).rows for kind in runtime.kinds},
        unit_bytes={kind: store.row_file(0, kind).row_bytes for kind in runtime.kinds},
        metadata={
            "model_type": store.model_type,
            **runtime.config.to_dict(),
            # how the run read, for the simulator to plan the trace's reads the same way: the kinds read
            # ahead whole (every unit not resident) and how the reader cut its reads
            "read_ahead": list(runtime.read_ahead),
            **({"reader": runtime.reader.plan_settings} if runtime.reader is not None else {}),
        },
    )
    if reset:
        runtime.trace.reset()
    return recorded
