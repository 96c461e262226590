"""ReLU / FATReLU in place of the MLP activation (`flashlm.activations`) and the recipe's tools around it
(`flashlm.training.activations`)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import build_tiny_model
from torch import nn

from flashlm.activations import FATReLU, activations, is_relufied, relufy
from flashlm.arch import find_mlps, model_type_of, spec_for
from flashlm.errors import ConfigError
from flashlm.training.activations import (
    ZeroCounter,
    allocate_zeros,
    calibrate_thresholds,
    cheapest_levels,
    dense_activations,
    threshold_ramp,
    zero_fractions,
)

ARCHS = ["llama", "qwen2", "phi3", "gemma", "gemma3", "opt", "falcon"]


def _ids(model: nn.Module, tokens: int = 128, seed: int = 0) -> torch.Tensor:
    vocab = model.get_input_embeddings().num_embeddings
    return torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(seed))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids.reshape(1, -1), use_cache=False).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_relufy_swaps_every_activation_and_no_other_module(arch):
    model = build_tiny_model(arch)
    before = {name: module for name, module in model.named_modules()}
    weights = {name: p.detach().clone() for name, p in model.state_dict().items()}
    spec = spec_for(model_type_of(model.config))
    layers = len(find_mlps(model, spec))

    replaced = relufy(model, 0.25)

    after = dict(model.named_modules())
    assert len(replaced) == layers and set(replaced) <= set(after)
    assert all(name.endswith(spec.act) for name in replaced)
    for name, module in after.items():
        if name in replaced:
            assert isinstance(module, FATReLU) and module.threshold == 0.25
            assert not isinstance(before[name], FATReLU)
        else:
            assert module is before[name], f"{name} changed"
    assert set(after) == set(before)
    state = model.state_dict()  # no weight changed, and the thresholds add no tensor to the checkpoint
    assert state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)
    text = model.config.get_text_config()
    assert getattr(text, spec.act_config_key) == "fatrelu"
    assert model.config.relufication["thresholds"] == [0.25] * layers
    assert is_relufied(model)


def test_relufy_records_relu_and_per_layer_thresholds():
    model = build_tiny_model("llama")
    relufy(model)
    assert model.config.hidden_act == "relu"
    assert model.config.relufication == {"activation": "relu", "thresholds": [0.0, 0.0], "replaces": "silu"}
    relufy(model, [0.1, 0.3])  # relufying again changes only the thresholds; the replaced act stays silu
    assert [a.module.threshold for a in activations(model)] == pytest.approx([0.1, 0.3])
    assert model.config.relufication["replaces"] == "silu" and model.config.hidden_act == "fatrelu"
    with pytest.raises(ConfigError, match="one threshold per MLP layer"):
        relufy(model, [0.1, 0.2, 0.3])
    with pytest.raises(ConfigError, match=">= 0"):
        relufy(model, -0.5)


def test_fatrelu_zeros_below_the_threshold_exactly():
    t = 0.5
    act = FATReLU(t)
    x = torch.tensor([-3.0, -0.0, 0.0, 0.25, 0.5, 0.5000001, 0.75, 4.0])
    y = act(x)
    below = x <= t
    assert torch.equal(y[below], torch.zeros(int(below.sum())))
    assert not torch.signbit(y[below]).any()  # +0.0, never -0.0
    assert torch.equal(y[~below], x[~below])  # the identity above
    # bf16 inputs, a large random tensor; threshold 0 is exactly ReLU
    z = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert y.dtype == x.dtype and act(z).dtype == torch.bfloat16
    assert torch.equal(FATReLU(0.0)(z), torch.relu(z))
    assert int((act(z) == 0).sum()) == int((z <= t).sum())
    with pytest.raises(ConfigError):
        FATReLU(-0.1)
    assert "threshold" not in act.state_dict()  # the config records thresholds, not the weights file


def test_dense_activations_restores_the_dense_model_inside_the_block():
    model = build_tiny_model("llama")
    ids = _ids(model)
    dense = _logits(model, ids)
    relufy(model, 0.1)
    relufied = _logits(model, ids)
    assert not torch.equal(dense, relufied)
    with dense_activations(model):
        assert not is_relufied(model)
        assert torch.equal(_logits(model, ids), dense)
    assert is_relufied(model) and torch.equal(_logits(model, ids), relufied)
    with pytest.raises(RuntimeError), dense_activations(model):  # restored even on error
        raise RuntimeError("boom")
    assert is_relufied(model)


def test_zero_counter_counts_exact_zeros_per_layer():
    model = build_tiny_model("llama")
    ids = _ids(model)
    relufy(model, [0.0, 1e9])  # layer 1 is all zeros
    overall, per_layer = zero_fractions(model, ids, context_length=32, num_tokens=128)
    assert per_layer[1] == 1.0
    # layer 0 is ReLU: its zeros are its negative (or zero) inputs, counted here by another hook
    inputs = []
    act0 = activations(model)[0].module
    handle = act0.register_forward_hook(lambda m, args, out: inputs.append(args[0]))
    with ZeroCounter(model) as counter:
        _logits(model, ids[:32])
    handle.remove()
    expected = float((inputs[0] <= 0).float().mean())
    assert counter.fractions()[0] == pytest.approx(expected)
    assert 0 < per_layer[0] < 1 and overall == pytest.approx(sum(per_layer) / 2)


def test_calibrated_thresholds_hit_the_target_in_the_first_layer():
    model = build_tiny_model("llama")
    ids = _ids(model, 512)
    thresholds = calibrate_thresholds(model, ids, 0.8, context_length=64, num_tokens=512)
    assert len(thresholds) == 2 and all(t >= 0 for t in thresholds)
    relufy(model, thresholds)
    _, per_layer = zero_fractions(model, ids, context_length=64, num_tokens=512)
    # layer 0 sees the same inputs as the dense model did; later layers see relufied layers' outputs
    assert per_layer[0] == pytest.approx(0.8, abs=0.01)
    with pytest.raises(ConfigError, match=r"\(0, 1\)"):
        calibrate_thresholds(model, ids, 1.5)


def test_cheapest_levels_match_brute_force_on_small_instances():
    generator = torch.Generator().manual_seed(0)
    levels = [0.6, 0.7, 0.75, 0.8, 0.9]
    for trial in range(24):
        layers = 1 + trial % 4
        mean = (0.6, 0.72, 0.75, 0.8, 0.85, 0.9)[trial % 6]
        costs = torch.rand(layers, len(levels), generator=generator).tolist()
        picks = cheapest_levels(costs, levels, mean)

        def cost(choice: tuple[int, ...], costs: list[list[float]] = costs) -> float:
            return sum(costs[layer][i] for layer, i in enumerate(choice))

        feasible = [
            choice
            for choice in itertools.product(range(len(levels)), repeat=layers)
            if sum(levels[i] for i in choice) >= layers * mean - 1e-9
        ]
        assert len(picks) == layers and sum(levels[i] for i in picks) >= layers * mean - 1e-9
        assert cost(tuple(picks)) == pytest.approx(min(cost(choice) for choice in feasible))
    for unreachable in (0.8, 0.5):  # above every level, below every level
        with pytest.raises(ConfigError, match=rf"cannot average {unreachable}: choose levels on both sides"):
            cheapest_levels([[0.0, 1.0], [0.0, 1.0]], [0.6, 0.7], unreachable)


@pytest.mark.parametrize("sensitive", [0, 1])
def test_allocate_zeros_gives_the_sensitive_layer_fewer(sensitive):
    model = build_tiny_model("llama")
    # the sensitive layer's MLP output dominates its residual stream, so its zeros move the logits more
    activations(model)[sensitive].owner.down_proj.weight.data.mul_(50)
    ids = _ids(model, 512)
    before = _logits(model, ids[:64])
    allocation = allocate_zeros(
        model, ids, 0.75, levels=(0.6, 0.9), context_length=64, num_tokens=512, sensitivity_tokens=128
    )
    assert allocation.levels == [0.6, 0.9] and allocation.mean_target == pytest.approx(0.75)
    assert allocation.targets[sensitive] == 0.6 and allocation.targets[1 - sensitive] == 0.9
    costs = allocation.costs
    assert all(cost > 0 for layer in costs for cost in layer)  # KL divergences from the dense model
    assert costs[sensitive][1] - costs[sensitive][0] > costs[1 - sensitive][1] - costs[1 - sensitive][0]
    # each layer's threshold is its chosen quantile over all the windows, as calibrate_thresholds gives
    for layer, target in enumerate(allocation.targets):
        assert (
            allocation.thresholds[layer]
            == calibrate_thresholds(model, ids, target, context_length=64, num_tokens=512)[layer]
        )
    # the model comes back as it was: its own activations, the same logits
    assert not is_relufied(model) and not any(isinstance(a.module, FATReLU) for a in activations(model))
    assert torch.equal(_logits(model, ids[:64]), before)
    with pytest.raises(ConfigError, match=r"Zero levels must lie in \(0, 1\)"):
        allocate_zeros(model, ids, 0.75, levels=(0.6, 1.0), context_length=64, num_tokens=512)
    # a target the levels cannot average is refused before any forward runs
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(ConfigError, match=r"cannot average 0.95: choose levels on both sides"):
        allocate_zeros(model, ids, 0.95, levels=(0.6, 0.9), context_length=64, num_tokens=512)
    handle.remove()
    assert forwards == []


def test_threshold_ramp_grows_the_thresholds_from_relu_to_theirs():
    model = build_tiny_model("llama")
    relufy(model, [0.2, 0.4])
    ramp = threshold_ramp(model, [0.2, 0.4], steps=4)

    def thresholds() -> list[float]:
        return [act.module.threshold for act in activations(model)]

    ramp(0)
    assert thresholds() == pytest.approx([0.05, 0.1])
    ramp(2)
    assert thresholds() == pytest.approx([0.15, 0.3])
    for step in (3, 9):  # full from step `steps - 1` on
        ramp(step)
        assert thresholds() == [0.2, 0.4]
    ramp(1)  # set from the step alone, so a resumed run continues the schedule
    assert thresholds() == pytest.approx([0.1, 0.2])
    ids = _ids(model, 64)
    sparse = zero_fractions(model, ids, context_length=64, num_tokens=64)[0]
    ramp(3)
    assert zero_fractions(model, ids, context_length=64, num_tokens=64)[0] > sparse

    with pytest.raises(ConfigError, match="one FATReLU per threshold"):
        threshold_ramp(model, [0.2], steps=4)
    with pytest.raises(ConfigError, match="FATReLU"):
        threshold_ramp(build_tiny_model("llama"), [0.2, 0.4], steps=4)  # not relufied
