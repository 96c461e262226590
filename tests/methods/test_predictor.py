"""`method="predictor"`: only predicted-active bundles are read; with a predictor that never misses, the
output is the dense model's (ReLU-family activations are exactly zero where it skips); the window cache
loads only what a token adds; bad input gets specific errors. `method="predictor-gate"` computes the
same, reading the up rows and down columns of only the predicted neurons that fire."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import clock_moving_in, record_tensor_reads, tiny_config
from safetensors.torch import load_file

import flashlm
from flashlm.arch import find_mlps, model_type_of, spec_for
from flashlm.errors import BudgetTooSmallError, ConfigError, StoreMismatchError
from flashlm.methods import PredictorMLP
from flashlm.methods import predictor as predictor_module
from flashlm.methods.predictor import PredictedGatesMLP
from flashlm.patching import streaming_mlps
from flashlm.predictors import LowRankPredictor, Predictors


def relu_checkpoint(name: str, tmp_path) -> tuple[torch.nn.Module, object]:
    """A tiny fp32 model with a ReLU-family activation (OPT as it is; llama with its gate's SiLU
    swapped for ReLU, as relufication does), saved; and its directory."""
    config = tiny_config(name)
    if name == "llama":
        config.hidden_act = "relu"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path / f"{name}-relu"
    model.save_pretrained(path)
    return model, path


def exact_predictors(model: torch.nn.Module, threshold_logit: float = 0.0) -> Predictors:
    """Predictors that never miss: rank d_model, reduce = identity, expand = the projection whose sign
    decides the activation (gate for a gated MLP, up with its bias for a plain one), threshold logit 0
    (below 0, they also name neurons that do not fire)."""
    spec = spec_for(model_type_of(model.config))
    layers = []
    for _, _, owner in find_mlps(model, spec):
        decides = getattr(owner, spec.gate or spec.up)
        d_ff, d_model = decides.weight.shape
        predictor = LowRankPredictor(d_model, d_ff, d_model, threshold_logit=threshold_logit)
        with torch.no_grad():
            predictor.reduce.weight.copy_(torch.eye(d_model))
            predictor.expand.weight.copy_(decides.weight)
            predictor.expand.bias.copy_(decides.bias if decides.bias is not None else torch.zeros(d_ff))
        layers.append(predictor)
    return Predictors(layers)


def load(path, store, method="predictor", **options) -> torch.nn.Module:
    config = flashlm.FlashConfig(method=method, store=str(store), **{"memory_budget": 10**7, **options})
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config)


MODULES = {"predictor": PredictorMLP, "predictor-gate": PredictedGatesMLP}


@pytest.mark.parametrize(
    ("name", "method"), [("llama", "predictor"), ("opt", "predictor"), ("llama", "predictor-gate")]
)
def test_a_predictor_that_never_misses_reproduces_the_dense_model(name, method, tmp_path):
    model, path = relu_checkpoint(name, tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    exact_predictors(model).save(store.path)
    # density just under 1 (so the method is not dense streaming) yet never capping a token's neurons
    d_ff = store.d_ff
    patched = load(path, store.path, method, density=(d_ff - 0.4) / d_ff, cache_split="size")
    assert all(isinstance(m, MODULES[method]) and m.k_max == d_ff for m in streaming_mlps(patched))

    ids = torch.randint(3, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
        expected = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(patched.generate(ids, max_new_tokens=6, do_sample=False), expected)
    totals = flashlm.stats(patched).totals()
    assert totals["density"] < 0.75  # ReLU on random weights: about half the neurons are zero
    assert totals["bytes_read"] > 0

    # a saved model is the dense checkpoint: the predictors stay beside the store
    patched.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert not [key for key in saved if "predictor" in key]
    assert set(saved) == set(load_file(path / "model.safetensors"))


def test_only_predicted_bundles_are_read_and_the_window_loads_the_increment(tmp_path):
    model, path = relu_checkpoint("llama", tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    exact_predictors(model).save(store.path)
    patched = load(path, store.path, density=0.5, policy="window", window=4)
    module = streaming_mlps(patched)[0]
    x = torch.randn(1, store.d_model, generator=torch.Generator().manual_seed(2))
    predicted = module.select(x)
    assert 0 < int(predicted.sum()) <= module.k_max == round(0.5 * store.d_ff)

    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        patched.generate(ids, max_new_tokens=8, do_sample=False)
    per_step = flashlm.stats(patched).per_step()
    decode = per_step[1:]
    row_bytes = flashlm.Store.open(store.path).row_file(0, "bundle").row_bytes
    # each decode token reads no more bundles than it misses, and misses fewer than it uses once the
    # window holds the previous tokens' neurons
    assert all(step["bytes_read"] >= step["misses"] * row_bytes for step in decode)
    assert sum(step["misses"] for step in decode) < sum(step["hits"] + step["misses"] for step in decode)
    assert sum(step["hits"] for step in decode) > 0


@pytest.mark.parametrize("method", ["predictor", "predictor-gate"])
def test_reads_guessed_a_layer_ahead_change_nothing_but_the_reads(method, tmp_path, monkeypatch):
    """With `read_ahead=True` a decode step starts reading the first-round units the next layer's
    predictor names for this layer's input (by default it does not). What each layer computes is still
    what its own predictor names, so logits, tokens, hits and misses are those of a run without guesses;
    every byte read is in the stats, and no guess is left in flight."""
    model, path = relu_checkpoint("llama", tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    exact_predictors(model, threshold_logit=-0.05).save(store.path)
    ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(6))
    runs = {}
    for read_ahead in (None, True):
        patched = load(path, store.path, method, density=0.6, cache_split="size", read_ahead=read_ahead)
        runtime = streaming_mlps(patched)[0].runtime
        guesses = []
        monkeypatch.setattr(
            runtime, "guess", lambda *args, g=runtime.guess, seen=guesses: (seen.append(args), g(*args))
        )
        taken = []
        monkeypatch.setattr(
            runtime,
            "submit_after",
            lambda guess, further, fetch_ids, s=runtime.submit_after, seen=taken: (
                seen.append(guess),
                s(guess, further, fetch_ids),
            )[1],
        )
        with torch.no_grad():
            logits = patched(ids).logits
            tokens = patched.generate(ids, max_new_tokens=5, do_sample=False)
        runtime.drain()
        assert runtime._guess is None
        assert flashlm.stats(patched).totals()["bytes_read"] == runtime.reader.bytes_read > 0
        runs[read_ahead] = (logits, tokens, flashlm.stats(patched).totals(decode_only=True), guesses, taken)
    (logits, tokens, totals, none, _), (logits_g, tokens_g, totals_g, guesses, taken) = (
        runs[None],
        runs[True],
    )
    layers = len(streaming_mlps(patched))
    assert none == [] and len(guesses) == 4 * (layers - 1)  # every decode step, every layer but the last
    kind = MODULES[method].KINDS[0]
    assert {(layer, k) for layer, k, _, _ in guesses} == {(layer, kind) for layer in range(1, layers)}
    assert len(taken) == len(guesses)  # each guess completed by its layer's read, none dropped
    assert torch.equal(logits, logits_g) and torch.equal(tokens, tokens_g)
    assert (totals["hits"], totals["misses"]) == (totals_g["hits"], totals_g["misses"])
    assert totals_g["bytes_read"] >= totals["bytes_read"]


def test_gate_first_reads_up_and_down_of_only_the_neurons_that_fire(tmp_path):
    """A predictor that names more neurons than fire: both methods give the same logits and tokens, and
    the gate-first one reads every predicted gate row but the up_down rows of the firing ones alone."""
    model, path = relu_checkpoint("llama", tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    exact_predictors(model, threshold_logit=-0.05).save(store.path)
    bundles = load(path, store.path, "predictor", density=0.9, policy="none")
    gates_first = load(path, store.path, "predictor-gate", density=0.9, policy="none")
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(gates_first(ids).logits, bundles(ids).logits, rtol=1e-5, atol=1e-5)
        expected = bundles.generate(ids, max_new_tokens=5, do_sample=False)
        assert torch.equal(gates_first.generate(ids, max_new_tokens=5, do_sample=False), expected)

    module = streaming_mlps(gates_first)[0]
    x = torch.randn(1, store.d_model, generator=torch.Generator().manual_seed(5))
    predicted = module.select(x)[0]
    firing = predicted & (module.act(x @ model.model.layers[0].mlp.gate_proj.weight.T)[0] != 0)
    assert 0 < int(firing.sum()) < int(predicted.sum())  # the predictor names neurons that stay at zero
    flashlm.stats(gates_first, reset=True)
    with torch.no_grad():
        module(x.reshape(1, 1, -1))
    (step,) = flashlm.stats(gates_first).per_step()
    opened = flashlm.Store.open(store.path)
    gate_bytes, up_down_bytes = (opened.row_file(0, kind).row_bytes for kind in ("gate", "up_down"))
    assert step["misses"] == int(predicted.sum()) + int(firing.sum())  # no cache: every unit is read
    assert step["used_bytes"] == int(predicted.sum()) * gate_bytes + int(firing.sum()) * up_down_bytes
    bundle_bytes = opened.row_file(0, "bundle").row_bytes
    assert step["used_bytes"] < int(predicted.sum()) * bundle_bytes


def test_gate_first_shares_its_budget_by_a_unit_profile(tmp_path):
    """By default predictor-gate splits the cache bytes by a unit profile (none: an error naming the
    command): the gate rows of predicted neurons are used more often than the up_down rows of the
    firing ones, so at one budget the gate caches hold more of their layer than the up_down caches."""
    from flashlm.cache.profile import ProfileMissingError
    from flashlm.workflows.profile import profile_model

    model, path = relu_checkpoint("llama", tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    exact_predictors(model, threshold_logit=-0.3).save(store.path)
    with pytest.raises(ProfileMissingError, match=r"cache_split='profile' needs .* --method predictor-gate"):
        load(path, store.path, "predictor-gate", density=0.9)
    resident = load(path, store.path, "predictor-gate", density=0.9, cache_split="size", record_trace=True)
    ids = torch.randint(3, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(6))
    profile = profile_model(resident, ids, corpus="random", context_length=16, progress=False)
    profile.save(store.path)
    uses = {
        kind: sum(float(f.sum()) for (_, k), f in profile.frequencies.items() if k == kind)
        for kind in ("gate", "up_down")
    }
    assert uses["gate"] > 1.5 * uses["up_down"]

    budget = 320_000
    by_size, by_profile = (
        streaming_mlps(
            load(path, store.path, "predictor-gate", density=0.9, cache_split=split, memory_budget=budget)
        )[0].runtime
        for split in ("size", None)
    )
    for runtime in (by_size, by_profile):
        assert runtime.resident_bytes() <= budget
    shares = {
        split: {
            kind: sum(c for (_, k), c in r.capacities.items() if k == kind) for kind in ("gate", "up_down")
        }
        for split, r in (("size", by_size), ("profile", by_profile))
    }
    assert shares["size"]["gate"] == pytest.approx(shares["size"]["up_down"], abs=2)  # each a like share
    assert shares["profile"]["gate"] > shares["size"]["gate"]
    assert shares["profile"]["up_down"] < shares["size"]["up_down"]


def test_gate_first_needs_a_gate(tmp_path):
    _, path = relu_checkpoint("opt", tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    with pytest.raises(ConfigError, match="no gate projection"):
        load(path, store.path, "predictor-gate", density=0.5)


def test_a_model_whose_activation_is_not_zero_below_zero_is_refused(tmp_path, make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama", dtype=torch.float32)  # SwiGLU: SiLU is never exactly zero
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    exact_predictors(model).save(store.path)
    with pytest.raises(ConfigError, match="relufy"):
        load(path, store.path, density=0.5)


def test_predictors_of_another_store_are_refused(tmp_path):
    _, path = relu_checkpoint("llama", tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    other_model, other_path = relu_checkpoint("llama", tmp_path / "other")
    with torch.no_grad():
        other_model.model.embed_tokens.weight.zero_()  # other weights, same shapes
        for _, _, owner in find_mlps(other_model, spec_for("llama")):
            owner.gate_proj.weight.mul_(2)
    other_model.save_pretrained(other_path)
    other_store = flashlm.convert(other_path, tmp_path / "other-store", progress=False)
    exact_predictors(other_model).save(other_store.path)
    (store.path / "predictors.safetensors").write_bytes(
        (other_store.path / "predictors.safetensors").read_bytes()
    )
    with pytest.raises(StoreMismatchError):
        load(path, store.path, density=0.5)


def test_the_predictors_weights_are_paid_from_the_memory_budget(tmp_path):
    model, path = relu_checkpoint("llama", tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    predictors = exact_predictors(model)
    predictors.save(store.path)
    predictor_bytes = sum(p.numel() * p.element_size() for p in predictors.parameters())
    runtime = streaming_mlps(load(path, store.path, density=0.5))[0].runtime
    assert runtime.fitted_bytes == predictor_bytes > 0
    assert runtime.plan.overhead_bytes == runtime._staging_bytes() + predictor_bytes
    assert predictor_bytes < runtime.resident_bytes() <= runtime.budget_bytes

    with pytest.raises(BudgetTooSmallError, match="predictors") as info:
        config = flashlm.FlashConfig(method="predictor", store=str(store.path), memory_budget=predictor_bytes)
        transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    assert info.value.minimum_bytes > predictor_bytes


class FixedLogits(torch.nn.Module):
    """A stand-in predictor whose logits are its input."""

    threshold_logit = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("k_max", [3, 5, 8])
def test_selection_keeps_at_most_k_max_of_the_predicted_neurons_the_most_likely(k_max):
    """Above the threshold and among the k_max largest logits of its token: the cap binds only on the
    first token here (5 predicted), and never at k_max 5 or 8."""
    from flashlm.methods.selection import PredictorSelection

    selection = PredictorSelection()
    selection.predictor, selection.k_max, selection.d_ff = FixedLogits(), k_max, 8
    logits = torch.tensor(
        [[3.0, -1.0, 2.0, 0.5, 4.0, 1.0, -2.0, -0.5], [-1.0, 0.2, -3.0, -1.0, -1.0, 0, -2.0, -4.0]]
    )
    top = logits.topk(k_max, dim=1).values[:, -1:]
    assert torch.equal(selection.select(logits), (logits >= 0) & (logits >= top))
    assert selection.select(logits).sum(dim=1).tolist() == [min(5, k_max), 2]


def test_under_transformers_loader_the_predictors_are_read_once(tmp_path, monkeypatch):
    """At patching only their shapes are read (the loader allocates the modules' tensors itself);
    `reset_state` then reads the saved weights into place."""
    import flashlm.predictors.model as predictors_model

    model, path = relu_checkpoint("llama", tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    exact_predictors(model).save(store.path)
    read_at_patching = record_tensor_reads(monkeypatch, predictors_model)
    patched = load(path, store.path, density=0.5)
    assert read_at_patching == []
    saved = Predictors.load(store.path)
    for module, predictor in zip(streaming_mlps(patched), saved, strict=True):
        loaded = module.predictor.state_dict()
        assert all(torch.equal(loaded[key], value) for key, value in predictor.state_dict().items())
        assert not any(p.is_meta for p in module.predictor.parameters())


@pytest.mark.parametrize("method", ["predictor", "predictor-gate"])
def test_a_guess_times_its_selection_as_selection_and_its_read_as_submission(method, tmp_path, monkeypatch):
    """The next layer's predictor, evaluated for a guess, is a selection; handing the guess's read to the
    runtime (its lookup and submission) is a read submission: each goes to its own column (`select_s`,
    `submit_s`). Timed here by a clock that moves only while a guess's read is handed over."""
    model, path = relu_checkpoint("llama", tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    exact_predictors(model, threshold_logit=-0.05).save(store.path)
    patched = load(path, store.path, method, density=0.6, cache_split="size", read_ahead=True)
    guesses = clock_moving_in(monkeypatch, predictor_module, streaming_mlps(patched)[0].runtime, "guess")
    ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        patched.generate(ids, max_new_tokens=4, do_sample=False)
    streaming_mlps(patched)[0].runtime.drain()
    totals = flashlm.stats(patched).totals()
    # every decode step, every layer but the last
    assert len(guesses) == 3 * (len(streaming_mlps(patched)) - 1)
    assert (totals["submit_s"], totals["select_s"]) == (len(guesses), 0.0)
