"""Calibration: the Pareto fit of DIP's density split, quantile thresholds, and the saved file."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import flashlm
from flashlm.errors import ConfigError
from flashlm.methods.calibration import CALIBRATION_FILE, Calibration, fit_split, pareto_front, split_from_fit
from flashlm.patching import streaming_mlps
from flashlm.workflows.calibrate import CALIBRATION_OPTIONS, calibrate_model


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_pareto_front_keeps_only_undominated_points() -> None:
    points = [
        {"density": 0.5, "perplexity": 10.0},
        {"density": 0.6, "perplexity": 12.0},  # dominated by the first
        {"density": 0.7, "perplexity": 8.0},
        {"density": 0.4, "perplexity": 30.0},
        {"density": 0.7, "perplexity": 9.0},  # dominated by its twin
    ]
    front = pareto_front(points)
    assert [(p["density"], p["perplexity"]) for p in front] == [(0.4, 30.0), (0.5, 10.0), (0.7, 8.0)]


def test_fit_split_recovers_a_logit_linear_front() -> None:
    intercept, slope = 0.3, 2.0
    points = []
    for density in (0.4, 0.5, 0.6, 0.7, 0.8):
        rho_in = 1 / (1 + math.exp(-(intercept + slope * logit(density))))
        points.append({"density": density, "rho_in": rho_in, "perplexity": 10 / density})  # all on the front
        points.append({"density": density, "rho_in": 0.5, "perplexity": 20 / density})  # dominated
    fit = fit_split(points)
    assert fit["intercept"] == pytest.approx(intercept, abs=1e-6)
    assert fit["slope"] == pytest.approx(slope, abs=1e-6)


def test_fit_split_ignores_front_points_at_full_input_density() -> None:
    # SmolLM2's front ends in ρ_in = 1 points; clamping their infinite logit tilted the line until
    # it asked for ρ_in 0.97 where the front has 0.85.
    front = [(0.5, 0.55), (0.6, 0.7), (0.7, 0.7), (0.8, 0.85), (0.9, 1.0), (0.95, 1.0)]
    points = [{"density": density, "rho_in": rho_in, "perplexity": 10 / density} for density, rho_in in front]
    fit = fit_split(points)
    interior = fit_split(points[:4])
    assert fit == interior
    rho_in, _ = split_from_fit(fit, 0.7)
    assert 0.65 < rho_in < 0.8


def test_load_refits_the_split_from_the_saved_points(tmp_path) -> None:
    points = [
        {"rho_in": rho, "rho_down": rho, "density": rho, "perplexity": 10 / rho} for rho in (0.4, 0.55, 0.7)
    ]
    stale = Calibration(
        content_sha256="abc",
        corpus="text",
        tokens=1,
        input_quantiles=[],
        global_input_quantiles=[],
        gate_quantiles=[],
        split_fit={"intercept": 0.25, "slope": 2.4},  # what an older fit wrote
        split_points=points,
    )
    stale.save(tmp_path)
    loaded = Calibration.load(tmp_path, "abc")
    assert loaded.split_fit == fit_split(points)
    assert loaded.split(0.55)[0] == pytest.approx(0.55)


@pytest.mark.parametrize("density", [0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0])
def test_split_is_feasible_and_spends_the_target(density) -> None:
    for fit in (
        {"intercept": 0.25, "slope": 2.4},
        {"intercept": -3.0, "slope": 0.1},
        {"intercept": 3, "slope": 1},
    ):
        rho_in, rho_down = split_from_fit(fit, density)
        assert 0 < rho_in <= 1 and 0 < rho_down <= 1
        assert (2 * rho_in + rho_down) / 3 == pytest.approx(density)


def test_calibrate_model_on_the_tiny_llama(make_tiny_checkpoint, tmp_path) -> None:
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    store = tmp_path / "store"
    config = flashlm.FlashConfig(
        method="dip",
        store=str(store),
        memory_budget="10MB",
        **CALIBRATION_OPTIONS,
    )
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config).eval()
    ids = torch.randint(3, 128, (512,), generator=torch.Generator().manual_seed(0))
    inputs: dict[int, list[torch.Tensor]] = {}
    for module in streaming_mlps(model):
        module.register_forward_pre_hook(
            lambda mod, args: inputs.setdefault(mod.layer, []).append(args[0].reshape(-1, mod.d_model))
        )
    with pytest.raises(ConfigError, match="whole windows of context_length=64"):
        calibrate_model(model, ids, context_length=64, num_tokens=32, progress=False)
    assert not (store / CALIBRATION_FILE).exists()
    result = calibrate_model(model, ids, context_length=64, num_tokens=256, progress=False)

    assert (store / CALIBRATION_FILE).is_file()
    opened = flashlm.Store.open(store)
    loaded = Calibration.load(store, opened.content_sha256)
    assert loaded == result
    assert Calibration.load(store, "another hash") is None
    assert result.split_fit is not None and len(result.split_points) == 36
    for layer, quantiles in enumerate(result.input_quantiles):
        assert quantiles == sorted(quantiles)
        # the threshold for a fraction keeps that fraction of the calibration inputs
        x = torch.cat(inputs[layer][:4]).abs()  # the first pass: the magnitude collection itself
        for keep in (0.3, 0.6):
            kept = (x > result.input_threshold(layer, keep)).float().mean().item()
            assert kept == pytest.approx(keep, abs=0.02)
    assert all(q == sorted(q) for q in result.gate_quantiles)

    # methods that need thresholds now load, and their thresholds come from the file
    cats = AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=flashlm.FlashConfig(
            method="cats", density=0.6, store=str(store), memory_budget="10MB"
        ),
    )
    assert streaming_mlps(cats)[1].threshold == pytest.approx(result.gate_threshold(1, 0.4))
    dip = AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=flashlm.FlashConfig(
            method="dip", density=0.5, store=str(store), memory_budget="10MB"
        ),
    )
    rho_in, rho_down = result.split(0.5)
    assert streaming_mlps(dip)[0].k_in == max(1, round(rho_in * 64))
    assert streaming_mlps(dip)[0].k_out == max(1, round(rho_down * 96))


def test_load_or_calibrate_measures_only_when_the_store_has_none(make_tiny_checkpoint, tmp_path, monkeypatch):
    from flashlm.workflows import calibrate as workflow

    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    store = tmp_path / "store"
    calls = []
    monkeypatch.setattr(workflow, "calibrate", lambda *args, **kwargs: calls.append(kwargs) or "measured")
    assert workflow.load_or_calibrate(path, store=str(store), num_tokens=64, progress=False) == "measured"
    assert calls == [{"corpus": "shakespeare", "store": str(store), "progress": False, "num_tokens": 64}]

    saved = Calibration(
        content_sha256=flashlm.Store.open(store).content_sha256,
        corpus="text",
        tokens=1,
        input_quantiles=[],
        global_input_quantiles=[],
        gate_quantiles=[],
        split_fit=None,
        split_points=[],
    )
    saved.save(store)
    assert workflow.load_or_calibrate(path, store=str(store), progress=False) == Calibration.load(
        store, saved.content_sha256
    )
    assert len(calls) == 1  # the saved one, not measured again
