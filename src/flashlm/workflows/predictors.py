"""Train a store's activation predictors (`flashlm train predictors`): run the dense model over the
calibration splits of several corpora with hooks, label which neurons fire, train one low-rank predictor per
layer (PowerInfer §5.1's rank growth), and save them beside the model's store, where
`method="predictor"` finds them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from .._utils import available_memory_bytes, format_bytes
from ..config import FlashConfig
from ..data.corpora import DEFAULT_TRAIN_CORPORA, corpus_tokens
from ..data.models import model_path
from ..errors import ConfigError
from ..methods.base import method_class
from ..methods.mlp import open_checkpoint_store
from ..methods.predictor import PredictedNeuronsMLP
from ..predictors import LabelRule, Predictors, TrainOptions, collect_activations, train_predictors
from ..predictors.labels import sample_bytes
from ..store import Store


def train_store_predictors(
    model: str | os.PathLike | None = None,
    *,
    corpora: str | Sequence[str] = DEFAULT_TRAIN_CORPORA,
    tokens: int = 32768,
    sequence_length: int = 256,
    rule: LabelRule | None = None,
    options: TrainOptions | None = None,
    store: str | os.PathLike | None = None,
    method: str | None = None,
    progress: bool = True,
) -> Predictors:
    """Train and save the predictors of `model` (a bundled model's name, a checkpoint directory, or the
    default model) on `tokens` tokens in windows of `sequence_length` from the start of `corpora`'s
    calibration splits, an equal share each where a corpus has it (`window_shares`: a smaller one
    gives all it has, the others the rest); returns them, their per-layer reports in `.reports`.
    More tokens buy precision, and fewer missed activations on corpora other than the first (the
    measured figures for relufied SmolLM2 and Qwen2.5-1.5B are in the README, "Predictor-based
    loading"). The labelled rows are held in memory, inputs in the predictors' dtype and
    labels as bits: layers x (2 d_model + d_ff / 8) bytes per token in bf16, 40 KB for SmolLM2 and
    117 KB for Qwen2.5-1.5B; where they would not fit in the memory available once the model is
    loaded, a `ConfigError` says so before any is labelled.

    `rule` says what "active" means (default: exactly nonzero for ReLU-family models, the top 10% by
    magnitude otherwise); `store` the store to save beside (default: the model's, converted if
    missing). The predictors are held in the store's dtype unless `options.dtype` says otherwise.
    `method` (`"predictor"` or `"predictor-gate"`) is the loading method to size the predictors for:
    rank growth then also stops where a larger predictor no longer shrinks what a token touches
    (`TrainOptions.read_share`, unless `options` sets it); None grows them by recall alone, which
    keeps larger, more accurate predictors (on relufied Qwen2.5-1.5B, rank 512 against the 64-128
    that sizing for predictor-gate picks: perplexity 31.8 / 57.1 against 32.6 / 61.6, decoding
    2.55 against 2.87 tok/s).
    """
    from transformers import AutoTokenizer

    from ..training.checkpoints import load_checkpoint

    corpora = (corpora,) if isinstance(corpora, str) else tuple(corpora)
    if not corpora:
        raise ConfigError("Predictors need at least one corpus to learn from.")
    wanted = tokens // sequence_length if sequence_length >= 2 else 0
    if wanted < len(corpora):
        raise ConfigError(
            f"tokens ({tokens}) must hold at least one window of sequence_length ({sequence_length} >= 2) "
            f"per corpus ({len(corpora)}): ask for more tokens or a shorter sequence length."
        )
    path = Path(model_path(model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    splits = [corpus_tokens(corpus, tokenizer, split="calibration") for corpus in corpora]
    counts = window_shares([ids.numel() // sequence_length for ids in splits], wanted)
    if sum(counts) < wanted:
        held = ", ".join(f"{c}: {ids.numel()}" for c, ids in zip(corpora, splits, strict=True))
        raise ConfigError(
            f"The calibration splits hold fewer than the {tokens} tokens asked, in windows of "
            f"{sequence_length}, for this tokenizer ({held}): ask for fewer tokens or add a corpus."
        )
    windows = [
        ids[: count * sequence_length].view(-1, 1, sequence_length)
        for ids, count in zip(splits, counts, strict=True)
    ]
    target = open_checkpoint_store(path, FlashConfig(store=str(store) if store else None))
    options = options or TrainOptions()
    if options.dtype is None:
        options = replace(options, dtype=target.dtype)
    if options.read_share is None and method is not None:
        options = replace(options, read_share=read_share(method, target))
    dense = load_checkpoint(path, dtype=torch.float32)  # a relufied one with its FATReLU thresholds
    rows = sum(counts) * sequence_length
    needed = sample_bytes(rows, target.num_layers, target.d_model, target.d_ff, options.dtype)
    available = available_memory_bytes()
    if available is not None and needed > available:
        raise ConfigError(
            f"Labelling {rows} tokens would hold {format_bytes(needed)} of rows in memory "
            f"({format_bytes(needed / rows)} a token), but {format_bytes(available)} is available with "
            "the model loaded: ask for fewer tokens."
        )
    samples = collect_activations(
        dense,
        list(torch.cat(windows)),
        rule=rule,
        max_rows=tokens,
        input_dtype=options.dtype,
        progress=progress,
    )
    del dense
    predictors = train_predictors(samples, options, progress=progress)
    predictors.save(target)
    return predictors


def window_shares(available: Sequence[int], wanted: int) -> list[int]:
    """Windows to take from each corpus, at most `available[i]` from corpus i: `wanted` shared equally,
    a corpus with fewer giving all it has and the others making up the difference (filled smallest
    first, the largest taking what rounding leaves). They sum to less than `wanted` only where the
    corpora hold less."""
    counts = [0] * len(available)
    left = wanted
    order = sorted(range(len(available)), key=available.__getitem__)
    for done, i in enumerate(order):
        counts[i] = min(available[i], left // (len(available) - done))
        left -= counts[i]
    return counts


def read_share(method: str, store: Store) -> float:
    """`TrainOptions.read_share` for predictors that `method` will load from `store` (its
    `READ_SHARE`); `ConfigError` for a method that loads no predictors, or cannot load `store`'s MLP."""
    cls = method_class(method)
    if not issubclass(cls, PredictedNeuronsMLP):
        raise ConfigError(
            f"Predictors are sized for a method that loads them (predictor, predictor-gate), not "
            f"method={method!r}."
        )
    cls.check_store(store, FlashConfig(method=method))
    return cls.READ_SHARE
