"""Calibration of the sparse methods on text, once per model, saved beside the store.

Two things are calibrated (DIP paper, appendix B.1 and section 3.1):

- **DIP's density split.** A target MLP density D can be spent on up/gate input columns (ρ_in,
  two thirds of the weights) or on down columns (ρ_down, one third): D = (2 ρ_in + ρ_down) / 3.
  `calibrate` measures perplexity on a grid of (ρ_in, ρ_down), keeps the Pareto-optimal points
  (no other point is both sparser and better), and fits `logit(ρ_in) = a + b logit(D)` to them;
  `Calibration.split(D)` then gives the split for any target.
- **Magnitude distributions**, as quantiles per layer: |x| at the MLP input (DIP's per-layer and
  global thresholds, the paper's Fig. 4) and |act(gate x)| (CATS's per-layer threshold). A
  threshold that keeps a fraction ρ on average is the (1 - ρ) quantile.

The result is `calibration.json` in the store directory, keyed by the store's content hash, so
any model loaded on that store reuses it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .errors import FlashLMError

logger = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.json"
QUANTILE_LEVELS = 201
"""Quantiles are stored at levels 0, 0.005, ..., 1."""
SAMPLES_PER_LAYER = 1_000_000
"""Magnitudes kept per layer (a uniform random subset) to compute its quantiles."""
SPLIT_GRID = (0.25, 0.4, 0.55, 0.7, 0.85, 1.0)
"""ρ_in and ρ_down values whose combinations `calibrate` measures."""


class CalibrationMissingError(FlashLMError):
    """A method needs a calibration the store does not have yet."""


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


@dataclass
class Calibration:
    """What `calibrate` measured; see the module docstring."""

    content_sha256: str
    corpus: str
    tokens: int
    input_quantiles: list[list[float]]
    global_input_quantiles: list[float]
    gate_quantiles: list[list[float]]
    split_fit: dict[str, float] | None = None
    split_points: list[dict[str, float]] = field(default_factory=list)
    flashlm_version: str = ""

    # ---- use --------------------------------------------------------------------------------

    def split(self, density: float) -> tuple[float, float]:
        """(ρ_in, ρ_down) for a target MLP density, from the fitted Pareto front."""
        if self.split_fit is None:
            raise CalibrationMissingError("This calibration has no fitted density split.")
        return split_from_fit(self.split_fit, density)

    def input_threshold(self, layer: int, keep: float) -> float:
        """|x| above which a fraction `keep` of layer `layer`'s MLP inputs lie."""
        return _threshold(self.input_quantiles[layer], keep)

    def global_input_threshold(self, keep: float) -> float:
        """|x| above which a fraction `keep` of all layers' MLP inputs lie."""
        return _threshold(self.global_input_quantiles, keep)

    def gate_threshold(self, layer: int, keep: float) -> float:
        """|act(gate x)| above which a fraction `keep` of layer `layer`'s gate activations lie."""
        return _threshold(self.gate_quantiles[layer], keep)

    # ---- persistence ------------------------------------------------------------------------

    @classmethod
    def load(cls, store_path: str | os.PathLike, content_sha256: str) -> Calibration | None:
        """The calibration saved in the store at `store_path`, or None (none, or for other weights)."""
        path = Path(store_path) / CALIBRATION_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            calibration = cls(**data)
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("flashlm: ignoring unreadable calibration %s (%s).", path, exc)
            return None
        if calibration.content_sha256 != content_sha256:
            logger.warning("flashlm: %s was calibrated for other weights; ignoring it.", path)
            return None
        if calibration.split_points:
            # The measured points are the calibration; the line is refitted so that a file written
            # by an older fit gets today's (or keeps its own if too few points can be fitted).
            with contextlib.suppress(ValueError):
                calibration.split_fit = fit_split(calibration.split_points)
        return calibration

    def save(self, store_path: str | os.PathLike) -> Path:
        """Write `calibration.json` into the store directory (temporary name, then rename)."""
        path = Path(store_path) / CALIBRATION_FILE
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)
        return path


def _threshold(quantiles: list[float], keep: float) -> float:
    from .patches.masking import threshold_for_density  # patches import this module

    return threshold_for_density(torch.tensor(quantiles), keep)


def split_from_fit(fit: dict[str, float], density: float) -> tuple[float, float]:
    """(ρ_in, ρ_down) on the fitted line, moved inside the feasible region if it falls outside."""
    if density >= 1:
        return 1.0, 1.0
    z = fit["intercept"] + fit["slope"] * _logit(density)
    rho_in = 1 / (1 + math.exp(-z))
    # ρ_down = 3D - 2ρ_in must lie in (0, 1]: ρ_in in [(3D - 1)/2, 3D/2).
    low, high = max((3 * density - 1) / 2, 0.0), min(1.5 * density * (1 - 1e-3), 1.0)
    rho_in = min(max(rho_in, low), high)
    return rho_in, 3 * density - 2 * rho_in


def pareto_front(points: Iterable[dict[str, float]]) -> list[dict[str, float]]:
    """Points no other point beats on both density and perplexity, by increasing density."""
    front: list[dict[str, float]] = []
    best = math.inf
    for point in sorted(points, key=lambda p: (p["density"], p["perplexity"])):
        if point["perplexity"] < best:
            front.append(point)
            best = point["perplexity"]
    return front


def fit_split(points: list[dict[str, float]]) -> dict[str, float]:
    """Least-squares `logit(ρ_in) = intercept + slope logit(D)` over the Pareto front of `points`.

    Front points with ρ_in = 1 are left out: their logit is infinite, and any finite stand-in for
    it (a clamp) outweighs the rest of the front and tilts the line. `split_from_fit` reaches
    ρ_in = 1 anyway where the line, moved into the feasible region, runs into it.
    """
    front = [p for p in pareto_front(points) if p["density"] < 1 and p["rho_in"] < 1]
    if len(front) < 2:
        raise ValueError(
            "Fitting the density split needs at least two Pareto-optimal points with density and "
            "ρ_in below 1."
        )
    # Plain floats, not torch: `load` runs this while transformers builds the model on the meta device.
    xs = [_logit(p["density"]) for p in front]
    ys = [_logit(p["rho_in"]) for p in front]
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - x_mean) ** 2 for x in xs)
    if spread == 0:
        raise ValueError("Fitting the density split needs Pareto-optimal points at two densities or more.")
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True)) / spread
    return {"intercept": y_mean - slope * x_mean, "slope": slope}


# ---- measuring ----------------------------------------------------------------------------------


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
    from .eval.perplexity import perplexity
    from .patches.sparse import DIPMLP
    from .patching import streaming_mlps

    modules = [m for m in streaming_mlps(model) if isinstance(m, DIPMLP)]
    if not modules or any(type(m) is not DIPMLP for m in modules):
        raise ValueError(
            "calibrate_model needs a model patched with DIP modules: FlashConfig(method='dip', "
            "**flashlm.calibration.CALIBRATION_OPTIONS)."
        )
    runtime = modules[0].runtime
    store = runtime.store
    windows = max(1, min(num_tokens, input_ids.numel()) // context_length)
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
        flashlm_version=_version(),
    )
    if split:
        calibration.split_points = _split_grid(model, modules, ids, context_length, progress)
        calibration.split_fit = fit_split(calibration.split_points)
    calibration.save(store.path)
    return calibration


def _split_grid(model, modules, ids, context_length, progress) -> list[dict[str, Any]]:
    from .eval.perplexity import perplexity

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


def _version() -> str:
    from . import __version__

    return __version__


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

    from .config import FlashConfig
    from .eval.corpora import corpus_tokens
    from .models import default_model_path

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
