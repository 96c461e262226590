"""Perplexity of a causal LM on a token stream, with the MLP density and I/O a flashlm model achieved.

`perplexity(model, ids)` cuts `ids` into non-overlapping windows of `context_length` tokens, runs
one forward pass per window and averages the next-token negative log-likelihood of every predicted
token (`context_length - 1` per window), summed in float64. On a model patched by flashlm it resets
the stats first and reads them after, so the result carries the achieved MLP density, the bytes read
and the cache hit rate of exactly that evaluation.

`evaluate(model_path, corpus, method_spec=..., density=...)` loads a model with
`FlashConfig(**parse_method_spec(method_spec), density=...)` and measures it on a corpus's test split.
Method specs name the DIP paper's methods and variants:

| spec | FlashConfig options |
|---|---|
| `dense`, `dip`, `glu`, `gate`, `up`, `cats`, `endor` | `method=<spec>` |
| `dip-ca` | `method="dip", cache_aware=0.2` (the paper's γ) |
| `dip-ca:<γ>` | `method="dip", cache_aware=<γ>` |
| `dip-layer`, `dip-global` | `method="dip", threshold="layer"` / `"global"` |
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .._utils import model_device
from ..config import FlashConfig
from ..errors import ConfigError
from ..methods.specs import parse_method_spec


@dataclass(frozen=True)
class PerplexityResult:
    """What `perplexity` measured.

    `tokens` counts predicted tokens (`windows * (context_length - 1)`); `tokens_per_second` counts
    every token that went through the model (`windows * context_length`) over `seconds`, the time of
    the forward passes. `mlp_density` is the fraction of MLP weight bytes used per token (1.0 for a
    model flashlm did not patch); `bytes_read` what flashlm's reader fetched (0 unpatched); `hit_rate`
    its caches' hit rate (NaN when there is none).
    """

    perplexity: float
    nll: float
    tokens: int
    windows: int
    context_length: int
    seconds: float
    tokens_per_second: float
    mlp_density: float = 1.0
    bytes_read: float = 0.0
    hit_rate: float = math.nan

    @property
    def input_tokens(self) -> int:
        """Tokens that went through the model: `windows * context_length`."""
        return self.windows * self.context_length

    @property
    def bytes_read_per_token(self) -> float:
        return self.bytes_read / self.input_tokens if self.input_tokens else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_read_per_token": self.bytes_read_per_token}


def num_windows(available: int, context_length: int, num_tokens: int | None = None) -> int:
    """How many whole windows of `context_length` fit in `min(num_tokens, available)` tokens.

    The one rule every caller checks (the harness, `evaluate` and `sweep` before loading, `flashlm
    bench` before its first run): one window needs `context_length` tokens, both asked for and
    present. Raises `ConfigError` (a `ValueError`) for invalid arguments or when not even one window
    fits, saying which of the two is short.
    """
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 2:
        raise ConfigError(
            f"context_length must be an int >= 2 (one token predicts the next), got {context_length!r}."
        )
    if num_tokens is not None and (
        isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1
    ):
        raise ConfigError(f"num_tokens must be a positive int or None, got {num_tokens!r}.")
    usable = available if num_tokens is None else min(num_tokens, available)
    windows = usable // context_length
    if windows >= 1:
        return windows
    if num_tokens is not None and num_tokens < context_length:
        raise ConfigError(
            f"Not enough tokens for one window: num_tokens={num_tokens} asked, but one window of "
            f"context_length={context_length} needs {context_length} tokens. Ask for at least "
            f"{context_length} tokens, or use a shorter context_length."
        )
    raise ConfigError(
        f"Not enough tokens for one window: the token stream holds {available} tokens, but one window "
        f"of context_length={context_length} needs {context_length}. Use a longer token stream, or a "
        "shorter context_length."
    )


def _stream(input_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}.")
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(
            f"input_ids must be a 1-D token stream (or [1, n]), got shape {tuple(input_ids.shape)}."
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}.")
    return input_ids.long()


def window_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> float:
    """Summed next-token NLL of one `[1, L]` window from its `[1, L, vocab]` logits, in float64."""
    predicted = logits[0, :-1].float()
    targets = input_ids[0, 1:].to(predicted.device)
    return F.cross_entropy(predicted, targets, reduction="none").double().sum().item()


def perplexity(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    context_length: int = 512,
    num_tokens: int | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of `model` on the token stream `input_ids` (1-D), window by window.

    Windows are non-overlapping, `context_length` tokens each, taken from the start of `input_ids`
    until `num_tokens` tokens (all of them if None) are used; a partial last window is dropped. Each
    window is one forward pass under `torch.no_grad()`; perplexity is `exp` of the mean NLL over the
    predicted tokens. A model patched by flashlm has its stats reset before and read after.
    """
    from tqdm.auto import tqdm

    from ..patching import flashlm_modules, stats

    ids = _stream(input_ids)
    windows = num_windows(ids.numel(), context_length, num_tokens)
    device = model_device(model)
    patched = bool(flashlm_modules(model))
    if patched:
        stats(model, reset=True)
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            started = time.perf_counter()
            for w in tqdm(range(windows), desc="perplexity", unit="window", disable=not progress):
                window = ids[w * context_length : (w + 1) * context_length].unsqueeze(0).to(device)
                logits = model(input_ids=window, use_cache=False).logits
                total += window_nll(logits, window)
                del logits
            seconds = time.perf_counter() - started
    finally:
        model.train(was_training)
    predicted = windows * (context_length - 1)
    nll = total / predicted
    density, bytes_read, hit_rate = 1.0, 0.0, math.nan
    if patched:
        snapshot = stats(model)
        totals = snapshot.totals()
        density = snapshot.density()
        bytes_read, hit_rate = totals["bytes_read"], totals["hit_rate"]
    return PerplexityResult(
        perplexity=math.exp(nll),
        nll=nll,
        tokens=predicted,
        windows=windows,
        context_length=context_length,
        seconds=seconds,
        tokens_per_second=windows * context_length / seconds if seconds > 0 else math.inf,
        mlp_density=float(density),
        bytes_read=float(bytes_read),
        hit_rate=float(hit_rate),
    )


def load_model(
    model_path: str | os.PathLike | None = None,
    *,
    method_spec: str = "dense",
    density: float = 1.0,
    memory_budget: int | str | None = None,
    store: str | os.PathLike | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    progress: bool = True,
    **config_kwargs: Any,
) -> torch.nn.Module:
    """The checkpoint with flashlm's MLPs for `method_spec` at `density` (`load_streaming`), eval mode.

    `config_kwargs` are further `FlashConfig` options (`policy`, `input_density`, ...); `model_path`
    defaults to the embedded SmolLM2.
    """

    from ..data.models import default_model_path

    path = Path(model_path) if model_path is not None else default_model_path(progress=progress)
    options = {**parse_method_spec(method_spec), **config_kwargs}
    config = FlashConfig(
        density=density,
        memory_budget=memory_budget,
        store=str(store) if store is not None else None,
        **options,
    )
    kwargs = {"dtype": dtype} if dtype is not None else {}
    return load_streaming(path, config, **kwargs)


def load_streaming(path: str | os.PathLike, config: FlashConfig, **kwargs: Any) -> torch.nn.Module:
    """The checkpoint at `path` with flashlm's MLPs (`config`), eval mode: through `from_pretrained`,
    which never loads the MLPs; a relufied checkpoint is built from its `buildable_config` (the loader
    puts its FATReLU thresholds back before the MLPs are swapped). `kwargs` go to `from_pretrained`."""
    from transformers import AutoModelForCausalLM

    from ..training.checkpoints import buildable_config

    kwargs.setdefault("config", buildable_config(path))
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, **kwargs).eval()


def release(model: torch.nn.Module) -> None:
    """Stop a flashlm model's reader threads and close its store files (the model is unusable after)."""
    from ..patching import flashlm_modules, runtime_of

    if flashlm_modules(model):
        runtime_of(model).close()


def evaluate(
    model_path: str | os.PathLike | None = None,
    corpus: str | torch.Tensor = "shakespeare",
    *,
    method_spec: str = "dense",
    density: float = 1.0,
    context_length: int = 512,
    num_tokens: int | None = 4096,
    memory_budget: int | str | None = None,
    store: str | os.PathLike | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    progress: bool = True,
    **config_kwargs: Any,
) -> PerplexityResult:
    """Perplexity of the model at `model_path` (default: the embedded SmolLM2) loaded with
    `FlashConfig(**parse_method_spec(method_spec), density=density, ...)` on the test split of corpus
    `corpus` (a name of `CORPORA`, or a 1-D tensor of token ids), using `num_tokens` of it.
    """
    from ..data.corpora import corpus_tokens, require
    from ..data.models import default_model_path

    if not isinstance(corpus, torch.Tensor):
        require(corpus)  # an unknown or missing corpus fails before anything loads
    parse_method_spec(method_spec)
    path = Path(model_path) if model_path is not None else default_model_path(progress=progress)
    if isinstance(corpus, torch.Tensor):
        ids = corpus
    else:
        from transformers import AutoTokenizer

        ids = corpus_tokens(corpus, AutoTokenizer.from_pretrained(path), split="test")
    num_windows(_stream(ids).numel(), context_length, num_tokens)  # bad arguments fail before loading
    model = load_model(
        path,
        method_spec=method_spec,
        density=density,
        memory_budget=memory_budget,
        store=store,
        dtype=dtype,
        progress=progress,
        **config_kwargs,
    )
    try:
        return perplexity(model, ids, context_length=context_length, num_tokens=num_tokens, progress=progress)
    finally:
        release(model)
        del model
