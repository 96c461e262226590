"""flashlm.training: recipes that fine-tune a model for sparse streaming, launchable with Accelerate.

It builds on everything below it (`flashlm.arch` to find the MLPs, `flashlm.data.corpora` for text,
`flashlm.eval.perplexity` to measure); of the library, only the loaders of `checkpoints` are imported
(by `flashlm.eval` and the predictors workflow, so a relufied checkpoint loads wherever a plain one does).

- `checkpoints`: `load_relufied`, `load_checkpoint` (relufied or not), `buildable_config`.

- `trainer`: `Trainer` on `accelerate.Accelerator` — distillation loss (`distillation_loss`), AdamW,
  gradient accumulation, checkpoints that survive a kill and resume to the same loss curve, a JSON
  log per step. Runs unchanged in one process or under `accelerate launch`.
- `data`: corpus splits packed into fixed-length training sequences; a stateless sampler.
- `activations`: `dense_activations` (swap back, for an in-place teacher), `calibrate_thresholds`,
  `allocate_zeros` (per-layer zero fractions by sensitivity, a `ZeroAllocation`),
  exact-zero counting (`ZeroCounter`); and, re-exported from `flashlm.activations`, `FATReLU` and
  `relufy` (swap every MLP activation).
- `relufy`: the relufication recipe (`python -m flashlm.training.relufy`, `flashlm train relufy`) and
  `flashlm.training.checkpoints.load_relufied(path)` (or `load_checkpoint`, for any checkpoint) for
  its FATReLU checkpoints.

`relufy` is not imported here, so `python -m flashlm.training.relufy` runs it as `__main__` only once.
"""

from __future__ import annotations

from ..activations import FATReLU, relufy
from .activations import (
    ZeroAllocation,
    ZeroCounter,
    allocate_zeros,
    calibrate_thresholds,
    dense_activations,
    zero_fractions,
)
from .trainer import (
    ModelTeacher,
    ResumeMismatchError,
    TrainConfig,
    Trainer,
    TrainingError,
    TrainResult,
    distillation_loss,
)

__all__ = [
    "FATReLU",
    "ModelTeacher",
    "ResumeMismatchError",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainingError",
    "ZeroAllocation",
    "ZeroCounter",
    "allocate_zeros",
    "calibrate_thresholds",
    "dense_activations",
    "distillation_loss",
    "relufy",
    "zero_fractions",
]
