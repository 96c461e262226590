"""`flashlm profile`: measure how often a sparse method needs each unit on text, and save that unit
profile beside the store, where `FlashConfig(hot_share=...)` places its hot set from
(`flashlm.cache.profile`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..cache.profile import ProfileMissingError, UnitProfile, fitted_digests, profile_key
from ..config import FlashConfig
from ..data.corpora import corpus_tokens
from ..data.models import model_path as resolve_model_path
from ..engine.trace import Trace
from ..errors import ConfigError
from ..eval.perplexity import load_streaming, release
from ..methods.base import method_class
from ..methods.mlp import open_checkpoint_store
from ..patching import runtime_of, trace

RESIDENT_BUDGET = "300%"
"""A budget that holds every unit of a sparse method's kinds, their staging buffers, and column kinds held in
float32 (twice the store's bytes): the caches allocate only what their units take."""


def decode_trace(
    model: torch.nn.Module, input_ids: torch.Tensor, *, context_length: int, progress: bool = True
) -> Trace:
    """The trace of a model patched with `record_trace=True` decoding `input_ids` one token at a time, in
    windows of `context_length` tokens: each step holds the units one token needed, as decoding asks."""
    windows = input_ids.numel() // context_length
    if windows == 0:
        raise ConfigError(
            f"Profiling decodes whole windows of context_length={context_length} tokens, but only "
            f"{input_ids.numel()} tokens were given: pass more tokens or a smaller context_length."
        )
    trace(model, reset=True)  # the profile counts these steps only
    bar = tqdm(total=windows * context_length, desc="decoding units", unit="tok", disable=not progress)
    with torch.no_grad():
        for window in range(windows):
            past = None
            for position in range(window * context_length, (window + 1) * context_length):
                out = model(
                    input_ids[position : position + 1].unsqueeze(0), past_key_values=past, use_cache=True
                )
                past = out.past_key_values
                bar.update()
    bar.close()
    return trace(model)


def profile_model(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    corpus: str,
    context_length: int,
    progress: bool = True,
) -> UnitProfile:
    """The unit profile of a model patched with `record_trace=True`, from its `decode_trace`."""
    runtime = runtime_of(model)
    recorded = decode_trace(model, input_ids, context_length=context_length, progress=progress)
    store, config = runtime.store, runtime.config
    return UnitProfile.from_trace(
        recorded,
        content_sha256=store.content_sha256,
        key=profile_key(config),
        fitted=fitted_digests(store.path, method_class(config.method).FITTED_FILES),
        corpus=corpus,
    )


def profile_units(
    model_path: str | os.PathLike | None,
    config: FlashConfig,
    *,
    corpus: str = "shakespeare",
    num_tokens: int = 2048,
    context_length: int = 256,
    progress: bool = True,
) -> tuple[UnitProfile, Path]:
    """Profile the sparse method of `config` (its `profile_key`: method, density, input split) on the
    calibration split of `corpus`, and save the profile beside the model's store (`config.store`, or the
    default one); returns it and its path.

    The model decodes with a budget that holds every unit, so nothing is read after the first token and
    a cache-aware selection sees every unit resident (it is then the plain method's)."""
    from transformers import AutoTokenizer

    key = profile_key(config)
    if key["method"] == "dense" or key["density"] == 1:
        raise ConfigError(
            "Dense streaming (or density 1.0) needs every unit every token: there is nothing to profile. "
            "Give a sparse method and a density below 1."
        )
    path = resolve_model_path(None if model_path is None else str(model_path))
    ids = corpus_tokens(corpus, AutoTokenizer.from_pretrained(path), split="calibration")[:num_tokens]
    # The budget holds every unit, so how it is split does not matter (and needs no profile).
    profiled = FlashConfig(
        **key, store=config.store, memory_budget=RESIDENT_BUDGET, cache_split="size", record_trace=True
    )
    model = load_streaming(path, profiled)
    try:
        profile = profile_model(model, ids, corpus=corpus, context_length=context_length, progress=progress)
        return profile, profile.save(runtime_of(model).store.path)
    finally:
        release(model)


def load_or_profile(
    model_path: str | os.PathLike | None, config: FlashConfig, *, progress: bool = True, **options: Any
) -> UnitProfile:
    """The unit profile of `config`'s method saved beside the model's store, measured first
    (`profile_units(model_path, config, **options)`) when there is none or it is stale."""
    path = resolve_model_path(None if model_path is None else str(model_path))
    store = open_checkpoint_store(path, config, progress=progress)
    fitted_files = method_class(config.method).FITTED_FILES
    try:
        return UnitProfile.of(store, config, fitted_files, needed_by=f"method={config.method!r}")
    except ProfileMissingError:
        return profile_units(path, config, progress=progress, **options)[0]
