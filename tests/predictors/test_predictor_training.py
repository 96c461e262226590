"""Low-rank predictors: the module's decisions, and training that recovers a planted sparsity pattern."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from flashlm.predictors import (
    LowRankPredictor,
    TrainOptions,
    evaluate_predictors,
    train_layer,
    train_predictors,
)
from flashlm.predictors.labels import LabelRule, LayerSamples

D_MODEL, D_FF, PLANTED_RANK = 32, 64, 4


def planted(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x and labels "neuron j active iff (A B x + b)_j > 0" for a fixed rank-4 map A B."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(D_FF, PLANTED_RANK, generator=g)
    b = torch.randn(PLANTED_RANK, D_MODEL, generator=g)
    bias = torch.randn(D_FF, generator=g) * 2 - 5  # most neurons off most of the time
    x = torch.randn(rows, D_MODEL, generator=torch.Generator().manual_seed(seed))
    return x, (x @ b.T @ a.T + bias) > 0


def _samples(layer: int, x: torch.Tensor, labels: torch.Tensor) -> LayerSamples:
    return LayerSamples(
        layer=layer,
        inputs=x,
        labels=labels,
        rows_seen=len(x),
        active_counts=labels.sum(0),
        mlp_params=3 * D_MODEL * D_FF,
        rule=LabelRule.above(0.0),
    )


FAST = TrainOptions(ranks=(1, 8), target_recall=0.9, epochs=6, lr=2e-2, batch_size=128)


def test_predictor_shapes_and_decisions() -> None:
    torch.manual_seed(0)
    predictor = LowRankPredictor(D_MODEL, D_FF, 8)
    assert predictor.reduce.bias is None and predictor.expand.bias is not None
    assert (predictor.rank, predictor.d_model, predictor.d_ff) == (8, D_MODEL, D_FF)
    assert predictor.num_parameters() == D_MODEL * 8 + 8 * D_FF + D_FF
    x = torch.randn(3, 5, D_MODEL)
    with torch.no_grad():
        logits = predictor(x)
    assert logits.shape == (3, 5, D_FF)
    # a probability threshold p: active iff sigmoid(logit) >= p
    for p in (0.3, 0.5, 0.8):
        assert torch.equal(predictor.predict(x, p), torch.sigmoid(logits.double()) >= p)
    assert predictor.predict(x, 0.0).all() and not predictor.predict(x, 1.0).any()
    # the trained threshold is used when none is given, and kept exactly in logit space
    predictor.threshold_logit = float(logits.median())
    assert torch.equal(predictor.predict(x), logits >= logits.median())
    assert predictor.threshold == pytest.approx(torch.sigmoid(logits.median().double()).item())
    # active indices: one token's active neurons; for many tokens their union
    assert torch.equal(predictor.active_indices(x[0, 0]), predictor.predict(x[0, 0]).nonzero().flatten())
    union = predictor.predict(x).reshape(-1, D_FF).any(0).nonzero().flatten()
    assert torch.equal(predictor.active_indices(x), union)
    with pytest.raises(ValueError, match="probability"):
        predictor.predict(x, 1.5)
    with pytest.raises(ValueError, match="rank"):
        LowRankPredictor(D_MODEL, D_FF, 0)


def test_training_learns_a_planted_pattern_with_rank_growth() -> None:
    x, labels = planted(1500, seed=0)
    base_rate = labels.float().mean().item()
    assert 0.2 < base_rate < 0.4
    predictor, report = train_layer(x, labels, FAST, layer=3, mlp_params=3 * D_MODEL * D_FF)

    # Rank growth: rank 1 cannot express a rank-4 pattern; rank 8 can, and is kept.
    assert report.ranks_tried[1] < 0.9 <= report.ranks_tried[8]
    assert report.rank == predictor.rank == 8 and report.layer == 3
    # Held-out rows at the chosen threshold: the target recall, with few false alarms.
    assert report.recall >= 0.9
    assert report.precision >= 0.95 > 3 * base_rate
    assert report.density <= 1.05 * report.label_density
    assert report.threshold == pytest.approx(predictor.threshold)
    assert report.size_percent == pytest.approx(100 * (D_MODEL * 8 + 8 * D_FF + D_FF) / (3 * D_MODEL * D_FF))

    # It generalizes: fresh rows of the same distribution.
    fresh_x, fresh = planted(2000, seed=5)
    predicted = predictor.predict(fresh_x)
    hits = (predicted & fresh).sum().item()
    assert hits / fresh.sum().item() >= 0.85
    assert hits / predicted.sum().item() >= 0.95


def test_a_predictor_is_held_and_measured_in_its_dtype() -> None:
    """Trained in float32, kept in `dtype` (the store's): its threshold and report are measured with
    the logits it computes there, so the recall it reports is the recall it runs at."""
    x, labels = planted(1500, seed=0)
    options = TrainOptions(ranks=(8,), target_recall=0.9, epochs=6, lr=2e-2, batch_size=128)
    wide, _ = train_layer(x, labels, options)
    narrow, report = train_layer(x, labels, replace(options, dtype=torch.bfloat16))
    assert wide.reduce.weight.dtype == torch.float32
    assert {p.dtype for p in narrow.parameters()} == {torch.bfloat16}
    assert torch.equal(narrow.reduce.weight, wide.reduce.weight.bfloat16())  # the same training
    # The held-out rows, as train_layer splits them (seeded): the report is of the bfloat16 logits.
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(options.seed))
    held = order[: round(options.holdout * len(x))]
    predicted, truth = narrow.predict(x[held]), labels[held]
    assert report.recall == (predicted & truth).sum().item() / truth.sum().item() >= 0.9
    assert report.precision == (predicted & truth).sum().item() / predicted.sum().item()
    assert report.threshold == narrow.threshold
    cut = narrow.threshold_logit  # one of the bfloat16 logits, not a float32 one
    assert cut == torch.tensor(cut).bfloat16().item() != wide.threshold_logit


def test_rank_growth_stops_at_the_first_rank_that_reaches_the_target() -> None:
    x, labels = planted(1500, seed=0)
    options = TrainOptions(ranks=(8, 16, 32), target_recall=0.9, epochs=6, lr=2e-2, batch_size=128)
    _, report = train_layer(x, labels, options)
    assert report.rank == 8 and list(report.ranks_tried) == [8]
    # No rank reaches an unreachable target: the largest tried is kept.
    options = TrainOptions(ranks=(1, 2), target_recall=1.0, epochs=1, batch_size=256)
    _, report = train_layer(x, labels, options)
    assert report.rank == 2 and list(report.ranks_tried) == [1, 2]
    assert report.recall == 1.0  # the threshold still catches every held-out positive


def test_rank_growth_stops_where_a_larger_predictor_no_longer_pays() -> None:
    """With `read_share`, a rank whose predicted neurons (their read share of the MLP) plus its own
    parameters cost no less than the rank before ends the growth, and the rank before is kept, though
    recall at 0.5 never reaches the target. Without it, growth runs to the largest rank."""
    x, labels = planted(1500, seed=0)
    mlp_params = 3 * D_MODEL * D_FF
    ranks = TrainOptions(ranks=(1, 8, 16, 32), target_recall=1.0, epochs=6, lr=2e-2, batch_size=128)
    _, report = train_layer(x, labels, replace(ranks, read_share=1 / 3), mlp_params=mlp_params)
    assert report.rank == 8 and list(report.ranks_tried) == [1, 8, 16]
    touched = report.touched_tried
    assert touched[8] < touched[1] and touched[16] >= touched[8]
    # rank 8 separates the planted pattern: its cost is about the true neurons' gate rows plus itself
    predictor_share = 100 * (D_MODEL * 8 + 8 * D_FF + D_FF) / mlp_params
    assert touched[8] == pytest.approx(100 * labels.float().mean().item() / 3 + predictor_share, rel=0.15)
    _, by_recall = train_layer(x, labels, ranks, mlp_params=mlp_params)
    assert by_recall.rank == 32 and by_recall.touched_tried == {}
    with pytest.raises(ValueError, match="read_share"):
        TrainOptions(read_share=0.0)


def test_ranks_are_capped() -> None:
    options = TrainOptions(ranks=(16, 32, 64, 128))
    assert options.ranks_for(48, 96) == [16, 32]
    assert TrainOptions(ranks=(64, 128), max_rank=32).ranks_for(48, 96) == [32]
    assert TrainOptions(ranks=(8, 64), max_rank=64).ranks_for(48, 96) == [8, 64]


def test_training_is_deterministic() -> None:
    x, labels = planted(300, seed=0)
    options = TrainOptions(ranks=(4,), epochs=1, batch_size=64)
    first, report = train_layer(x, labels, options)
    torch.manual_seed(123)  # the global RNG does not matter: training seeds its own
    second, again = train_layer(x, labels, options)
    assert report == again
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "options",
    [
        dict(target_recall=0.0),
        dict(target_recall=1.5),
        dict(holdout=0.0),
        dict(ranks=()),
        dict(ranks=(0, 8)),
        dict(epochs=0),
    ],
)
def test_bad_options_are_refused(options: dict) -> None:
    with pytest.raises(ValueError):
        TrainOptions(**options)


def test_train_predictors_covers_every_layer_in_order() -> None:
    x, labels = planted(200, seed=0)
    options = TrainOptions(ranks=(2,), epochs=1)
    predictors = train_predictors([_samples(0, x, labels), _samples(1, x, labels)], options, progress=False)
    assert len(predictors) == 2 and predictors.ranks == [2, 2]
    assert predictors.label_rule == LabelRule.above(0.0)
    assert [r.layer for r in predictors.reports] == [0, 1]
    assert all(math.isfinite(t) for t in predictors.thresholds)
    with pytest.raises(ValueError, match=r"layers 0\.\.n-1"):
        train_predictors([_samples(1, x, labels)], options, progress=False)


def test_evaluate_predictors_measures_them_at_their_threshold_on_other_rows() -> None:
    x, labels = planted(1500, seed=0)
    predictors = train_predictors([_samples(0, x, labels)], FAST, progress=False)
    fresh_x, fresh = planted(2000, seed=5)
    (quality,) = evaluate_predictors(predictors, [_samples(0, fresh_x, fresh)])
    predicted = predictors[0].predict(fresh_x)
    assert quality.layer == 0
    assert quality.recall == (predicted & fresh).sum().item() / fresh.sum().item()
    assert quality.precision == (predicted & fresh).sum().item() / predicted.sum().item()
    assert quality.density == pytest.approx(predicted.float().mean().item())
    assert quality.label_density == pytest.approx(fresh.float().mean().item())
    assert 0.85 <= quality.recall < 1 and quality.precision >= 0.95  # as trained; not a perfect oracle
