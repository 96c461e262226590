"""Patching tiny models of every supported architecture: exactness at density 1.0 under any
budget, save/reload, patch/unpatch, the from_pretrained hook never reading MLP weights, stats."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_CONFIGS, TINY_VARIANTS
from transformers import AutoModelForCausalLM

import flashlm
from flashlm.cache import read_ahead_block
from flashlm.engine.runtime import FlashRuntime
from flashlm.errors import BudgetTooSmallError, StoreMismatchError, UnsupportedArchitectureError
from flashlm.methods import StreamingMLP
from flashlm.patching import streaming_mlps

ARCHS = sorted(TINY_CONFIGS | TINY_VARIANTS)
CACHED_FRACTIONS = [0.0, 0.3, 0.7, 1.0]
"""Budgets for tiny models, as the fraction of MLP units the cache can hold on top of the minimum
working memory (tiny models' working memory exceeds their MLP bytes, so percentages mislead)."""


def minimum_budget(store_path) -> int:
    with pytest.raises(BudgetTooSmallError) as info:
        FlashRuntime(flashlm.Store.open(store_path), flashlm.FlashConfig(memory_budget=1))
    return info.value.minimum_bytes


def budget_caching(store_path, fraction: float) -> int:
    """A budget whose caches hold about `fraction` of all units (all of them at 1.0)."""
    store = flashlm.Store.open(store_path)
    slots = sum(store.row_file(0, kind).rows for kind in store.kinds) * store.num_layers
    return minimum_budget(store_path) + int(fraction * (store.nbytes() + 8 * slots))


def load_patched(path, store, cached_fraction=0.5, **options):
    if not store.exists():
        flashlm.convert(path, store, progress=False)
    config = flashlm.FlashConfig(
        store=str(store), memory_budget=budget_caching(store, cached_fraction), **options
    )
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config)


def prompt_ids(vocab_size: int, length: int = 12) -> torch.Tensor:
    return torch.randint(3, vocab_size, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cached_fraction", CACHED_FRACTIONS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.exactness
def test_density_one_matches_dense(arch, cached_fraction, make_tiny_checkpoint, tmp_path):
    """Dense streaming is the dense model: same logits, same greedy tokens, whatever the budget."""
    path = make_tiny_checkpoint(arch, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path)
    patched = load_patched(path, tmp_path / "store", cached_fraction)
    for module in streaming_mlps(patched):
        capacities = [cache.capacity for cache in module.caches()]
        if cached_fraction == 0:
            assert capacities == [0] * len(capacities)
        if cached_fraction == 1:
            assert capacities == [cache.num_units for cache in module.caches()]
    assert len(streaming_mlps(patched)) == reference.config.get_text_config().num_hidden_layers
    ids = prompt_ids(reference.config.get_text_config().vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(ids, **kwargs), reference.generate(ids, **kwargs))
    # With room for every unit, the first step fills the caches and decoding then skips the reader.
    assert streaming_mlps(patched)[0].runtime.every_unit_resident == (cached_fraction == 1)


@pytest.mark.parametrize("cached_fraction", [0.3, 0.7])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.exactness
def test_one_sequence_decodes_as_the_dense_model(arch, cached_fraction, make_tiny_checkpoint, tmp_path):
    """One sequence decodes one token per step: the path that multiplies the cached rows before the
    layer's read lands and the read rows after it (a batch of two takes the whole-matrix path)."""
    path = make_tiny_checkpoint(arch, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path)
    patched = load_patched(path, tmp_path / "store", cached_fraction)
    caches = [cache for module in streaming_mlps(patched) for cache in module.caches()]
    assert any(0 < cache.capacity < cache.num_units for cache in caches)  # cached rows beside read ones
    ids = prompt_ids(reference.config.get_text_config().vocab_size)[:1]
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    kwargs |= {"return_dict_in_generate": True, "output_logits": True}
    flashlm.stats(patched, reset=True)
    got, want = patched.generate(ids, **kwargs), reference.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for got_logits, want_logits in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    decode_steps = flashlm.stats(patched).per_step()[1:]
    assert all(s["tokens"] == 1 and s["hits"] > 0 and s["misses"] > 0 for s in decode_steps)


@pytest.mark.parametrize("cached_fraction", CACHED_FRACTIONS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.exactness
def test_a_float32_model_over_a_bfloat16_store_is_the_float32_model(
    arch, cached_fraction, make_tiny_checkpoint, tmp_path
):
    """`from_pretrained(..., dtype=torch.float32)` of a bf16 checkpoint: its MLPs compute in float32 on the
    store's bf16 rows, as transformers' upcast weights do (they hold the same values)."""
    path = make_tiny_checkpoint(arch, dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    flashlm.convert(path, tmp_path / "store", progress=False)
    config = flashlm.FlashConfig(
        store=str(tmp_path / "store"), memory_budget=budget_caching(tmp_path / "store", cached_fraction)
    )
    patched = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config)
    assert flashlm.Store.open(tmp_path / "store").dtype == torch.bfloat16
    ids = prompt_ids(reference.config.get_text_config().vocab_size)
    with torch.no_grad():
        logits = patched(ids).logits
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(ids, **kwargs), reference.generate(ids, **kwargs))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.exactness
def test_bf16_logits_within_tolerance(arch, make_tiny_checkpoint, tmp_path):
    path = make_tiny_checkpoint(arch, dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(path)
    patched = load_patched(path, tmp_path / "store", 0.3)
    ids = prompt_ids(reference.config.get_text_config().vocab_size)
    with torch.no_grad():
        for _ in range(3):  # later steps mix cache hits with reads
            torch.testing.assert_close(patched(ids).logits, reference(ids).logits, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_reload_restores_patched_model(arch, make_tiny_checkpoint, tmp_path, monkeypatch):
    path = make_tiny_checkpoint(arch, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path)
    patched = load_patched(path, tmp_path / "store", 0.5, policy="lfu")
    patched.save_pretrained(tmp_path / "saved")

    saved_config = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved_config["quant_method"] == "flashlm"
    assert saved_config["policy"] == "lfu"
    assert saved_config["flashlm_version"] == flashlm.__version__
    assert "store" not in saved_config and "memory_budget" not in saved_config

    monkeypatch.setenv("FLASHLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(
        "FLASHLM_MEMORY_BUDGET", "10MB"
    )  # runtime options of a saved model come from the machine
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert streaming_mlps(reloaded) and reloaded.config.quantization_config.policy == "lfu"
    ids = prompt_ids(reference.config.get_text_config().vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_patch_and_unpatch_loaded_model(arch, make_tiny_checkpoint, tmp_path):
    path = make_tiny_checkpoint(arch, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ids = prompt_ids(model.config.get_text_config().vocab_size)
    with torch.no_grad():
        expected = model(ids).logits

    flashlm.convert(path, tmp_path / "store", progress=False)
    budget = budget_caching(tmp_path / "store", 0.4)
    flashlm.patch(
        model, flashlm.FlashConfig(store=str(tmp_path / "store"), memory_budget=budget), progress=False
    )
    patched = tuple(name + "." for name, module in model.named_modules() if isinstance(module, StreamingMLP))
    assert patched
    assert not [name for name, _ in model.named_parameters() if name.startswith(patched)]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)

    flashlm.unpatch(model)
    assert not streaming_mlps(model)
    restored = model.state_dict()
    assert restored.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(restored[key], value), key


def test_from_pretrained_never_reads_mlp_weights(make_tiny_checkpoint, tmp_path, materialized_keys):
    """Tensor accounting: every checkpoint tensor transformers materializes is recorded."""
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    flashlm.convert(path, tmp_path / "store", progress=False)
    AutoModelForCausalLM.from_pretrained(path)
    dense_keys = set(materialized_keys)
    assert any(".mlp." in key for key in dense_keys), "the accounting must see MLP reads of a plain load"

    materialized_keys.clear()
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=flashlm.FlashConfig(store=str(tmp_path / "store"), memory_budget="10MB")
    )
    assert materialized_keys, "the accounting must see the non-MLP reads"
    assert not [key for key in materialized_keys if ".mlp." in key]
    assert set(materialized_keys) == {key for key in dense_keys if ".mlp." not in key}
    assert not [name for name, _ in model.named_parameters() if ".mlp." in name]


def test_missing_store_is_converted_on_first_load(make_tiny_checkpoint, tmp_path):
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    store = tmp_path / "new.flash"
    load_patched(path, store)
    assert (store / "manifest.json").exists()


def test_default_store_lives_in_cache_dir(make_tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLM_CACHE", str(tmp_path / "cache"))
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(path, quantization_config=flashlm.FlashConfig(memory_budget="10MB"))
    stores = list((tmp_path / "cache" / "stores").iterdir())
    assert len(stores) == 1 and (stores[0] / "manifest.json").exists()


def test_store_of_another_checkpoint_is_refused(make_tiny_checkpoint, tmp_path):
    llama = make_tiny_checkpoint("llama", dtype=torch.float32)
    mistral = make_tiny_checkpoint("mistral", dtype=torch.float32)
    flashlm.convert(llama, tmp_path / "store", progress=False)
    with pytest.raises(StoreMismatchError, match="store"):
        load_patched(mistral, tmp_path / "store")


def test_budget_below_working_set_says_the_minimum(make_tiny_checkpoint, tmp_path):
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    flashlm.convert(path, tmp_path / "store", progress=False)
    minimum = minimum_budget(tmp_path / "store")
    for budget, fits in [(minimum - 1, False), (minimum, True)]:
        config = flashlm.FlashConfig(store=str(tmp_path / "store"), memory_budget=budget)
        if fits:
            AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
        else:
            with pytest.raises(BudgetTooSmallError, match=f"{minimum} bytes"):
                AutoModelForCausalLM.from_pretrained(path, quantization_config=config)


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    model.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="llama"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", quantization_config=flashlm.FlashConfig())
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        flashlm.patch(model)


@pytest.mark.parametrize("cached_fraction", [1.0, 0.25])
def test_stats_count_reads_hits_and_stay_in_budget(cached_fraction, make_tiny_checkpoint, tmp_path):
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    model = load_patched(path, tmp_path / "store", cached_fraction)
    layers = model.config.num_hidden_layers
    ids = prompt_ids(model.config.vocab_size)[:1]
    flashlm.stats(model, reset=True)
    model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    snapshot = flashlm.stats(model)

    assert snapshot.num_steps == 5
    assert snapshot.table.shape[0] == 5 * layers
    assert snapshot.resident_bytes <= snapshot.budget_bytes
    steps = snapshot.per_step()
    assert steps[0]["tokens"] == ids.shape[1] and all(s["tokens"] == 1 for s in steps[1:])
    store = flashlm.Store.open(tmp_path / "store")
    all_units = (2 * store.d_ff + store.d_model) * layers  # neurons of gate and up, rows of down
    assert all(s["hits"] + s["misses"] == all_units for s in steps)
    runtime = streaming_mlps(model)[0].runtime
    pinned = sum(cache.pinned * cache.row_bytes for cache in runtime.caches.values())  # read at load
    assert pinned < store.nbytes() and steps[0]["bytes_read"] + pinned >= store.nbytes()  # every unit once
    if cached_fraction == 1:
        assert all(s["bytes_read"] == 0 and s["misses"] == 0 and s["submit_s"] == 0 for s in steps[1:])
    else:  # the read submission is timed, and counted in the cache's bookkeeping
        assert all(s["bytes_read"] > 0 and s["hits"] > 0 and s["submit_s"] > 0 for s in steps[1:])
        assert all(s["cache_s"] >= s["submit_s"] for s in steps)
    assert all(s["io_s"] >= 0 and s["compute_s"] > 0 for s in steps)

    flashlm.stats(model, reset=True)
    assert flashlm.stats(model).table.shape[0] == 0


def test_streaming_module_has_no_parameters(make_tiny_checkpoint, tmp_path):
    path = make_tiny_checkpoint("opt", dtype=torch.float32)
    model = load_patched(path, tmp_path / "store")
    for module in streaming_mlps(model):
        assert isinstance(module, StreamingMLP)
        assert not list(module.parameters())
        assert not module.state_dict()


@pytest.mark.parametrize(
    "options", [{"method": "dense"}, {"method": "dip", "density": 0.5, "cache_aware": 1.0}]
)
def test_from_pretrained_allocates_the_cache_slots_once(options, make_tiny_checkpoint, tmp_path, monkeypatch):
    """transformers' loader replaces every non-persistent buffer after loading, so caches built for the
    model on the meta device get their slots there (no memory); the loader's buffers are then emptied,
    zeroed, given the block a kind read ahead whole pins, and used. `patch`, on a model in memory,
    builds its slots on the CPU at once."""
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    built: list[torch.device] = []
    make_cache = FlashRuntime.make_cache

    def recording(runtime, layer, kind):
        cache = make_cache(runtime, layer, kind)
        built.append(cache.rows.device)
        return cache

    monkeypatch.setattr(FlashRuntime, "make_cache", recording)
    model = load_patched(path, tmp_path / "store", **options)
    assert built and all(device.type == "meta" for device in built)
    runtime = streaming_mlps(model)[0].runtime
    for (_, kind), cache in runtime.caches.items():
        assert cache.rows.device.type == "cpu" and cache.rows.shape == (cache.capacity, cache.width)
        # empty but for the block a kind read ahead whole pins
        block = read_ahead_block(cache.capacity, cache.num_units) if kind in runtime.read_ahead else None
        pinned = 0 if block is None else block.numel()
        assert cache.size == cache.pinned == pinned and not cache.rows[pinned:].any()
        assert (cache.slot_of >= 0).sum() == pinned and torch.equal(cache.resident_ids, torch.arange(pinned))

    built.clear()
    flashlm.patch(AutoModelForCausalLM.from_pretrained(path), model.config.quantization_config)
    assert built and all(device.type == "cpu" for device in built)


def test_layers_called_out_of_order_stay_exact(make_tiny_checkpoint, tmp_path):
    """A prefetch made for the next layer is discarded, not misused, when another layer runs."""
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path)
    patched = load_patched(path, tmp_path / "store", 0.3)
    x = torch.randn(1, 3, reference.config.hidden_size)
    streaming = streaming_mlps(patched)
    with torch.no_grad():
        for layer in [1, 0, 0, 1, 1, 0]:
            torch.testing.assert_close(streaming[layer](x), reference.model.layers[layer].mlp(x))


@pytest.mark.exactness
def test_without_read_ahead_each_layer_reads_when_it_runs(make_tiny_checkpoint, tmp_path):
    """`read_ahead=False`: no read is left pending between layers, and the tokens are the dense model's."""
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path)
    patched = load_patched(path, tmp_path / "store", 0.3, read_ahead=False)
    runtime = streaming_mlps(patched)[0].runtime
    assert runtime.read_ahead == ()
    ids = prompt_ids(reference.config.vocab_size)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(ids, **kwargs), reference.generate(ids, **kwargs))
    assert runtime._pending is None
    steps = flashlm.stats(patched).per_step()
    assert all(s["bytes_read"] > 0 for s in steps)


def test_sampling_matches_dense_under_the_same_seed(make_tiny_checkpoint, tmp_path):
    path = make_tiny_checkpoint("qwen2", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path)
    patched = load_patched(path, tmp_path / "store", 0.5)
    ids = prompt_ids(reference.config.vocab_size)
    kwargs = {"max_new_tokens": 10, "do_sample": True, "top_k": 20, "temperature": 0.9, "pad_token_id": 0}
    torch.manual_seed(7)
    expected = reference.generate(ids, **kwargs)
    torch.manual_seed(7)
    assert torch.equal(patched.generate(ids, **kwargs), expected)
