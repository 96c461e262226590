"""Wanda pruning: the unstructured (or N:M) sparse weights that Endor's bitmap format compresses.

Wanda (Sun et al., "A Simple and Effective Pruning Approach for Large Language Models", ICLR 2024)
scores every weight of a linear layer by its magnitude times the norm of the input channel it reads,

    S_ij = |W_ij| * ||X_j||_2,

where `X_j` collects input channel `j` over every calibration token, and removes (zeroes) the
lowest-scoring weights of each output row: `round(cols * sparsity)` of them per row (unstructured),
or, for an N:M pattern such as 2:4, all but the N highest of every M consecutive weights of a row.
No weight is updated; biases are kept. The Endor paper prunes OPT-66B and Llama2-70B this way to 50%
sparsity and compares with 2:4 (sections 2.1, 4 and 5.3).

- `decoder_linears(model)`: every `nn.Linear` of the decoder layers (attention and MLP), by name;
  embeddings and the LM head are never pruned.
- `collect_input_norms(model, windows)` / `WandaStats`: forward pre-hooks on those linears keep a
  running sum of squares per input channel over one pass of the model; `||X_j|| = sqrt(sum)`.
- `wanda_mask(weight, input_norms, sparsity=..., n_m=...)`: the keep-mask of one weight.
- `prune_model(model, calibration_ids, ...)`: calibrate, then zero the pruned weights in place.
- `prune_checkpoint(model_path, out_dir, ...)`: load a Hugging Face checkpoint, prune it on a corpus's
  calibration split and save a complete pruned checkpoint with `pruning.json` beside `config.json`.

Calibration is one pass over the dense model with hooks on every linear at once. The original Wanda
prunes layer by layer instead, feeding each layer the outputs of the already pruned layers before it;
the one-pass variant scores every layer on the dense model's activations (what the hooks see).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._utils import model_device
from .._version import __version__
from ..arch import decoder_layers, layer_linears
from ..errors import ConfigError

DEFAULT_SPARSITY = 0.5
"""Fraction of every decoder weight that is pruned when neither a sparsity nor an N:M pattern is given."""
DEFAULT_CORPUS = "shakespeare"
DEFAULT_CONTEXT_LENGTH = 512
DEFAULT_WINDOWS = 64
"""Calibration windows (of `DEFAULT_CONTEXT_LENGTH` tokens): 32k tokens, ~20 s for SmolLM2 on 2 cores."""
PRUNING_FILE = "pruning.json"
"""Written by `prune_checkpoint` beside `config.json`: how the checkpoint was pruned."""
_SCORE_CHUNK = 1 << 22
"""Scores sorted at once by `wanda_mask` (elements), bounding its memory on large matrices."""


# --------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------


def _check_n_m(n_m: Any) -> tuple[int, int]:
    try:
        n, m = n_m
    except (TypeError, ValueError):
        n = m = None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n, m)) or not 1 <= n < m:
        raise ConfigError(
            f"n_m must be a pair of integers (N, M) with 1 <= N < M, such as (2, 4) for 2:4 sparsity "
            f"(keep N of every M consecutive weights of a row); got {n_m!r}."
        )
    return n, m


def resolve_pattern(
    sparsity: float | None = None, n_m: Sequence[int] | None = None
) -> tuple[float, tuple[int, int] | None]:
    """`(sparsity, n_m)` after checking them: the pruned fraction and the N:M pattern (None: unstructured).

    With neither given, `DEFAULT_SPARSITY` unstructured. With `n_m`, the sparsity is `1 - N/M`; a
    `sparsity` given alongside must equal it. Raises `ConfigError` saying what to change.
    """
    if n_m is not None:
        n, m = _check_n_m(n_m)
        implied = 1 - n / m
        if sparsity is not None and not (
            isinstance(sparsity, (int, float)) and math.isclose(sparsity, implied, abs_tol=1e-9)
        ):
            raise ConfigError(
                f"n_m={n}:{m} prunes {implied:g} of every row, but sparsity={sparsity!r} was also given: "
                f"give the N:M pattern alone, or sparsity={implied:g} with it."
            )
        return implied, (n, m)
    if sparsity is None:
        return DEFAULT_SPARSITY, None
    if (
        isinstance(sparsity, bool)
        or not isinstance(sparsity, (int, float))
        or not math.isfinite(sparsity)
        or not 0 <= sparsity < 1
    ):
        raise ConfigError(
            f"sparsity must be a number in [0, 1), the fraction of each row's weights to prune "
            f"(0.5 prunes half); got {sparsity!r}."
        )
    return float(sparsity), None


# --------------------------------------------------------------------------------------------------
# Which linears
# --------------------------------------------------------------------------------------------------


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every `nn.Linear` inside the decoder layers of `model` (attention and MLP), by qualified name.

    In module order. Embeddings and the LM head sit outside the decoder layers and are not included.
    A model patched by flashlm (streaming MLPs) raises `ConfigError`: prune the plain checkpoint.
    """
    from ..patching import streaming_mlps

    if streaming_mlps(model):
        raise ConfigError(
            f"{type(model).__name__} is patched by flashlm (its MLPs stream from a store): prune the "
            "plain checkpoint, loaded without a FlashConfig, then convert the pruned one."
        )
    linears = {
        f"{layer_name}.{name}": layer.get_submodule(name)
        for _, layer_name, layer in decoder_layers(model)
        for name in layer_linears(layer)
    }
    if not linears:
        raise ConfigError(f"No nn.Linear found inside the decoder layers of {type(model).__name__}.")
    return linears


# --------------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------------


class WandaStats:
    """Running per-input-channel sums of squares of what each linear reads, over calibration tokens.

    `attach()` registers one forward pre-hook per linear (a context manager that removes them on
    exit, also on error); every call of a linear adds `sum over tokens of x_j**2` (accumulated in
    float64) to channel `j` and counts its tokens. `norms()` gives `||X_j||_2 = sqrt(sum)`.
    """

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        self.linears = dict(linears)
        self.sum_squares: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {name: 0 for name in self.linears}

    def _hook(self, name: str, in_features: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["input"]
            x = x.detach().reshape(-1, in_features)
            squares = x.float().square().sum(dim=0)
            accumulator = self.sum_squares.get(name)
            if accumulator is None:
                dtype = torch.float32 if x.device.type == "mps" else torch.float64  # MPS has no float64
                accumulator = self.sum_squares[name] = torch.zeros(in_features, dtype=dtype, device=x.device)
            accumulator += squares.to(accumulator.dtype)
            self.tokens[name] += x.shape[0]

        return hook

    @contextlib.contextmanager
    def attach(self) -> Iterator[WandaStats]:
        """Hooks on every linear while the block runs; removed on exit, whatever happens."""
        handles = []
        try:
            for name, linear in self.linears.items():
                handles.append(
                    linear.register_forward_pre_hook(self._hook(name, linear.in_features), with_kwargs=True)
                )
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def norms(self) -> dict[str, torch.Tensor]:
        """`||X_j||_2` per input channel (float32, on the linear's input device), by linear name.

        Raises `ConfigError` for a linear that saw no token (the forward never reached it).
        """
        missing = [name for name in self.linears if self.tokens[name] == 0]
        if missing:
            raise ConfigError(
                f"{len(missing)} decoder linears saw no calibration token (first: {missing[0]}); "
                "the model's forward did not reach them, so Wanda cannot score their weights."
            )
        return {name: self.sum_squares[name].sqrt().float() for name in self.linears}


def _token_stream(ids: Any) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise ConfigError(f"calibration_ids must be a torch.Tensor of token ids, got {type(ids).__name__}.")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ConfigError(
            f"calibration_ids must be a 1-D stream of integer token ids (or [1, n]), got a "
            f"{ids.dtype} tensor of shape {tuple(ids.shape)}."
        )
    return ids.long()


def calibration_windows(
    calibration_ids: torch.Tensor, *, context_length: int = DEFAULT_CONTEXT_LENGTH, num_windows: int
) -> torch.Tensor:
    """`[num_windows, context_length]` windows of a 1-D token stream, spread evenly over all of it.

    The stream is cut into whole non-overlapping windows and `num_windows` of them are taken at evenly
    spaced positions (all of them when exactly that many fit), so calibration sees the whole split,
    not only its start. Raises `ConfigError` when fewer windows fit.
    """
    ids = _token_stream(calibration_ids)
    for label, value, least in (("context_length", context_length, 2), ("num_windows", num_windows, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{label} must be an int >= {least}, got {value!r}.")
    available = ids.numel() // context_length
    if available < num_windows:
        raise ConfigError(
            f"The calibration tokens hold {available} windows of {context_length} tokens "
            f"({ids.numel()} tokens), fewer than the {num_windows} asked for: ask for at most "
            f"{available} windows, use a shorter context length, or calibrate on a larger corpus."
        )
    from ..training.data import evenly_spaced_rows

    return evenly_spaced_rows(ids[: available * context_length].view(available, context_length), num_windows)


def collect_input_norms(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    linears: dict[str, nn.Linear] | None = None,
    progress: bool = True,
) -> WandaStats:
    """Run `model` over `windows` (`[n, context_length]` token ids) with `WandaStats` hooks attached.

    One forward per window under `torch.no_grad()`, in eval mode (restored after); `linears`
    defaults to `decoder_linears(model)`. The hooks are removed before this returns or raises.
    """
    from tqdm.auto import tqdm

    if not isinstance(windows, torch.Tensor) or windows.dim() != 2:
        raise ConfigError("windows must be a [num_windows, context_length] tensor of token ids.")
    linears = decoder_linears(model) if linears is None else linears
    vocab = model.get_input_embeddings().num_embeddings
    if windows.numel() and (int(windows.min()) < 0 or int(windows.max()) >= vocab):
        raise ConfigError(
            f"Calibration token ids range over [{int(windows.min())}, {int(windows.max())}], outside the "
            f"model's vocabulary of {vocab}: tokenize the corpus with the model's own tokenizer."
        )
    stats = WandaStats(linears)
    device = model_device(model)
    # Only the hidden states matter: skip the LM head for all but the last position where possible.
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), stats.attach():
            for window in tqdm(windows, desc="wanda: calibrating", unit="window", disable=not progress):
                model(input_ids=window.unsqueeze(0).to(device), use_cache=False, **extra)
    finally:
        model.train(was_training)
    return stats


# --------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------


def wanda_scores(weight: torch.Tensor, input_norms: torch.Tensor) -> torch.Tensor:
    """`|W_ij| * ||X_j||` in float32, the Wanda score of every weight of a `[out, in]` matrix."""
    return weight.detach().abs().float() * input_norms.to(device=weight.device, dtype=torch.float32)


def wanda_mask(
    weight: torch.Tensor,
    input_norms: torch.Tensor,
    sparsity: float | None = None,
    n_m: Sequence[int] | None = None,
) -> torch.Tensor:
    """Keep-mask (bool, True = keep) of a `[out, in]` weight under Wanda's score `|W_ij| * ||X_j||`.

    Unstructured (`sparsity`): each output row drops exactly `round(in * sparsity)` of its
    lowest-scoring weights. N:M (`n_m=(N, M)`): in each group of M consecutive weights of a row, the
    N highest-scoring are kept. Among equal scores the lower column index is kept (stable sort), so
    the mask is deterministic. With neither argument, `DEFAULT_SPARSITY` unstructured. Raises
    `ConfigError` for a bad sparsity or pattern, a width not divisible by M, or mismatched norms.
    """
    sparsity, pattern = resolve_pattern(sparsity, n_m)
    if weight.dim() != 2:
        raise ConfigError(f"wanda_mask needs a 2-D [out, in] weight, got shape {tuple(weight.shape)}.")
    rows, cols = weight.shape
    if input_norms.shape != (cols,):
        raise ConfigError(
            f"input_norms must hold one norm per input channel: shape ({cols},) for a weight of shape "
            f"{tuple(weight.shape)}, got {tuple(input_norms.shape)}."
        )
    if pattern is not None and cols % pattern[1]:
        raise ConfigError(
            f"A {pattern[0]}:{pattern[1]} pattern needs rows whose width is a multiple of {pattern[1]}; "
            f"this weight has {cols} columns. Use unstructured sparsity for it, or another M."
        )
    mask = torch.zeros(rows, cols, dtype=torch.bool, device=weight.device)
    keep = cols - round(cols * sparsity) if pattern is None else pattern[0]
    step = max(1, _SCORE_CHUNK // max(cols, 1))
    for start in range(0, rows, step):
        scores = wanda_scores(weight[start : start + step], input_norms)
        if pattern is not None:
            scores = scores.view(scores.shape[0], cols // pattern[1], pattern[1])
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :keep]
        chunk = torch.zeros(scores.shape, dtype=torch.bool, device=weight.device)
        chunk.scatter_(-1, order, True)
        mask[start : start + step] = chunk.view(-1, cols)
    return mask


# --------------------------------------------------------------------------------------------------
# Pruning a model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearReport:
    """One pruned linear: its shape and how many of its weights are zero after pruning."""

    shape: tuple[int, int]
    zeros: int

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def sparsity(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0


@dataclass(frozen=True)
class PruneReport:
    """What `prune_model` did: the target, the calibration, and the achieved sparsity per linear.

    `linears` maps each pruned decoder linear's name to its `LinearReport`; `sparsity` is the target
    fraction (`1 - N/M` for an N:M pattern); `achieved_sparsity` the fraction of zero weights over all
    pruned linears together. `tokens` counts calibration tokens, `seconds` calibration plus pruning.
    """

    sparsity: float
    n_m: tuple[int, int] | None
    windows: int
    context_length: int
    tokens: int
    seconds: float
    linears: dict[str, LinearReport] = field(default_factory=dict)

    @property
    def zeros(self) -> int:
        return sum(report.zeros for report in self.linears.values())

    @property
    def numel(self) -> int:
        return sum(report.numel for report in self.linears.values())

    @property
    def achieved_sparsity(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "sparsity": self.sparsity,
            "n_m": list(self.n_m) if self.n_m is not None else None,
            "windows": self.windows,
            "context_length": self.context_length,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "achieved_sparsity": self.achieved_sparsity,
            "pruned_weights": self.zeros,
            "weights": self.numel,
            "linears": {
                name: {"shape": list(report.shape), "sparsity": report.sparsity}
                for name, report in self.linears.items()
            },
        }


def prune_model(
    model: nn.Module,
    calibration_ids: torch.Tensor,
    *,
    sparsity: float | None = None,
    n_m: Sequence[int] | None = None,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    num_windows: int = DEFAULT_WINDOWS,
    progress: bool = True,
) -> PruneReport:
    """Wanda-prune every linear of the decoder layers of `model` in place and report the sparsity.

    `calibration_ids` is a 1-D token stream (say a corpus's calibration split); `num_windows` windows of
    `context_length` tokens, spread evenly over it, go through the model once with hooks collecting
    each linear's input norms (`collect_input_norms`). Then each weight keeps `wanda_mask(weight, norms,
    sparsity, n_m)`: pruned weights are set to zero, in the weight's own dtype; biases, embeddings and
    the LM head are untouched. `sparsity` defaults to 0.5 unstructured; `n_m=(2, 4)` gives 2:4.

    This is one-pass calibration: every layer is scored on the dense model's activations. The original
    Wanda prunes layer by layer, each layer calibrated on the outputs of the already pruned ones.
    Arguments are checked (including every linear's width against M) before anything changes.
    """
    sparsity, pattern = resolve_pattern(sparsity, n_m)
    linears = decoder_linears(model)
    if pattern is not None:
        bad = [name for name, linear in linears.items() if linear.in_features % pattern[1]]
        if bad:
            raise ConfigError(
                f"{len(bad)} decoder linears have an input width not divisible by {pattern[1]} (first: "
                f"{bad[0]}, {linears[bad[0]].in_features} columns): a {pattern[0]}:{pattern[1]} pattern "
                "does not fit them. Use unstructured sparsity."
            )
    windows = calibration_windows(calibration_ids, context_length=context_length, num_windows=num_windows)
    started = time.perf_counter()
    norms = collect_input_norms(model, windows, linears=linears, progress=progress).norms()

    from tqdm.auto import tqdm

    reports = {}
    with torch.no_grad():
        for name, linear in tqdm(linears.items(), desc="wanda: pruning", unit="linear", disable=not progress):
            weight = linear.weight
            mask = wanda_mask(weight, norms[name], sparsity if pattern is None else None, pattern)
            weight.masked_fill_(~mask, 0)
            reports[name] = LinearReport(shape=tuple(weight.shape), zeros=int((weight == 0).sum()))
    return PruneReport(
        sparsity=sparsity,
        n_m=pattern,
        windows=windows.shape[0],
        context_length=context_length,
        tokens=windows.numel(),
        seconds=time.perf_counter() - started,
        linears=reports,
    )


# --------------------------------------------------------------------------------------------------
# Pruning a checkpoint
# --------------------------------------------------------------------------------------------------


def _prepare_out_dir(model_path: Path, out_dir: Path, overwrite: bool) -> None:
    if model_path.resolve().is_relative_to(out_dir.resolve()):
        raise ConfigError(
            f"The output directory {out_dir} is, or holds, the source checkpoint {model_path}: "
            "choose another one."
        )
    if out_dir.exists() and not overwrite:
        raise ConfigError(
            f"{out_dir} already exists: choose another output directory, or pass overwrite=True "
            "(--overwrite) to replace it."
        )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def prune_checkpoint(
    model_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    sparsity: float | None = None,
    n_m: Sequence[int] | None = None,
    corpus: str = DEFAULT_CORPUS,
    num_windows: int = DEFAULT_WINDOWS,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    overwrite: bool = False,
    progress: bool = True,
) -> PruneReport:
    """Wanda-prune the Hugging Face checkpoint at `model_path` and save the result as `out_dir`.

    Loads the model with `AutoModelForCausalLM` in the dtype it was saved in, and its tokenizer, which
    tokenizes the calibration split of `corpus` (`flashlm.data.corpora`); prunes with `prune_model`;
    saves a complete checkpoint (safetensors weights, config, generation config, tokenizer files) plus
    `pruning.json` (how it was pruned) into a temporary sibling directory, renamed to `out_dir` once
    complete. An existing `out_dir` raises `ConfigError` unless `overwrite`. Works offline.
    """

    from ..data.corpora import corpus_tokens, require

    model_path, out_dir = Path(model_path), Path(out_dir)
    sparsity, pattern = resolve_pattern(sparsity, n_m)
    if not (model_path / "config.json").is_file():
        raise ConfigError(f"{model_path} is not a Hugging Face checkpoint directory (no config.json).")
    _prepare_out_dir(model_path, out_dir, overwrite)
    require(corpus)  # a missing corpus fails before the model loads

    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"Cannot load a tokenizer from {model_path} ({exc}); it is needed to tokenize the "
            f"calibration corpus {corpus!r}. Save the model's tokenizer into the checkpoint directory."
        ) from exc
    ids = corpus_tokens(corpus, tokenizer, split="calibration")
    calibration_windows(ids, context_length=context_length, num_windows=num_windows)  # fail before loading
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
    report = prune_model(
        model,
        ids,
        sparsity=sparsity if pattern is None else None,
        n_m=pattern,
        context_length=context_length,
        num_windows=num_windows,
        progress=progress,
    )
    record = {
        "method": "wanda",
        "calibration": "one-pass",
        "sparsity": report.sparsity,
        "n_m": list(pattern) if pattern is not None else None,
        "corpus": corpus,
        "split": "calibration",
        "windows": report.windows,
        "context_length": report.context_length,
        "tokens": report.tokens,
        "achieved_sparsity": report.achieved_sparsity,
        "pruned_weights": report.zeros,
        "weights": report.numel,
        "linears": len(report.linears),
        "flashlm_version": __version__,
        "source": str(model_path.resolve()),
    }

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Created with mkdir, not mkdtemp, so that the finished checkpoint gets the umask's permissions.
    tmp = out_dir.parent / f".{out_dir.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / PRUNING_FILE).write_text(json.dumps(record, indent=2) + "\n")
        _prepare_out_dir(model_path, out_dir, overwrite)  # it may have appeared meanwhile
        if out_dir.exists() or out_dir.is_symlink():
            _remove(out_dir)
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return report


def read_pruning_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The `pruning.json` record of a checkpoint written by `prune_checkpoint`, or None without one."""
    file = Path(path) / PRUNING_FILE
    return json.loads(file.read_text()) if file.is_file() else None
