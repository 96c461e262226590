"""The architecture table against real (tiny, random) transformers models of every supported type."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from transformers.activations import ACT2FN

from flashlm.arch import (
    ARCHITECTURES,
    MLPSpec,
    find_mlps,
    mlp_owner_names,
    mlp_weight_names,
    model_type_of,
    spec_for,
)
from flashlm.errors import UnsupportedArchitectureError

try:  # tests/ as a package (tests/__init__.py) or as a rootdir-inserted directory
    from .conftest import TINY_CONFIGS, TINY_VARIANTS, build_tiny_model, tiny_config
except ImportError:
    from conftest import TINY_CONFIGS, TINY_VARIANTS, build_tiny_model, tiny_config

NAMES = [*TINY_CONFIGS, *TINY_VARIANTS]


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _linear(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    linear = getattr(module, name)
    return linear.weight, getattr(linear, "bias", None)


def _reference_mlp(spec: MLPSpec, owner: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP computed from the owner's weights, as the spec describes it."""
    act = getattr(owner, spec.act)
    down_w, down_b = _linear(owner, spec.down)
    if spec.gated:
        if spec.gate_up is not None:
            gate_up_w, _ = _linear(owner, spec.gate_up)
            gate_w, up_w = gate_up_w.chunk(2, dim=0)  # first half is the gate
        else:
            gate_w, _ = _linear(owner, spec.gate)
            up_w, _ = _linear(owner, spec.up)
        return F.linear(act(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)
    up_w, up_b = _linear(owner, spec.up)
    return F.linear(act(F.linear(x, up_w, up_b)), down_w, down_b)


def _module_mlp(spec: MLPSpec, owner: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The owner module's own MLP output."""
    if spec.owner:
        return owner(x)
    # OPT: the MLP lives inside the decoder layer, between its own norms and dropouts.
    return owner.fc2(owner.activation_fn(owner.fc1(x)))


def test_every_architecture_has_a_tiny_config():
    assert set(TINY_CONFIGS) == set(ARCHITECTURES)
    for name in NAMES:
        assert model_type_of(tiny_config(name)) in ARCHITECTURES


@pytest.fixture(scope="module", params=NAMES)
def tiny(request):
    """(name, model, spec) for each tiny config, in float32 so comparisons are tight."""
    model = build_tiny_model(request.param, torch.float32)
    return request.param, model, spec_for(model_type_of(model.config))


def test_spec_for_and_config_key(tiny):
    _, model, spec = tiny
    assert isinstance(spec, MLPSpec)
    assert spec is ARCHITECTURES[model.config.model_type]
    # The activation's config key exists on the (text) config.
    text = _text_config(model.config)
    assert hasattr(text, spec.act_config_key)
    # ... and names the activation the owner modules actually use.
    act = ACT2FN[getattr(text, spec.act_config_key)]
    for _, _, owner in find_mlps(model, spec):
        assert type(getattr(owner, spec.act)) is type(act)
    assert spec.gated == (spec.gate is not None or spec.gate_up is not None)
    assert spec.down not in spec.input_projections


def test_find_mlps_finds_every_layer_in_order(tiny):
    _, model, spec = tiny
    found = find_mlps(model, spec)
    layers = _text_config(model.config).num_hidden_layers
    assert [index for index, _, _ in found] == list(range(layers))
    modules = dict(model.named_modules())
    for index, name, owner in found:
        assert modules[name] is owner
        assert f".{index}" in name
        if spec.owner:
            assert name.endswith(f".{spec.owner}")
    assert len({name for _, name, _ in found}) == layers


def test_reference_mlp_matches_module(tiny):
    _, model, spec = tiny
    hidden = _text_config(model.config).hidden_size
    torch.manual_seed(1)
    x = torch.randn(2, 5, hidden)
    with torch.no_grad():
        for _, name, owner in find_mlps(model, spec):
            expected = _module_mlp(spec, owner, x)
            actual = _reference_mlp(spec, owner, x)
            assert expected.shape == x.shape
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)
            assert expected.abs().max() > 0  # the comparison is not vacuous


def test_mlp_weight_names_exist_with_expected_shapes(tiny):
    _, model, spec = tiny
    text = _text_config(model.config)
    d_model = text.hidden_size
    d_ff = getattr(text, "intermediate_size", None) or getattr(text, "ffn_dim", None) or text.ffn_hidden_size
    state = model.state_dict()
    for _, owner_name, owner in find_mlps(model, spec):
        names = mlp_weight_names(spec, owner_name)
        expected_roles = {"down", "gate_up"} if spec.gate_up else {"down", "up"}
        if spec.gate:
            expected_roles.add("gate")
        if not spec.gated:
            expected_roles |= {"up_bias", "down_bias"}
        assert set(names) == expected_roles
        for role, key in names.items():
            if role.endswith("_bias"):
                linear = getattr(owner, spec.up if role == "up_bias" else spec.down)
                assert (key in state) == (linear.bias is not None), key
            else:
                assert key in state, key
        assert state[names["down"]].shape == (d_model, d_ff)
        if spec.gate_up:
            assert state[names["gate_up"]].shape == (2 * d_ff, d_model)
        else:
            assert state[names["up"]].shape == (d_ff, d_model)
        if spec.gate:
            assert state[names["gate"]].shape == (d_ff, d_model)
        if "up_bias" in names and names["up_bias"] in state:
            assert state[names["up_bias"]].shape == (d_ff,)
            assert state[names["down_bias"]].shape == (d_model,)


def test_mlp_owner_names_from_state_dict_match_find_mlps(tiny):
    _, model, spec = tiny
    owners = [name for _, name, _ in find_mlps(model, spec)]
    keys = list(model.state_dict())
    assert mlp_owner_names(spec, keys) == owners
    assert mlp_owner_names(spec, reversed(keys)) == owners


def _checkpoint_keys(path: Path) -> set[str]:
    keys: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            keys.update(handle.keys())
    return keys


@pytest.mark.parametrize("name", NAMES)
def test_saved_checkpoint_names_cover_every_layer(name, make_tiny_checkpoint):
    """Store conversion finds each layer's MLP tensors by name in the safetensors files, without
    the model. A checkpoint may name them otherwise than the module path (transformers saves
    Gemma3ForConditionalGeneration as `language_model.model.layers.N.mlp`, loads it as
    `model.language_model.layers.N.mlp`); the store is keyed by layer index, which both share."""
    path = make_tiny_checkpoint(name)
    config = json.loads((path / "config.json").read_text())
    spec = spec_for(model_type_of(transformers.AutoConfig.from_pretrained(path)))
    assert config["dtype"] == "bfloat16"
    keys = _checkpoint_keys(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    module_owners = find_mlps(model, spec)
    checkpoint_owners = mlp_owner_names(spec, keys)
    checkpoint_layers = [int(re.findall(r"\d+", owner)[-1]) for owner in checkpoint_owners]
    assert checkpoint_layers == [index for index, _, _ in module_owners]
    for owner in checkpoint_owners:
        for role, key in mlp_weight_names(spec, owner).items():
            if not role.endswith("_bias"):
                assert key in keys, key


def test_unsupported_model_type_lists_supported():
    with pytest.raises(UnsupportedArchitectureError) as info:
        spec_for("gpt2")
    message = str(info.value)
    assert "gpt2" in message
    for model_type in ARCHITECTURES:
        assert model_type in message
    assert isinstance(info.value, ValueError)


def test_find_mlps_without_matching_modules_raises():
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    gpt2 = transformers.GPT2LMHeadModel(config)
    with pytest.raises(UnsupportedArchitectureError, match="No MLP"):
        find_mlps(gpt2, spec_for("llama"))
    with pytest.raises(UnsupportedArchitectureError):
        find_mlps(torch.nn.Sequential(torch.nn.Linear(4, 4)), spec_for("opt"))


def test_find_mlps_with_wrong_family_raises():
    llama = build_tiny_model("llama")
    with pytest.raises(UnsupportedArchitectureError):
        find_mlps(llama, spec_for("falcon"))


def test_mlp_owner_names_without_matches_raises():
    with pytest.raises(UnsupportedArchitectureError):
        mlp_owner_names(spec_for("llama"), ["transformer.h.0.mlp.c_fc.weight"])


def test_model_type_of_multimodal_and_plain():
    assert model_type_of(tiny_config("gemma3")) == "gemma3"
    assert model_type_of(tiny_config("llama")) == "llama"
    wrapper = transformers.PretrainedConfig()
    wrapper.model_type = "some_vlm"
    wrapper.text_config = tiny_config("qwen2")
    assert model_type_of(wrapper) == "qwen2"
