"""Training low-rank activation predictors, layer by layer, with PowerInfer's adaptive rank.

Per layer (LLM in a flash §3.1 / appendix B, PowerInfer §5.1):

1. The collected rows are split, with a fixed seed, into training rows and held-out rows.
2. A predictor of rank r is trained with AdamW on a *balanced* binary cross-entropy: each neuron's
   positives weigh `negatives / positives` (its label frequency), so a neuron active 5% of the time
   is not learnt as "never active" — misses are what cost accuracy, false alarms only cost reads.
3. Rank growth: ranks are tried from a list, smallest first, each trained from scratch; the first
   whose held-out recall at probability 0.5 reaches the target is kept (else the largest tried).
   The criterion needs a fixed operating point: at a threshold chosen for the recall, every rank
   would reach it, only with more neurons loaded. With the balanced loss, 0.5 weighs misses and
   false alarms equally, so the recall there measures how separable the layer is at that rank —
   PowerInfer's "accuracy", which grows the predictor where activations are dense or not skewed.
   With `read_share` the growth also stops where it stops paying: each rank's cost is the
   parameters a token touches, its predicted neurons' share of the MLP that the loading method
   reads for them (at the target recall) plus the predictor itself, which memory holds instead of
   cached neurons; a rank that costs no less than the one before ends the growth, and the one
   before is kept. (On relufied Qwen2.5-1.5B the recall at 0.5 grows ~0.03 per doubling and never
   reaches 0.95 by rank 512, where the predictors take 13% of the MLP.)
4. The kept predictor is cast to the dtype it will run in (`TrainOptions.dtype`: the store's, so that
   it costs what the weights cost per parameter). Its threshold is set on the held-out rows, on
   logits computed in that dtype, to the highest logit that still catches the target share of the
   truly active (token, neuron) pairs, and the report gives its recall, precision, predicted
   density and size against the MLP, all measured as it will run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .labels import LabelRule, LayerSamples
from .model import LayerReport, LowRankPredictor, Predictors

_EVAL_ROWS = 4096
"""Rows per forward when evaluating, to bound memory on large held-out sets."""


@dataclass(frozen=True)
class TrainOptions:
    """How `train_layer` / `train_predictors` train.

    `ranks` are tried in increasing order up to `max_rank` (None: min(d_model, d_ff), past which a
    low-rank factorization stops saving anything); `target_recall` is both the rank-growth criterion
    and the recall the threshold is set for; `holdout` the share of rows held out for both.
    `max_pos_weight` bounds the balancing weight of very rarely active neurons. `dtype` is the dtype
    the kept predictor is held and run in (None: float32, in which it is trained whatever `dtype`).
    `read_share` is the share of a predicted neuron's MLP parameters the loading method reads for it
    (1 for `predictor`'s bundles, 1/3 for `predictor-gate`'s gate rows), for the cost that stops rank
    growth; None: growth by recall alone.
    """

    ranks: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    max_rank: int | None = None
    target_recall: float = 0.95
    epochs: int = 4
    batch_size: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.01
    holdout: float = 0.1
    max_pos_weight: float = 1000.0
    seed: int = 0
    device: str | None = None
    dtype: torch.dtype | None = None
    read_share: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.target_recall <= 1:
            raise ValueError(f"target_recall must be in (0, 1], got {self.target_recall}.")
        if not 0 < self.holdout < 1:
            raise ValueError(f"holdout must be in (0, 1), got {self.holdout}.")
        if not self.ranks or any(r <= 0 for r in self.ranks):
            raise ValueError(f"ranks must be positive integers, got {self.ranks}.")
        if self.epochs <= 0 or self.batch_size <= 0:
            raise ValueError("epochs and batch_size must be positive.")
        if self.read_share is not None and not 0 < self.read_share <= 1:
            raise ValueError(f"read_share must be in (0, 1] or None, got {self.read_share}.")

    def ranks_for(self, d_model: int, d_ff: int) -> list[int]:
        """The ranks to try for a layer of these dimensions, increasing."""
        cap = min(d_model, d_ff) if self.max_rank is None else self.max_rank
        ranks = sorted({r for r in self.ranks if r <= cap})
        return ranks or [cap]


def _logits(predictor: LowRankPredictor, inputs: torch.Tensor) -> torch.Tensor:
    """float32 logits of `predictor` (computed in its own dtype) for `inputs`."""
    with torch.no_grad():
        return torch.cat(
            [predictor(inputs[i : i + _EVAL_ROWS]).float() for i in range(0, len(inputs), _EVAL_ROWS)]
        )


def _fit(
    rank: int,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    pos_weight: torch.Tensor,
    options: TrainOptions,
) -> LowRankPredictor:
    """Train one predictor of `rank` from scratch, deterministically for a given seed."""
    device = inputs.device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        predictor = LowRankPredictor(inputs.shape[1], labels.shape[1], rank).to(device)
    optimizer = torch.optim.AdamW(predictor.parameters(), lr=options.lr, weight_decay=options.weight_decay)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    generator = torch.Generator().manual_seed(options.seed)
    predictor.train()
    for _ in range(options.epochs):
        order = torch.randperm(len(inputs), generator=generator).to(device)
        for start in range(0, len(inputs), options.batch_size):
            rows = order[start : start + options.batch_size]
            loss = loss_fn(predictor(inputs[rows].float()), labels[rows].float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return predictor.eval()


@dataclass(frozen=True)
class PredictorQuality:
    """How one layer's predictor does at its threshold on some rows: `recall` / `precision` over every
    (token, neuron) pair, `density` the share of neurons predicted active (what gets loaded),
    `label_density` the share truly active."""

    layer: int
    recall: float
    precision: float
    density: float
    label_density: float


def _quality(layer: int, logits: torch.Tensor, labels: torch.Tensor, cut: float) -> PredictorQuality:
    """Quality at logit `cut`; recall 1 where nothing is active, precision 1 where nothing is named."""
    predicted = logits >= cut
    named, active, caught = int(predicted.sum()), int(labels.sum()), int((predicted & labels).sum())
    return PredictorQuality(
        layer=layer,
        recall=caught / active if active else 1.0,
        precision=caught / named if named else 1.0,
        density=named / predicted.numel(),
        label_density=active / labels.numel(),
    )


def evaluate_predictors(predictors: Predictors, samples: Sequence[LayerSamples]) -> list[PredictorQuality]:
    """Each layer's predictor at its threshold on `samples` (`collect_activations` on other text than
    it was trained on, say a corpus's test split): training reports recall on held-out rows of the
    training corpora, which overstates it on text of another kind."""
    qualities = []
    for s in samples:
        predictor = predictors[s.layer]
        logits = _logits(predictor, s.inputs)
        qualities.append(_quality(s.layer, logits, s.labels, predictor.threshold_logit))
    return qualities


def _threshold_for_recall(logits: torch.Tensor, labels: torch.Tensor, target: float) -> float:
    """The highest logit cut at which a share >= `target` of the positives is predicted active."""
    positive_logits = logits[labels]
    if positive_logits.numel() == 0:
        # Nothing to catch: predict nothing seen in the held-out rows.
        return math.nextafter(float(logits.max()), math.inf) if logits.numel() else 0.0
    k = max(1, math.ceil(target * positive_logits.numel() - 1e-9))
    return float(positive_logits.topk(k).values[-1])


def train_layer(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    options: TrainOptions | None = None,
    *,
    layer: int = 0,
    mlp_params: int | None = None,
) -> tuple[LowRankPredictor, LayerReport]:
    """Train one layer's predictor on `inputs` [n, d_model] and bool `labels` [n, d_ff].

    Returns the kept predictor (on CPU, threshold set) and its report; see the module docstring.
    `mlp_params` (the MLP's parameter count) gives the report's `size_percent` and, with
    `options.read_share`, the cost that stops rank growth.
    """
    options = options or TrainOptions()
    if inputs.dim() != 2 or labels.dim() != 2 or len(inputs) != len(labels):
        raise ValueError("train_layer needs inputs [n, d_model] and labels [n, d_ff] with the same n.")
    if len(inputs) < 2:
        raise ValueError(f"Training a predictor needs at least 2 rows, got {len(inputs)}.")
    device = torch.device(options.device or "cpu")
    labels = labels.bool()
    generator = torch.Generator().manual_seed(options.seed)
    order = torch.randperm(len(inputs), generator=generator)
    n_held = min(len(inputs) - 1, max(1, round(options.holdout * len(inputs))))
    held, train = order[:n_held], order[n_held:]
    train_x, train_y = inputs[train].to(device), labels[train].to(device)
    held_x, held_y = inputs[held].to(device), labels[held].to(device)

    positives = train_y.sum(0, dtype=torch.float32)
    negatives = len(train_y) - positives
    pos_weight = torch.where(positives > 0, negatives / positives.clamp(min=1), torch.ones_like(positives))
    pos_weight = pos_weight.clamp(min=1e-3, max=options.max_pos_weight)

    d_model, d_ff = inputs.shape[1], labels.shape[1]
    tried: dict[int, float] = {}
    touched: dict[int, float] = {}
    kept: tuple[LowRankPredictor, torch.Tensor] | None = None
    for rank in options.ranks_for(d_model, d_ff):
        predictor = _fit(rank, train_x, train_y, pos_weight, options)
        held_logits = _logits(predictor, held_x)
        tried[rank] = _quality(layer, held_logits, held_y, 0.0).recall
        if options.read_share is not None and mlp_params:
            cut = _threshold_for_recall(held_logits, held_y, options.target_recall)
            loaded = float((held_logits >= cut).float().mean())
            touched[rank] = loaded * options.read_share * mlp_params + predictor.num_parameters()
            if kept is not None and touched[rank] >= touched[kept[0].rank]:
                break  # growing stopped paying: keep the rank before
        kept = (predictor, held_logits)
        if tried[rank] >= options.target_recall:
            break
    assert kept is not None
    predictor, held_logits = kept
    if options.dtype not in (None, torch.float32):
        predictor = predictor.to(options.dtype)
        held_logits = _logits(predictor, held_x)

    cut = _threshold_for_recall(held_logits, held_y, options.target_recall)
    predictor.threshold_logit = cut
    quality = _quality(layer, held_logits, held_y, cut)
    report = LayerReport(
        layer=layer,
        rank=predictor.rank,
        threshold=predictor.threshold,
        recall=quality.recall,
        precision=quality.precision,
        density=quality.density,
        label_density=quality.label_density,
        size_percent=None if not mlp_params else 100 * predictor.num_parameters() / mlp_params,
        ranks_tried=tried,
        touched_tried={r: 100 * t / mlp_params for r, t in touched.items()} if mlp_params else {},
    )
    return predictor.cpu(), report


def train_predictors(
    samples: Sequence[LayerSamples],
    options: TrainOptions | None = None,
    *,
    label_rule: LabelRule | None = None,
    progress: bool = True,
) -> Predictors:
    """Train every layer of `collect_activations`' output; the reports are in `.reports`.

    `samples` must cover layers 0..n-1 in order (a `Predictors` is indexed by layer). `label_rule`,
    recorded with the predictors, defaults to the rule `samples` were collected with.
    """
    from tqdm.auto import tqdm

    if [s.layer for s in samples] != list(range(len(samples))):
        raise ValueError("train_predictors needs the samples of layers 0..n-1, in order.")
    if label_rule is None and samples:
        label_rule = samples[0].rule
    layers, reports = [], []
    for s in tqdm(samples, desc="Training predictors", unit="layer", disable=not progress):
        predictor, report = train_layer(s.inputs, s.labels, options, layer=s.layer, mlp_params=s.mlp_params)
        layers.append(predictor)
        reports.append(report)
    return Predictors(layers, label_rule=label_rule, reports=reports)


def format_reports(reports: Sequence[LayerReport]) -> str:
    """A plain-text table of per-layer reports, one line per layer."""
    lines = ["layer  rank  threshold  recall  precision  density  label_density  size%"]
    for r in reports:
        size = "-" if r.size_percent is None else f"{r.size_percent:.2f}"
        lines.append(
            f"{r.layer:5d}  {r.rank:4d}  {r.threshold:9.4f}  {r.recall:6.3f}  {r.precision:9.3f}  "
            f"{r.density:7.3f}  {r.label_density:13.3f}  {size:>5}"
        )
    return "\n".join(lines)
