"""The one create-and-replace walk is generic: a method family that brings its own `Replacer` patches,
reports stats and unpatches through `flashlm.patching` with no change there (what a newcomer adding a
method relies on)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model
from torch import nn

import flashlm
from flashlm.arch import find_mlps, model_type_of, spec_for
from flashlm.engine.runtime import Runtime
from flashlm.methods import METHODS, MethodModule, Replacer, Target, flashlm_modules
from flashlm.patching import replace_modules


class _HeldRuntime(Runtime):
    """Reads nothing: the 'store' is the replaced modules themselves, kept in memory."""

    def __init__(self, store: dict[int, nn.Module], config: flashlm.FlashConfig) -> None:
        super().__init__(store, config, {}, "unused")
        self.closed = False

    def resident_bytes(self) -> int:
        return sum(
            p.numel() * p.element_size() for module in self.store.values() for p in module.parameters()
        )

    def close(self) -> None:
        super().close()
        self.closed = True


class _HeldReplacer(Replacer):
    def open_store(self, model, config, checkpoint_dir, *, progress=True):
        return {}

    def prepare(self, model, store, config):
        spec = spec_for(model_type_of(model.config))
        runtime = _HeldRuntime(store, config)
        targets = []
        for layer, name, owner in find_mlps(model, spec):
            store[layer] = owner
            targets.append(Target(name, layer, owner, released=(f"{name}.{spec.down}.weight",)))
        return runtime, targets

    def create(self, runtime, target):
        return _HeldMLP(target.layer, runtime)

    def dense_weights(self, model):
        return {}

    def restore(self, model, weights):
        for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, _HeldMLP)]:
            model.set_submodule(name, module.runtime.store[module.layer])


class _HeldMLP(MethodModule):
    """Computes the replaced MLP as it was, counting one row per layer and token."""

    replacer = _HeldReplacer()

    def __init__(self, layer: int, runtime: _HeldRuntime) -> None:
        super().__init__()
        self.layer = layer
        self.runtime = runtime

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.layer == 0:
            self.runtime.stats.begin_step()
        self.runtime.stats.record(self.layer, tokens=hidden_states.shape[:-1].numel())
        return self.runtime.store[self.layer](hidden_states)


@pytest.fixture
def held_method(monkeypatch):
    monkeypatch.setitem(METHODS._classes, "held", _HeldMLP)
    monkeypatch.setattr(_HeldMLP, "method", "held", raising=False)
    return "held"


def test_a_new_method_family_patches_reports_and_unpatches_through_the_one_walk(held_method):
    model = build_tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    originals = [owner for _, _, owner in find_mlps(model, spec_for("llama"))]

    flashlm.patch(model, flashlm.FlashConfig(method=held_method))
    modules = flashlm_modules(model)
    assert [type(m) for m in modules] == [_HeldMLP] * model.config.num_hidden_layers
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    stats = flashlm.stats(model, reset=True)
    assert [(step["step"], step["tokens"]) for step in stats.per_step()] == [(0, 7)]
    assert len(stats.per_layer()) == model.config.num_hidden_layers
    assert stats.io_mode == "none"  # no files: no reader
    assert flashlm.stats(model).totals()["steps"] == 0

    runtime = modules[0].runtime
    flashlm.unpatch(model)
    assert runtime.closed and not flashlm_modules(model)
    assert [owner for _, _, owner in find_mlps(model, spec_for("llama"))] == originals


def test_the_walk_returns_the_keys_the_replacer_releases(held_method):
    model = build_tiny_model("llama")
    runtime, released = replace_modules(model, {}, flashlm.FlashConfig(method=held_method))
    assert released == [
        f"model.layers.{i}.mlp.down_proj.weight" for i in range(model.config.num_hidden_layers)
    ]
    assert isinstance(runtime, _HeldRuntime)
