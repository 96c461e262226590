"""The calibration record of the sparse methods: what `flashlm calibrate` measured on text, saved
beside the store (`calibration.json`) and read by the methods when a model is built.

Two things are calibrated (DIP paper, appendix B.1 and section 3.1):

- **DIP's density split.** A target MLP density D can be spent on up/gate input columns (ρ_in,
  two thirds of the weights) or on down columns (ρ_down, one third): D = (2 ρ_in + ρ_down) / 3.
  The calibration measures perplexity on a grid of (ρ_in, ρ_down), keeps the Pareto-optimal points
  (no other point is both sparser and better), and fits `logit(ρ_in) = a + b logit(D)` to them;
  `Calibration.split(D)` then gives the split for any target.
- **Magnitude distributions**, as quantiles per layer: |x| at the MLP input (DIP's per-layer and
  global thresholds, the paper's Fig. 4) and |act(gate x)| (CATS's per-layer threshold). A
  threshold that keeps a fraction ρ on average is the (1 - ρ) quantile.

The file is keyed by the store's content hash, so any model loaded on that store reuses it. The
measuring lives in `flashlm.workflows.calibrate`.
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

import torch

from ..errors import FlashLMError
from .masking import threshold_for_density

logger = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.json"


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
    measured_on: str = ""
    """Content hash of the weights measured, where it is not `content_sha256`: a calibration carried into
    a store with LoRA adapters fused in (the adapters were trained under its masks)."""

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
