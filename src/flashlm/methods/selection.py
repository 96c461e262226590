"""Which units each token keeps, method by method: the selection rules, apart from where the weights lie.

The streaming modules (`sparse.py`, `predictor.py`) read and compute the units these rules name; the
training-time modules of `flashlm.training.lora` apply the same rules to weights in memory, so LoRA
adapters learn under the very masks the fused store is streamed with. Each rule is a mixin over the
attributes a module sets (`k_in`, `k_out`, `gamma`, thresholds, a predictor); `selection_options`
derives them from a `FlashConfig`, the store's shape and its calibration.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .calibration import Calibration, CalibrationMissingError
from .masking import magnitude_topk, threshold_mask

if TYPE_CHECKING:
    from ..config import FlashConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopK:
    """A selection that keeps each token's `k` units of largest `|v|`, weighted by DIP-CA's eq. 10 with
    `gamma < 1` where a residency is given (`magnitude_topk`)."""

    k: int
    gamma: float = 1.0

    def mask(self, values: torch.Tensor, resident: torch.Tensor | None) -> torch.Tensor:
        return magnitude_topk(values, self.k, resident, self.gamma)


class Selection:
    """Two-stage selection (the DIP paper's methods): stage 1 keeps every unit, stage 2 the `k_out`
    largest `|a|` of the stage-1 activation `a`. `resident` is a stage's cache residency, for
    cache-aware selection (None where there is no cache: every unit counts as uncached alike).

    Where a stage's rule is a magnitude top-k, `input_topk` / `output_topk` give it (the streaming
    module then runs it fused with its cache lookup: `flashlm.ops.select.TopUnits`); None otherwise.
    """

    k_out: int
    gamma: float = 1.0

    def input_topk(self) -> TopK | None:
        return None

    def output_topk(self) -> TopK | None:
        return TopK(self.k_out)

    def select_input(self, x: torch.Tensor, resident: torch.Tensor | None) -> torch.Tensor | None:
        """`[T, units]` mask of the stage-1 units each of the tokens `x` needs, or None for all of them."""
        topk = self.input_topk()
        return None if topk is None else topk.mask(x, resident)

    def select_output(self, a: torch.Tensor, resident: torch.Tensor | None) -> torch.Tensor:
        """`[T, d_ff]` mask of the stage-2 units each token keeps, from its stage-1 activation `a`."""
        return self.output_topk().mask(a, resident)


class DIPSelection(Selection):
    """DIP (eqs. 7-8): the `k_in` largest `|x|` (or those above `input_threshold`), then the `k_out`
    largest entries of the pruned GLU; with `gamma < 1` both ranked by eq. 10 (DIP-CA)."""

    k_in: int
    input_threshold: float | None = None

    def input_topk(self) -> TopK | None:
        return None if self.input_threshold is not None else TopK(self.k_in, self.gamma)

    def output_topk(self) -> TopK | None:
        return TopK(self.k_out, self.gamma)

    def select_input(self, x: torch.Tensor, resident: torch.Tensor | None) -> torch.Tensor | None:
        if self.input_threshold is not None:
            return threshold_mask(x, self.input_threshold)
        return super().select_input(x, resident)


class GLUSelection(DIPSelection):
    """GLU pruning, the oracle (eq. 4): every input, then the top-k of the full GLU."""

    def input_topk(self) -> None:
        return None  # and so `select_input` keeps every input

    def output_topk(self) -> TopK:
        return TopK(self.k_out)


class CATSSelection(Selection):
    """CATS: the units whose `|act(gate x)|` exceeds the layer's calibrated `threshold`."""

    threshold: float

    def output_topk(self) -> None:
        return None

    def select_output(self, a: torch.Tensor, resident: torch.Tensor | None) -> torch.Tensor:
        return threshold_mask(a, self.threshold)


PREDICTOR_METHODS = ("predictor", "predictor-gate")
"""The methods that select by `PredictorSelection` (they read its units in different orders)."""


class PredictorSelection:
    """Predictor-based loading: the neurons the layer's low-rank `predictor` names, at most `k_max`."""

    predictor: nn.Module
    k_max: int
    d_ff: int

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, d_ff]` mask of the neurons each token is predicted to activate, at most `k_max` of them."""
        logits = self.predictor(x)
        mask = logits >= self.predictor.threshold_logit
        # The cap binds only where a token has more than k_max predicted (else its k_max largest logits
        # hold every one above the threshold): one count instead of a top-k over every neuron.
        if self.k_max < self.d_ff and int(mask.sum(dim=1).max()) > self.k_max:
            cut = logits.topk(self.k_max, dim=1).values[:, -1:]
            mask &= logits >= cut
        return mask


def selection_options(
    config: FlashConfig,
    layer: int,
    d_model: int,
    d_ff: int,
    calibration: Calibration | None,
    store_path: Any = "",
) -> dict[str, Any]:
    """The attributes of `config.method`'s selection for one layer (keyword arguments of its module),
    its unit counts derived from `config.density`.

    Raises `CalibrationMissingError` when the method needs thresholds that were never calibrated.
    """
    density, method = config.density, config.method
    if method in PREDICTOR_METHODS:
        return {"k_max": max(1, round(density * d_ff))}
    if method == "dip":
        rho_in, rho_out = dip_split(config, calibration, store_path)
        threshold = None
        if config.threshold != "token":
            calibration = _require(calibration, f"threshold={config.threshold!r}")
            threshold = (
                calibration.input_threshold(layer, rho_in)
                if config.threshold == "layer"
                else calibration.global_input_threshold(rho_in)
            )
        return {
            "k_in": clamp_units(rho_in, d_model),
            "k_out": clamp_units(rho_out, d_ff),
            "gamma": config.cache_aware,
            "input_threshold": threshold,
        }
    if method == "glu":
        return {"k_out": clamp_units(density, d_ff)}
    # gate, up and cats compute one full projection (a third) and keep ρ of the other two thirds.
    rho = (3 * density - 1) / 2
    options: dict[str, Any] = {"k_out": clamp_units(rho, d_ff)}
    if method == "cats":
        options["threshold"] = _require(calibration, "method='cats'").gate_threshold(layer, rho)
    return options


def clamp_units(fraction: float, units: int) -> int:
    """`fraction` of `units`, rounded, at least 1."""
    return min(units, max(1, round(fraction * units)))


def dip_split(
    config: FlashConfig, calibration: Calibration | None, store_path: object = ""
) -> tuple[float, float]:
    """(ρ_in, ρ_down) for DIP: explicit, calibrated (the Pareto fit), or equal without a calibration."""
    density = config.density
    if config.input_density is not None:
        return config.input_density, min(1.0, 3 * density - 2 * config.input_density)
    if calibration is not None and calibration.split_fit is not None:
        return calibration.split(density)
    if density < 1:
        _warn_uncalibrated(str(store_path), density)
    return density, density


@functools.lru_cache(maxsize=64)
def _warn_uncalibrated(store: str, density: float) -> None:
    """Once per store and density, not once per layer."""
    logger.warning(
        "flashlm: no calibrated DIP density split for the store %s; using ρ_in = ρ_down = %.3f. Run "
        "`flashlm calibrate` once to fit the Pareto-optimal split (DIP paper, appendix B.1).",
        store,
        density,
    )


def _require(calibration: Calibration | None, what: str) -> Calibration:
    if calibration is None:
        raise CalibrationMissingError(
            f"{what} needs magnitude thresholds calibrated on text, and this store has none. Run "
            "`flashlm calibrate` (or `flashlm.calibrate(model_path)`) once; it writes calibration.json "
            "into the store."
        )
    return calibration
