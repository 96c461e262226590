"""Label collection from a dense model: hooks see the MLP input and the down projection's input."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model

from flashlm.predictors import (
    LabelRule,
    LayerSamples,
    activation_frequency,
    collect_activations,
    default_label_rule,
    profile_activations,
)
from flashlm.predictors.labels import pack_labels, packed_width, unpack_labels


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_label_rules() -> None:
    h = torch.tensor([[0.0, -0.5, 2.0, 0.1], [-3.0, 0.0, 0.0, 1.0]])
    assert LabelRule.above().labels(h).tolist() == [[False, True, True, True], [True, False, False, True]]
    assert LabelRule.above(0.3).labels(h).tolist() == [[False, True, True, False], [True, False, False, True]]
    # top fraction: ceil(0.5 * 4) = 2 largest |h| per row
    assert LabelRule.top(0.5).labels(h).tolist() == [[False, True, True, False], [True, False, False, True]]
    assert LabelRule.top(0.3).labels(h).sum(1).tolist() == [2, 2]  # ceil(1.2)
    assert LabelRule.from_dict(LabelRule.top(0.25).to_dict()) == LabelRule.top(0.25)
    for bad in (lambda: LabelRule.top(0.0), lambda: LabelRule.above(-1.0), lambda: LabelRule("x", 1.0)):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("d_ff", [1, 8, 13, 96])
def test_labels_are_held_as_bits_and_read_back_unchanged(d_ff: int) -> None:
    labels = torch.rand(7, d_ff, generator=torch.Generator().manual_seed(d_ff)) > 0.5
    packed = pack_labels(labels)
    assert packed.dtype == torch.uint8 and packed.shape == (7, packed_width(d_ff)) == (7, -(-d_ff // 8))
    assert torch.equal(unpack_labels(packed, d_ff), labels)
    assert pack_labels(
        torch.tensor([[True, False, True, True, False, False, False, False, True]])
    ).tolist() == [[0b1101, 0b1]]  # neuron j is bit j % 8 of byte j // 8


def test_collected_inputs_are_kept_in_the_dtype_asked_and_labels_as_bits() -> None:
    model = build_tiny_model("llama", torch.float32)
    full, lean = (
        collect_activations(
            model, [tokens(2, 12)], rule=LabelRule.top(0.25), input_dtype=dtype, progress=False
        )
        for dtype in (None, torch.bfloat16)
    )
    for f, s in zip(full, lean, strict=True):
        assert f.inputs.dtype == torch.float32 and torch.equal(s.inputs, f.inputs.bfloat16())
        assert torch.equal(s.labels, f.labels)  # labelled from the model's own activations
        assert s.packed_labels.shape == (24, 96 // 8)


def test_default_rule_follows_the_activation() -> None:
    assert default_label_rule(build_tiny_model("opt").config) == LabelRule.above(0.0)  # ReLU
    assert default_label_rule(build_tiny_model("llama").config, density=0.2) == LabelRule.top(0.2)  # SwiGLU


def test_llama_labels_match_the_mlp_recomputed_by_hand() -> None:
    # float64, so recomputing on other batch shapes cannot move a value across the top-k boundary
    model = build_tiny_model("llama", torch.float64)
    rule = LabelRule.top(0.25)
    ids = tokens(2, 12)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padding is left out
    samples = collect_activations(
        model, [{"input_ids": ids, "attention_mask": mask}, ids[0]], rule=rule, progress=False
    )
    assert [s.layer for s in samples] == [0, 1]
    expected_rows = 12 + 7 + 12
    for s, layer in zip(samples, model.model.layers, strict=True):
        mlp = layer.mlp
        assert s.inputs.shape == (expected_rows, 64) and s.labels.shape == (expected_rows, 96)
        assert s.inputs.dtype == torch.float64 and s.labels.dtype == torch.bool
        assert s.rows_seen == expected_rows and s.rule == rule
        assert s.mlp_params == 3 * 64 * 96
        with torch.no_grad():
            h = mlp.act_fn(mlp.gate_proj(s.inputs)) * mlp.up_proj(s.inputs)
        assert torch.equal(s.labels, rule.labels(h))
        assert (s.labels.sum(1) == 24).all()  # ceil(0.25 * 96)
        assert torch.equal(s.active_counts, s.labels.sum(0))
    # the stored inputs are what each MLP received, in token order (seen here by a hook on the MLP
    # module itself rather than on its projections)
    seen = []
    handles = [
        layer.mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids[1:, :7])
    finally:
        for handle in handles:
            handle.remove()
    for s, x in zip(samples, seen, strict=True):
        torch.testing.assert_close(s.inputs[12:19], x[0])  # another batch shape: equal up to rounding


def test_opt_relu_labels_are_exactly_the_nonzero_activations() -> None:
    model = build_tiny_model("opt", torch.float64)
    (first, *_) = samples = collect_activations(model, [tokens(2, 10)], progress=False)
    assert len(samples) == 2 and first.rule == LabelRule.above(0.0)
    layer = model.model.decoder.layers[0]
    with torch.no_grad():
        h = layer.activation_fn(layer.fc1(first.inputs))
    assert torch.equal(first.labels, h != 0)
    assert 0.2 < first.labels.float().mean() < 0.8  # a random ReLU MLP fires about half the time


def test_rows_are_subsampled_but_counts_are_exact() -> None:
    model = build_tiny_model("llama")
    rule = LabelRule.top(0.1)
    batches = [tokens(2, 16, seed) for seed in range(3)]
    full = collect_activations(model, batches, rule=rule, progress=False)
    sampled = collect_activations(model, batches, rule=rule, max_rows=20, layers=[1], progress=False)
    assert [s.layer for s in sampled] == [1]
    s = sampled[0]
    assert s.inputs.shape == (20, 64) and s.rows_seen == 96
    assert torch.equal(s.active_counts, full[1].active_counts)
    # every kept row is one of the full collection's rows, with its labels
    matches = (s.inputs[:, None, :] == full[1].inputs[None, :, :]).all(-1)
    assert (matches.sum(1) == 1).all()
    assert torch.equal(s.labels, full[1].labels[matches.float().argmax(1)])
    # the same seed keeps the same rows; another seed other rows
    again = collect_activations(model, batches, rule=rule, max_rows=20, layers=[1], progress=False)[0]
    other = collect_activations(model, batches, rule=rule, max_rows=20, layers=[1], seed=1, progress=False)[0]
    assert torch.equal(again.inputs, s.inputs) and not torch.equal(other.inputs, s.inputs)


def test_activation_frequency_is_the_offline_profile() -> None:
    model = build_tiny_model("opt")
    batches = [tokens(2, 8, seed) for seed in range(2)]
    samples = collect_activations(model, batches, max_rows=5, progress=False)
    frequencies = activation_frequency(samples)
    full = collect_activations(model, batches, progress=False)
    for f, s in zip(frequencies, full, strict=True):
        assert f.dtype == torch.float64 and f.shape == (80,)
        assert torch.allclose(f, s.labels.double().mean(0))  # over all 32 rows, not the 5 kept
    assert torch.allclose(activation_frequency([full[0].labels])[0], frequencies[0])
    profile = profile_activations(model, batches, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(profile, frequencies, strict=True))


def test_hooks_are_removed_even_on_error() -> None:
    model = build_tiny_model("llama")

    def hooks() -> int:
        return sum(len(m._forward_pre_hooks) for m in model.modules())

    before = hooks()
    with pytest.raises(ValueError, match="attention mask covers 5 tokens"):
        bad = {"input_ids": tokens(1, 6), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
        collect_activations(model, [bad], progress=False)
    assert hooks() == before
    collect_activations(model, [tokens(1, 4)], progress=False)
    assert hooks() == before
    with pytest.raises(ValueError, match="out of range"):
        collect_activations(model, [tokens(1, 4)], layers=[5], progress=False)


def empty_samples(d_model: int, d_ff: int) -> LayerSamples:
    """A layer's samples before any row, as `collect_activations` starts them."""
    return LayerSamples(
        layer=0,
        inputs=torch.empty(0, d_model),
        labels=torch.empty(0, d_ff, dtype=torch.bool),
        rows_seen=0,
        active_counts=torch.zeros(d_ff, dtype=torch.int64),
        mlp_params=0,
    )


def test_the_kept_rows_are_a_uniform_sample_of_the_stream() -> None:
    samples = empty_samples(1, 2)
    generator = torch.Generator().manual_seed(0)
    for start in range(0, 10_000, 50):  # 200 batches of 50 rows; row i holds i
        ids = torch.arange(start, start + 50, dtype=torch.float64)[:, None]
        samples._add(ids, torch.stack([ids[:, 0] % 2 == 0, ids[:, 0] < 100], 1), 1000, generator)
    kept = samples.inputs[:, 0]
    assert samples.rows_seen == 10_000 and kept.numel() == 1000 and kept.unique().numel() == 1000
    assert samples.active_counts.tolist() == [5000, 100]  # exact, whatever was kept
    assert torch.equal(samples.labels[:, 0], kept % 2 == 0)  # rows keep their labels
    # each tenth of the stream holds about a tenth of the sample (binomial sd ~ 9.5)
    per_tenth = torch.bincount((kept // 1000).long(), minlength=10)
    assert (per_tenth - 100).abs().max() < 40


def test_a_sample_that_never_fills_keeps_every_row_in_order_in_storage_of_its_size() -> None:
    """Rows go into storage grown by doubling; at the end of a collection the sample holds exactly
    the rows seen, in order, and no more memory than they take."""
    samples = empty_samples(2, 3)
    generator = torch.Generator().manual_seed(0)
    rows = torch.arange(0, 2 * 370, dtype=torch.bfloat16).view(370, 2)
    labels = torch.cat((rows, rows[:, :1]), 1) > 100
    for start in range(0, 370, 37):
        samples._add(rows[start : start + 37], labels[start : start + 37], 1000, generator)
    samples._finish()
    assert torch.equal(samples.inputs, rows) and samples.inputs.dtype == torch.bfloat16
    assert torch.equal(samples.labels, labels)
    assert samples.inputs.untyped_storage().nbytes() == rows.numel() * 2  # not the doubled storage
