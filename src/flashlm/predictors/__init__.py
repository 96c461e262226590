"""flashlm.predictors: low-rank activation predictors, their training data, and activation profiles.

- `labels`: run a dense model with hooks and collect each MLP's inputs and which neurons fired
  (`collect_activations`, `LabelRule`);
- `model`: the per-layer `LowRankPredictor` and the `Predictors` collection saved beside a store;
- `train`: balanced-BCE training with PowerInfer's per-layer rank growth (`train_predictors`), and
  their recall and precision on other text (`evaluate_predictors`);
- `profile`: per-neuron activation frequencies, the input of hot/cold placement
  (`flashlm.cache.placement`).
"""

from .labels import LabelRule, LayerSamples, collect_activations, default_label_rule
from .model import PREDICTORS_FILE, LayerReport, LowRankPredictor, Predictors
from .profile import activation_frequency, profile_activations
from .train import (
    PredictorQuality,
    TrainOptions,
    evaluate_predictors,
    format_reports,
    train_layer,
    train_predictors,
)

__all__ = [
    "PREDICTORS_FILE",
    "LabelRule",
    "LayerReport",
    "LayerSamples",
    "LowRankPredictor",
    "PredictorQuality",
    "Predictors",
    "TrainOptions",
    "activation_frequency",
    "collect_activations",
    "default_label_rule",
    "evaluate_predictors",
    "format_reports",
    "profile_activations",
    "train_layer",
    "train_predictors",
]
