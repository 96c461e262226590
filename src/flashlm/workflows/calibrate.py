"""`flashlm calibrate`: measure a model's sparse-method calibration on a corpus and save it beside
the store (the record and its use: `flashlm.methods.calibration`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .._version import __version__
from ..config import FlashConfig
from ..data.corpora import corpus_tokens
from ..data.models import default_model_path
from ..errors import ConfigError
from ..eval.perplexity import perplexity
from ..methods.calibration import Calibration, fit_split
from ..methods.sparse import DIPMLP
from ..patching import streaming_mlps

QUANTILE_LEVELS = 201
"""Quantiles are stored at levels 0, 0.005, ..., 1."""
SAMPLES_PER_LAYER = 1_000_000
"""Magnitudes kept per layer (a uniform random subset) to compute its quantiles."""
SPLIT_GRID = (0.25, 0.4, 0.55, 0.7, 0.85, 1.0)
"""ρ_in and ρ_down values whose combinations `calibrate` measures."""


def _quantiles(samples: torch.Tensor) -> list[float]:
    levels = torch.linspace(0, 1, QUANTILE_LEVELS, dtype=torch.float64)
    return torch.quantile(samples.double(), levels).tolist()


def _subsample(values: torch.Tensor, limit: int, generator: torch.Generator) -> torch.Tensor:
    flat = values.reshape(-1).float()
    if flat.numel() <= limit:
        return flat
    return flat[torch.randint(flat.numel(), (limit,), generator=generator)]


CALIBRATION_OPTIONS = {"density": 0.9, "input_density": 1.0}
"""A DIP configuration below density 1.0, so the model gets DIP modules (at 1.0 it would be dense
streaming); `calibrate_model` sets every module's `k_in` and `k_out` itself."""


def calibrate_model(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    corpus: str = "",
    context_length: int = 512,
    num_tokens: int = 2048,
    split: bool = True,
    progress: bool = True,
) -> Calibration:
    """Calibrate a model patched with `FlashConfig(method="dip", **CALIBRATION_OPTIONS)` on `input_ids`
    and save the result.

    Magnitudes come from forward pre-hooks on the MLP modules (their input x) and from the store's
    gate rows (`act(gate x)`); the split grid re-runs the perplexity with each (ρ_in, ρ_down).
    """

    modules = [m for m in streaming_mlps(model) if isinstance(m, DIPMLP)]
    if not modules or any(type(m) is not DIPMLP for m in modules):
        raise ValueError(
            "calibrate_model needs a model patched with DIP modules: FlashConfig(method='dip', "
            "**flashlm.workflows.calibrate.CALIBRATION_OPTIONS)."
        )
    available = min(num_tokens, input_ids.numel())
    if available < context_length:
        raise ConfigError(
            f"Calibration scores whole windows of context_length={context_length} tokens, but only "
            f"{available} tokens are available (num_tokens={num_tokens}, {input_ids.numel()} in the corpus): "
            "pass more tokens or a smaller context_length."
        )
    runtime = modules[0].runtime
    store = runtime.store
    windows = available // context_length
    ids = input_ids[: windows * context_length]

    inputs: dict[int, list[torch.Tensor]] = {m.layer: [] for m in modules}
    handles = [
        m.register_forward_pre_hook(
            lambda mod, args: inputs[mod.layer].append(args[0].detach().reshape(-1, mod.d_model))
        )
        for m in modules
    ]
    saved = [(m.k_in, m.k_out) for m in modules]
    try:
        for m in modules:
            m.k_in, m.k_out = m.d_model, m.d_ff
        perplexity(model, ids, context_length=context_length, progress=progress)
    finally:
        for handle in handles:
            handle.remove()
        for m, (k_in, k_out) in zip(modules, saved, strict=True):
            m.k_in, m.k_out = k_in, k_out

    generator = torch.Generator().manual_seed(0)
    input_quantiles, gate_quantiles, pooled = [], [], []
    for m in tqdm(modules, desc="Calibrating magnitudes", unit="layer", disable=not progress):
        x = torch.cat(inputs.pop(m.layer))
        sample = _subsample(x.abs(), SAMPLES_PER_LAYER, generator)
        input_quantiles.append(_quantiles(sample))
        pooled.append(_subsample(sample, SAMPLES_PER_LAYER // len(modules) + 1, generator))
        with safe_open(store.row_file(m.layer, "dip_in").path, framework="pt") as f:
            gate_t = f.get_tensor("rows")[:, m.d_ff :]  # dip_in row i: up[:, i] | gate[:, i]
        gate_act = m.act(x.float() @ gate_t.float())
        gate_quantiles.append(_quantiles(_subsample(gate_act.abs(), SAMPLES_PER_LAYER, generator)))
        del x, gate_act
    calibration = Calibration(
        content_sha256=store.content_sha256,
        corpus=corpus,
        tokens=int(ids.numel()),
        input_quantiles=input_quantiles,
        global_input_quantiles=_quantiles(torch.cat(pooled)),
        gate_quantiles=gate_quantiles,
        flashlm_version=__version__,
    )
    if split:
        calibration.split_points = _split_grid(model, modules, ids, context_length, progress)
        calibration.split_fit = fit_split(calibration.split_points)
    calibration.save(store.path)
    return calibration


def _split_grid(model, modules, ids, context_length, progress) -> list[dict[str, Any]]:

    grid = [(rho_in, rho_down) for rho_in in SPLIT_GRID for rho_down in SPLIT_GRID]
    points = []
    saved = [(m.k_in, m.k_out) for m in modules]
    try:
        for rho_in, rho_down in tqdm(grid, desc="Calibrating the DIP density split", disable=not progress):
            for m in modules:
                m.k_in = min(m.d_model, max(1, round(rho_in * m.d_model)))
                m.k_out = min(m.d_ff, max(1, round(rho_down * m.d_ff)))
            result = perplexity(model, ids, context_length=context_length, progress=False)
            points.append(
                {
                    "rho_in": rho_in,
                    "rho_down": rho_down,
                    "density": (2 * rho_in + rho_down) / 3,
                    "perplexity": result.perplexity,
                }
            )
    finally:
        for m, (k_in, k_out) in zip(modules, saved, strict=True):
            m.k_in, m.k_out = k_in, k_out
    return points


def calibrate(
    model_path: str | os.PathLike | None = None,
    *,
    corpus: str = "shakespeare",
    store: str | os.PathLike | None = None,
    memory_budget: int | str | None = None,
    num_tokens: int = 2048,
    context_length: int = 512,
    split: bool = True,
    progress: bool = True,
) -> Calibration:
    """Calibrate the model at `model_path` (default: the embedded SmolLM2) on a corpus's calibration split.

    Writes `calibration.json` into the model's store (`store`, or the default one) and returns it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path) if model_path is not None else default_model_path(progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = corpus_tokens(corpus, tokenizer, split="calibration")
    config = FlashConfig(method="dip", store=store, memory_budget=memory_budget, **CALIBRATION_OPTIONS)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    model.eval()
    return calibrate_model(
        model,
        ids,
        corpus=corpus,
        context_length=context_length,
        num_tokens=num_tokens,
        split=split,
        progress=progress,
    )


def load_or_calibrate(
    model_path: str | os.PathLike | None = None,
    *,
    corpus: str = "shakespeare",
    store: str | os.PathLike | None = None,
    progress: bool = True,
    **options: Any,
) -> Calibration:
    """The calibration saved in the model's store for these weights, or a new one (`calibrate(model_path,
    corpus=corpus, store=store, **options)`) when there is none."""
    from ..methods.mlp import open_checkpoint_store

    path = Path(model_path) if model_path is not None else default_model_path(progress=progress)
    opened = open_checkpoint_store(path, FlashConfig(store=store), progress=progress)
    saved = Calibration.load(opened.path, opened.content_sha256)
    if saved is not None:
        return saved
    return calibrate(path, corpus=corpus, store=store, progress=progress, **options)
