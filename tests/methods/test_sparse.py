"""The DIP paper's sparse MLPs: selection functions against their equations, each method's module
against a per-token reimplementation, density 1.0 against dense, achieved density, cache-aware
masking's hit rate, sequential prefill against decoding, generation, and bad configs."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_model, clock_moving_in, needs_native_reader, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import flashlm
import flashlm.engine.runtime as runtime_module
import flashlm.methods.sparse as sparse_module
from flashlm.cache import NeuronCache
from flashlm.engine.io_thread import IOThread
from flashlm.errors import BudgetTooSmallError, ConfigError
from flashlm.methods import CATSMLP, DIPMLP, SparseMLP, StreamingMLP, reads_ahead
from flashlm.methods.calibration import Calibration
from flashlm.methods.masking import (
    cache_aware_scores,
    kept_pairs,
    threshold_for_density,
    threshold_mask,
    topk_mask,
    union_ids,
)
from flashlm.methods.mlp import module_class
from flashlm.ops import select
from flashlm.ops.columns import TokenColumns
from flashlm.ops.select import TopUnits
from flashlm.patching import streaming_mlps
from flashlm.store import add_kinds
from flashlm.store.format import dense_kinds

SPARSE_METHODS = ["dip", "glu", "gate", "up", "cats"]

# ---- selection functions against their equations ---------------------------------------------


def test_topk_mask_keeps_the_k_largest_of_each_row() -> None:
    scores = torch.randn(5, 17, generator=torch.Generator().manual_seed(0))
    mask = topk_mask(scores, 6)
    for row, kept in zip(scores, mask, strict=True):
        expected = set(sorted(range(17), key=lambda i: -row[i].item())[:6])
        assert set(kept.nonzero().squeeze(1).tolist()) == expected
    assert not topk_mask(scores, 0).any() and topk_mask(scores, 17).all()
    with pytest.raises(ValueError):
        topk_mask(scores, 18)


def test_cache_aware_scores_is_equation_10() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 11, generator=g)
    resident = torch.rand(11, generator=g) > 0.5
    gamma = 0.2
    scores = cache_aware_scores(x, resident, gamma)
    for t in range(3):
        norm = max(abs(v) for v in x[t].tolist())
        for i in range(11):
            c = 1.0 if resident[i] else 0.0
            assert scores[t, i].item() == pytest.approx(abs(x[t, i].item()) * (c + gamma * (1 - c)) / norm)
    # gamma = 1 ranks by magnitude alone (plain DIP)
    assert torch.equal(topk_mask(cache_aware_scores(x, resident, 1.0), 4), topk_mask(x.abs(), 4))


def test_threshold_helpers() -> None:
    values = torch.randn(4000, generator=torch.Generator().manual_seed(2))
    assert torch.equal(threshold_mask(values, 0.5), values.abs() > 0.5)
    levels = torch.linspace(0, 1, 201, dtype=torch.float64)
    quantiles = torch.quantile(values.abs().double(), levels)
    for keep in (0.1, 0.5, 0.9):
        t = threshold_for_density(quantiles, keep)
        assert t == pytest.approx(torch.quantile(values.abs().double(), 1 - keep).item(), rel=1e-2, abs=1e-3)
        assert (values.abs() > t).float().mean().item() == pytest.approx(keep, abs=0.01)
    mask = torch.tensor([[True, False, False], [False, False, True]])
    assert union_ids(mask).tolist() == [0, 2]


def test_union_ids_and_kept_pairs_for_one_token_and_many() -> None:
    mask = torch.tensor([[True, False, False, True], [False, False, True, True]])
    assert union_ids(mask).tolist() == [0, 2, 3]
    assert kept_pairs(mask, union_ids(mask)) == kept_pairs(mask) == 4  # unit 3: once per token keeping it
    one = mask[1:]
    assert union_ids(one).tolist() == [2, 3] and kept_pairs(one, union_ids(one)) == kept_pairs(one) == 2
    strided = mask.t()[3:]  # one token whose mask is not contiguous: [[True, True]]
    assert not strided.is_contiguous()
    assert union_ids(strided).tolist() == [0, 1] and kept_pairs(strided, union_ids(strided)) == 2


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(2, 40),
    k_frac=st.floats(0.05, 1.0),
    gamma=st.floats(0.0, 1.0),
)
def test_cache_aware_selection_never_picks_fewer_residents(seed, n, k_frac, gamma) -> None:
    """Re-weighting only lowers non-resident scores, so a cache-aware top-k contains at least as many
    resident units as the plain top-k for the same cache state: hits per step can only rise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, generator=g)
    resident = torch.rand(n, generator=g) > 0.5
    k = max(1, int(k_frac * n))
    aware = topk_mask(cache_aware_scores(x, resident, gamma), k)[0]
    plain = topk_mask(x.abs(), k)[0]
    assert int((aware & resident).sum()) >= int((plain & resident).sum())


# ---- each method's module against a per-token reimplementation -------------------------------


def reference_mlp(module: SparseMLP, weights, x, resident_in, resident_out) -> torch.Tensor:
    """The method's equations, one token at a time, on the dense weights (gate, up: [d_ff, d], down)."""
    gate, up, down = weights
    act = module.act
    outs = []

    def keep_top(scores: torch.Tensor, k: int) -> torch.Tensor:
        return topk_mask(scores[None], k)[0]  # ties to the lowest unit id, as the modules keep them

    for token in x:
        if isinstance(module, DIPMLP) and module.method == "dip":
            if module.input_threshold is not None:
                keep_in = token.abs() > module.input_threshold
            else:
                c = resident_in.float()
                # a kind read ahead whole is read whatever the mask: its selection ignores the cache
                gamma_in = 1.0 if module.INPUT_KIND in module.runtime.read_ahead else module.gamma
                scores = token.abs() * (c + gamma_in * (1 - c)) / token.abs().max()
                keep_in = keep_top(scores, module.k_in)
            xt = token * keep_in
            h = (up @ xt) * act(gate @ xt)
            c = resident_out.float()
            scores = h.abs() * (c + module.gamma * (1 - c)) / h.abs().max()
            keep = keep_top(scores, module.k_out)
        elif module.method == "glu":
            h = (up @ token) * act(gate @ token)
            keep = keep_top(h.abs(), module.k_out)
        elif module.method == "up":
            u = up @ token
            keep = keep_top(u.abs(), module.k_out)
            h = u * act(gate @ token)
        else:  # gate, cats
            g = act(gate @ token)
            if isinstance(module, CATSMLP):
                keep = g.abs() > module.threshold
            else:
                keep = keep_top(g.abs(), module.k_out)
            h = g * (up @ token)
        outs.append(down @ (h * keep))
    return torch.stack(outs)


def fake_calibration(store, d_model: int, d_ff: int, layers: int) -> None:
    """Quantiles from standard-normal magnitudes: enough to give CATS and the thresholds real values."""
    levels = torch.linspace(0, 1, 201, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    gate_q = torch.quantile(F.silu(torch.randn(20000, generator=g)).abs().double(), levels).tolist()
    input_q = torch.quantile(torch.randn(20000, generator=g).abs().double(), levels).tolist()
    Calibration(
        content_sha256=store.content_sha256,
        corpus="synthetic",
        tokens=0,
        input_quantiles=[input_q] * layers,
        global_input_quantiles=input_q,
        gate_quantiles=[gate_q] * layers,
    ).save(store.path)


@pytest.fixture
def tiny_llama(make_tiny_checkpoint, tmp_path):
    """(checkpoint dir, fp32 dense model, store path) for the tiny llama, with a synthetic calibration."""
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    config = AutoModelForCausalLM.from_pretrained(path).config
    fake_calibration(store, config.hidden_size, config.intermediate_size, config.num_hidden_layers)
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), store.path


@pytest.fixture
def four_layer_llama(tmp_path):
    """(checkpoint dir, store path) of the tiny llama with four layers, enough for a layer's queued cache
    update to still be waiting while the layers after it read into the staging buffers it copies from."""
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    path = tmp_path / "four-layers"
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)
    store = flashlm.convert(path, tmp_path / "four-layers-store", progress=False)
    fake_calibration(store, config.hidden_size, config.intermediate_size, config.num_hidden_layers)
    return path, store.path


def load(path, store, cached: float = 0.5, **options) -> torch.nn.Module:
    """The checkpoint patched with `options`, its caches holding about `cached` of the units' bytes
    beyond the working memory (tiny models' working memory dwarfs their weights, so % budgets mislead)."""
    if not Path(store).exists():
        flashlm.convert(path, store, progress=False)
    probe = flashlm.FlashConfig(memory_budget=1, **options)
    cls = module_class(probe)
    opened = flashlm.Store.open(store)
    kinds = dense_kinds(opened.gated) if cls is StreamingMLP else cls.KINDS
    if cls is not StreamingMLP:
        opened = add_kinds(opened, kinds, progress=False)
    with pytest.raises(BudgetTooSmallError) as info:  # the runtime as the method builds it
        cls.make_runtime(opened, probe, cls.load_fitted(opened, device=torch.device("cpu")))
    units = sum(opened.row_file(0, k).rows * (opened.row_file(0, k).row_bytes + 8) for k in kinds)
    budget = info.value.minimum_bytes + int(cached * units * opened.num_layers)
    config = flashlm.FlashConfig(store=str(store), memory_budget=budget, **options)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config).eval()


def dense_weights(model, layer: int):
    mlp = model.model.layers[layer].mlp
    return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


@pytest.mark.parametrize(
    "options",
    [
        {"method": "dip", "density": 0.5},
        {"method": "dip", "density": 0.6, "input_density": 0.5},
        {"method": "dip", "density": 0.5, "cache_aware": 0.2},
        {"method": "dip", "density": 0.5, "cache_aware": 0.0},
        {"method": "dip", "density": 0.5, "cache_aware": 0.2, "read_ahead": False},
        {"method": "dip", "density": 0.5, "threshold": "layer"},
        {"method": "dip", "density": 0.5, "threshold": "global"},
        {"method": "glu", "density": 0.5},
        {"method": "gate", "density": 0.6},
        {"method": "up", "density": 0.5},
        {"method": "cats", "density": 0.5},
    ],
    ids=lambda o: "-".join(f"{v}" for v in o.values()),
)
@pytest.mark.exactness
def test_module_matches_its_equations(options, tiny_llama) -> None:
    path, dense, store = tiny_llama
    model = load(path, store, **options)
    module = streaming_mlps(model)[0]
    weights = dense_weights(dense, 0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for tokens in (1, 1, 4, 1):  # decode steps, then a batch of tokens, then decode again
            x = torch.randn(tokens, module.d_model, generator=g)
            module.runtime.drain()  # the last step's cache updates run on the I/O thread
            resident_in = module.input_cache.slot_of >= 0
            resident_out = module.output_cache.slot_of >= 0
            expected = reference_mlp(module, weights, x, resident_in.clone(), resident_out.clone())
            torch.testing.assert_close(module(x[None])[0], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "options", [{"method": "dip"}, {"method": "dip", "cache_aware": 0.2}, {"method": "glu"}]
)
@pytest.mark.exactness
def test_density_one_is_the_dense_model(options, tiny_llama) -> None:
    path, dense, store = tiny_llama
    model = load(path, store, density=1.0, **options)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **kwargs), dense.generate(ids, **kwargs))


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"method": "dip", "density": 0.5, "input_density": 0.5}, 0.5),
        ({"method": "dip", "density": 0.4, "input_density": 0.3}, 0.4),
        ({"method": "gate", "density": 0.5}, 0.5),
        ({"method": "up", "density": 0.6}, 0.6),
        ({"method": "glu", "density": 0.5}, 2 / 3 + 0.5 / 3),  # the oracle reads all of up and gate
    ],
)
def test_achieved_density_equals_target(options, expected, tiny_llama) -> None:
    path, _, store = tiny_llama
    model = load(path, store, **options)
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(5))
    model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    stats = flashlm.stats(model)
    # unit counts are rounded: 64 inputs, 96 intermediate units in the tiny llama
    assert stats.density() == pytest.approx(expected, abs=1.5 / 64)
    assert stats.density(decode_only=True) == pytest.approx(expected, abs=1.5 / 64)


def test_cats_density_follows_its_calibrated_threshold(tiny_llama) -> None:
    path, _, store = tiny_llama
    model = load(path, store, method="cats", density=0.6)
    module = streaming_mlps(model)[0]
    # the synthetic calibration is SiLU of a standard normal: the threshold keeps ρ = 0.4 of it
    samples = F.silu(torch.randn(200_000, generator=torch.Generator().manual_seed(9))).abs()
    assert (samples > module.threshold).float().mean().item() == pytest.approx(0.4, abs=0.02)


def test_sequential_prefill_equals_decoding_token_by_token(tiny_llama) -> None:
    """With `sequential_prefill`, a T-token forward is T decode steps: same logits, same cache state."""
    path, _, store = tiny_llama
    options = {"method": "dip", "density": 0.5, "cache_aware": 0.2, "cached": 0.4}
    batched = load(path, store, sequential_prefill=True, **options)
    stepped = load(path, store, **options)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = batched(ids).logits[0]
        past, step_logits = None, []
        for t in range(ids.shape[1]):
            out = stepped(ids[:, t : t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            step_logits.append(out.logits[0, -1])
    torch.testing.assert_close(logits, torch.stack(step_logits), rtol=1e-4, atol=1e-5)
    streaming_mlps(stepped)[0].runtime.drain()  # the last step's cache updates run on the I/O thread
    for a, b in zip(streaming_mlps(batched), streaming_mlps(stepped), strict=True):
        for cache_a, cache_b in zip(a.caches(), b.caches(), strict=True):
            assert torch.equal(cache_a.slot_of >= 0, cache_b.slot_of >= 0)
            assert (cache_a.hits, cache_a.misses) == (cache_b.hits, cache_b.misses)
    used = [flashlm.stats(model).totals()["used_bytes"] for model in (batched, stepped)]
    assert used[0] == used[1] > 0


def test_cache_aware_masking_raises_the_hit_rate(tiny_llama) -> None:
    path, _, store = tiny_llama
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(7))
    hit_rates = {}
    for gamma in (1.0, 0.2):
        model = load(path, store, cached=0.35, method="dip", density=0.5, cache_aware=gamma)
        model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
        hit_rates[gamma] = flashlm.stats(model).totals(decode_only=True)["hit_rate"]
    assert hit_rates[0.2] > hit_rates[1.0]


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_generate_greedy_and_sampling(method, tiny_llama) -> None:
    path, _, store = tiny_llama
    model = load(path, store, method=method, density=0.6)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(8))
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert greedy.shape == (2, 13)
    torch.manual_seed(0)
    first = model.generate(ids, max_new_tokens=6, do_sample=True, pad_token_id=0)
    torch.manual_seed(0)
    again = model.generate(ids, max_new_tokens=6, do_sample=True, pad_token_id=0)
    assert torch.equal(first, again)


def test_policies_and_no_cache(tiny_llama) -> None:
    path, _, store = tiny_llama
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(10))
    for policy in ("lfu", "lru", "window", "none"):
        model = load(path, store, method="dip", density=0.5, cache_aware=0.2, policy=policy)
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        totals = flashlm.stats(model).totals(decode_only=True)
        if policy == "none":
            assert all(c.capacity == 0 for m in streaming_mlps(model) for c in m.caches())
            assert totals["hits"] == 0
        else:
            assert totals["hits"] > 0


@pytest.mark.parametrize("split", ["read-cost", "size"])
def test_cache_split_between_kinds(split, tiny_llama) -> None:
    """read-cost fills the kind whose misses cost the disk most per byte (the tiny model's 256-byte down
    columns: a 4 KiB page per miss) before the other gets a slot; size gives each the same fraction."""
    path, _, store = tiny_llama
    model = load(path, store, cached=0.4, method="dip", density=0.5, cache_split=split)
    for module in streaming_mlps(model):
        cost = {
            kind: module.runtime.store.row_file(module.layer, kind).read_amplification
            for kind in (module.INPUT_KIND, module.OUTPUT_KIND)
        }
        assert cost["dip_down"] > cost["dip_in"]
        down, inputs = module.output_cache, module.input_cache
        if split == "read-cost":
            assert down.capacity == down.num_units and 0 < inputs.capacity < inputs.num_units
        else:
            assert down.capacity / down.num_units == pytest.approx(
                inputs.capacity / inputs.num_units, abs=0.05
            )
    runtime = streaming_mlps(model)[0].runtime
    assert runtime.plan.total_bytes <= runtime.budget_bytes


@pytest.mark.exactness
@pytest.mark.parametrize(("cached", "read_cost_splits"), [(0.2, 2), (0.5, 2), (0.8, 1)])
def test_dense_streaming_fills_one_kind_after_another(cached, read_cost_splits, tiny_llama) -> None:
    """Dense streaming's default split ("in-order") fills gate, then up, then down, each kind one layer
    after another, so that at most one cache of the model is split between cache and staging;
    "read-cost", asked for, fills gate and up alike first (the tiny model's down rows cost least per
    byte), so at the two smaller budgets both are split in every layer. Both hold the same bytes and
    decode the same tokens as the dense model."""
    path, _, store = tiny_llama
    row_file = flashlm.Store.open(store).row_file
    costs = {kind: row_file(0, kind).read_amplification for kind in ("gate", "up", "down")}
    assert costs["down"] < costs["gate"] == costs["up"]
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(11))
    dense = AutoModelForCausalLM.from_pretrained(path).eval()
    expected = dense.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    split_kinds, split_caches, cached_bytes = {}, {}, {}
    for split in ("in-order", "read-cost"):
        model = load(path, store, cached=cached, cache_split=None if split == "in-order" else split)
        split_kinds[split] = split_caches[split] = 0
        for module in streaming_mlps(model):
            fractions = [cache.capacity / cache.num_units for _, cache in module._kind_caches]
            split_kinds[split] = max(split_kinds[split], sum(0 < f < 1 for f in fractions))
            split_caches[split] += sum(0 < f < 1 for f in fractions)
            if split == "in-order":
                assert fractions == sorted(fractions, reverse=True)
        cached_bytes[split] = streaming_mlps(model)[0].runtime.plan.cache_bytes
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), expected)
    assert split_kinds == {"in-order": 1, "read-cost": read_cost_splits}
    assert split_caches["in-order"] == 1 and split_caches["read-cost"] == 2 * read_cost_splits
    assert cached_bytes["in-order"] == pytest.approx(cached_bytes["read-cost"], rel=0.02)


def test_float32_slots_hold_converted_rows_within_the_budget(make_tiny_checkpoint, tmp_path, monkeypatch):
    """Where fp32 rows multiply faster (`slot_dtype`'s measurement), DIP's caches hold rows converted on
    admission: same selections and outputs up to bf16 rounding, half the units for the same bytes."""
    path = make_tiny_checkpoint("llama", dtype=torch.bfloat16)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(13))
    options = {"method": "dip", "density": 0.5, "input_density": 0.5, "store": str(tmp_path / "store")}
    with pytest.raises(BudgetTooSmallError) as info:
        AutoModelForCausalLM.from_pretrained(
            path, quantization_config=flashlm.FlashConfig(memory_budget=1, **options)
        )
    budget = info.value.minimum_bytes + 40_000  # about half of both caches' bf16 rows
    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(sparse_module, "slot_dtype", lambda store_dtype, width, dtype=dtype: dtype)
        config = flashlm.FlashConfig(memory_budget=budget, **options)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
        with torch.no_grad():
            runs[dtype] = model.generate(
                ids,
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
        module = streaming_mlps(model)[0]
        assert module.input_cache.rows.dtype == module.output_cache.rows.dtype == dtype
        snapshot = flashlm.stats(model)
        assert snapshot.resident_bytes <= snapshot.budget_bytes
        runs[dtype].capacity = module.input_cache.capacity
    assert runs[torch.float32].capacity < runs[torch.bfloat16].capacity
    for a, b in zip(runs[torch.bfloat16].logits, runs[torch.float32].logits, strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("options", [{"cache_aware": 1.0}, {"cache_aware": 0.2}])
def test_read_ahead_pins_a_block_and_reads_every_unit_outside_it(options, tiny_llama) -> None:
    """Read ahead, each input cache pins the block of its first units (`read_ahead_block`) and never
    changes, and every token reads every other input unit of every layer, needed or not (the unneeded
    rows join the product with zero coefficients). Where the selection ignores the cache (plain DIP)
    that changes nothing else: the tokens and, up to rounding, the logits are those of reading on
    demand, from the same units. (`load` sizes both budgets to the same cache bytes: reading ahead
    needs a second staging buffer.)"""
    path, _, store = tiny_llama
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(12))
    runs = {}
    for read_ahead in (False, True):
        model = load(path, store, method="dip", density=0.6, read_ahead=read_ahead, **options)
        modules = streaming_mlps(model)
        assert modules[0].runtime.read_ahead == (("dip_in",) if read_ahead else ())
        with torch.no_grad():
            logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        runs[read_ahead] = (logits, tokens, flashlm.stats(model).totals(decode_only=True))
    (logits, tokens, totals), (logits_ahead, tokens_ahead, totals_ahead) = runs[False], runs[True]
    block_bytes = 0
    for module in modules:
        cache = module.input_cache
        assert 0 < cache.pinned == cache.size == cache.capacity < cache.num_units
        assert torch.equal(cache.resident_ids, torch.arange(cache.capacity))
        block_bytes += (cache.num_units - cache.capacity) * cache.row_bytes
    assert totals_ahead["bytes_read"] >= totals_ahead["steps"] * block_bytes > 0
    assert totals["misses"] > 0 and totals["bytes_read"] > 0
    if options["cache_aware"] == 1.0:
        torch.testing.assert_close(logits, logits_ahead)
        assert torch.equal(tokens, tokens_ahead)
        assert totals["hits"] + totals["misses"] == totals_ahead["hits"] + totals_ahead["misses"]


def test_cache_aware_selection_leaves_a_kind_read_ahead_whole_alone(tiny_llama) -> None:
    """DIP-CA weighs residency only where it saves reads: the input units of a kind read ahead whole are
    read whatever the mask, so layer 0 (whose input the same tokens fix) selects them as plain DIP does
    at every step. Read on demand, the same weight changes that selection once the cache holds units."""
    from flashlm.patching import trace

    path, _, store = tiny_llama
    tokens = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(16))

    def layer0_inputs(**options) -> list[list[int]]:
        model = load(path, store, cached=0.4, method="dip", density=0.5, record_trace=True, **options)
        past = None
        with torch.no_grad():
            for token in tokens:
                past = model(token.view(1, 1), past_key_values=past, use_cache=True).past_key_values
        return [ids.tolist() for ids in trace(model).requests(0, "dip_in")]

    assert layer0_inputs(cache_aware=0.2) == layer0_inputs(cache_aware=1.0)
    on_demand = layer0_inputs(cache_aware=0.2, read_ahead=False)
    assert on_demand != layer0_inputs(cache_aware=1.0, read_ahead=False)


@pytest.mark.parametrize("options", [{"cache_aware": 1.0}, {"cache_aware": 0.2}])
def test_caches_that_hold_every_unit_read_each_unit_once(options, tiny_llama) -> None:
    """Where every cache of a kind holds every unit, that kind is not read ahead whole: each unit is read
    when first selected and kept. Read ahead, the units no token selected were read again at every
    token. Short of that, reading ahead stays as asked."""
    path, _, store = tiny_llama
    options = {"method": "dip", "density": 0.6, "read_ahead": True, **options}
    assert streaming_mlps(load(path, store, cached=0.35, **options))[0].runtime.read_ahead == ("dip_in",)
    model = load(path, store, cached=2.0, **options)
    modules = streaming_mlps(model)
    assert modules[0].runtime.read_ahead == () and not any(module.guesses_ahead for module in modules)
    # a one-token prompt: a prefill of many tokens would read and keep about every unit
    model.generate(torch.tensor([[17]]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    modules[0].runtime.drain()
    stats = flashlm.stats(model)
    caches = [cache for module in modules for cache in module.caches()]
    assert all(cache.capacity >= cache.num_units for cache in caches) and stats.totals()["evictions"] == 0
    assert stats.totals()["misses"] == sum(cache.size for cache in caches) > 0  # every unit read was kept
    steps = stats.per_step()
    assert all((step["bytes_read"] > 0) == (step["misses"] > 0) for step in steps)
    assert sum(step["misses"] == 0 for step in steps) >= 3  # steps that read nothing (all 100 KB before)


def test_a_guess_times_its_selection_as_selection_and_its_read_as_submission(tiny_llama, monkeypatch) -> None:
    """DIP-CA's guess of the next layer's units is a selection, and handing its read to the runtime a read
    submission: each goes to its own column (`select_s`, `submit_s`). Timed here by a clock that moves
    only while a guess's read is handed over."""
    path, _, store = tiny_llama
    monkeypatch.setattr(sparse_module, "reads_ahead", lambda config, *_: False)
    model = load(path, store, method="dip", density=0.6, cache_aware=0.2)
    runtime = streaming_mlps(model)[0].runtime
    assert all(module.guesses_ahead for module in streaming_mlps(model))
    guesses = clock_moving_in(monkeypatch, sparse_module, runtime, "guess_uncached")
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(17))
    model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    runtime.drain()
    totals = flashlm.stats(model).totals()
    # every decode step, every layer but the last
    assert len(guesses) == 3 * (len(streaming_mlps(model)) - 1)
    assert (totals["submit_s"], totals["select_s"]) == (len(guesses), 0.0)


@pytest.mark.parametrize("gamma", [1.0, 0.2])
def test_guessed_reads_are_counted_and_change_plain_dip_not_at_all(gamma, tiny_llama, monkeypatch) -> None:
    """Where DIP-CA does not read every input ahead, a decode step reads ahead the inputs the next layer
    would select for this layer's input; plain DIP does not unless asked (`guesses_ahead`). Plain DIP's
    selection ignores the cache, so the guess changes nothing but the reads; DIP-CA counts guessed
    units as resident, so its selection may differ. Either way every byte the reader read is in the
    stats, and no guess is left in flight."""
    path, _, store = tiny_llama
    monkeypatch.setattr(sparse_module, "reads_ahead", lambda config, *_: bool(config.read_ahead))
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(13))
    runs = {}
    for read_ahead in (False, None):
        model = load(path, store, method="dip", density=0.6, cache_aware=gamma, read_ahead=read_ahead)
        modules = streaming_mlps(model)
        runtime = modules[0].runtime
        assert runtime.read_ahead == () and modules[0].guesses_ahead == (read_ahead is None and gamma < 1)
        for module in modules:  # asked, plain DIP guesses too
            module.guesses_ahead = read_ahead is None
        guesses = []
        monkeypatch.setattr(
            runtime,
            "guess_uncached",
            lambda *args, g=runtime.guess_uncached, seen=guesses, **kwargs: (
                seen.append(args),
                g(*args, **kwargs),
            ),
        )
        with torch.no_grad():
            logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        runtime.drain()
        assert runtime._guess is None
        assert flashlm.stats(model).totals()["bytes_read"] == runtime.reader.bytes_read > 0
        runs[read_ahead] = (logits, tokens, flashlm.stats(model).totals(decode_only=True), len(guesses))
    (logits, tokens, totals, _), (logits_g, tokens_g, totals_g, guessed) = runs[False], runs[None]
    layers = len(streaming_mlps(model))
    assert guessed == 5 * (layers - 1)  # every decode step, every layer but the last, and no prefill
    torch.testing.assert_close(logits, logits_g)
    if gamma == 1.0:
        assert torch.equal(tokens, tokens_g)
        assert (totals["hits"], totals["misses"]) == (totals_g["hits"], totals_g["misses"])


@pytest.mark.parametrize(
    ("options", "guesses"),
    [
        # read on demand: read ahead whole, the input caches would pin a block and never update
        ({"method": "dip", "density": 0.6, "cache_aware": 0.2, "read_ahead": False}, False),
        ({"method": "dip", "density": 0.6, "cache_aware": 0.2}, True),
        ({"method": "up", "density": 0.6}, False),
    ],
    ids=["dip-ca", "dip-ca-guess", "up"],
)
def test_cache_updates_run_at_once_or_on_the_io_thread_alike(
    options, guesses, four_layer_llama, monkeypatch
) -> None:
    """A layer's cache updates run on the decode thread when they copy less than
    `QUEUED_UPDATE_MIN_BYTES`, else on the I/O thread: where they run changes nothing the model computes,
    reads, keeps or counts. Queued ones run late here (after a sleep), when the layers after theirs have
    selected their units in the buffers the layers take in turn (`TopUnits`), guessed the next layer's
    units (`guesses`: DIP-CA's layer-ahead read, whose ids the guessed layer's misses extend in place),
    and read (or would have read, but for the queue) into the staging buffers the layers share."""
    path, store = four_layer_llama
    if guesses:
        monkeypatch.setattr(sparse_module, "reads_ahead", lambda config, *_: False)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(14))
    update = NeuronCache.update
    runs = {}
    for threshold in (0, 1 << 62):
        monkeypatch.setattr(runtime_module, "QUEUED_UPDATE_MIN_BYTES", threshold)
        threads = set()

        def recording(cache, *args, seen=threads, **kwargs):
            seen.add(threading.current_thread())
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.005)
            return update(cache, *args, **kwargs)

        monkeypatch.setattr(NeuronCache, "update", recording)
        model = load(path, store, cached=0.35, **options)
        with torch.no_grad():
            logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        modules = streaming_mlps(model)
        assert all(module.guesses_ahead == guesses for module in modules)
        modules[0].runtime.drain()
        totals = flashlm.stats(model).totals()
        caches = [cache for module in modules for cache in module.caches()]
        residents = [
            (cache.slot_of >= 0, cache.rows[: cache.size].clone(), cache.hits, cache.misses, cache.evictions)
            for cache in caches
        ]
        runs[threshold] = (logits, tokens, totals, residents, threads)
    (
        (logits, tokens, totals, residents, queued_on),
        (logits_now, tokens_now, totals_now, residents_now, run_on),
    ) = (
        runs[0],
        runs[1 << 62],
    )
    assert run_on == {threading.main_thread()}
    assert queued_on and threading.main_thread() not in queued_on
    assert torch.equal(logits, logits_now) and torch.equal(tokens, tokens_now)
    for name in ("hits", "misses", "evictions", "bytes_read"):
        assert totals[name] == totals_now[name]
    assert sum(evictions for *_, evictions in residents) > 0
    for (resident, rows, *counts), (resident_now, rows_now, *counts_now) in zip(
        residents, residents_now, strict=True
    ):
        assert torch.equal(resident, resident_now) and counts == counts_now
        assert torch.equal(rows, rows_now)  # the rows a queued update copied are the ones its layer read


@needs_native_reader
@pytest.mark.parametrize(
    "options",
    [{}, {"method": "dip", "density": 0.6, "cache_aware": 0.2}, {"method": "up", "density": 0.6}],
    ids=["dense", "dip-ca", "up"],
)
def test_reads_go_to_the_c_pool_and_read_what_the_io_thread_reads(options, tiny_llama, monkeypatch) -> None:
    """With no cache update queued, the decode thread hands every read to the reader's C pool itself: no
    task reaches the I/O thread. Which of the two reads changes nothing the model computes, reads or
    counts (the I/O thread reads where the pool is turned off here, as where no compiler is found)."""
    path, _, store = tiny_llama
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(15))
    runs = {}
    for pool in (True, False):
        if not pool:
            monkeypatch.setattr(runtime_module.FlashRuntime, "_submit_to_pool", lambda *args, **kwargs: None)
        io_tasks = count_calls(monkeypatch, IOThread, "submit")
        model = load(path, store, cached=0.35, **options)
        with torch.no_grad():
            logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        totals = flashlm.stats(model).totals()
        runs[pool] = (logits, tokens, totals, io_tasks["calls"])
    (logits, tokens, totals, pool_tasks), (logits_io, tokens_io, totals_io, io_thread_tasks) = (
        runs[True],
        runs[False],
    )
    assert pool_tasks == 0 and io_thread_tasks > 0
    assert totals["bytes_read"] > 0
    assert torch.equal(logits, logits_io) and torch.equal(tokens, tokens_io)
    for name in ("hits", "misses", "evictions", "bytes_read", "reads"):
        assert totals[name] == totals_io[name]


def count_calls(monkeypatch, cls, name: str) -> dict[str, int]:
    """Count the calls of method `name` of `cls`, which still run, in the returned dict's `"calls"`."""
    calls = {"calls": 0}
    method = getattr(cls, name)

    def counting(self, *args, **kwargs):
        calls["calls"] += 1
        return method(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counting)
    return calls


def greedy_run(model, ids: torch.Tensor):
    """Eight greedy tokens after `ids` with their logits, then the totals of the stats and every cache's
    (slots, hits, misses)."""
    out = model.generate(
        ids,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    modules = streaming_mlps(model)
    modules[0].runtime.drain()
    caches = [cache for module in modules for cache in module.caches()]
    return out, flashlm.stats(model).totals(), [(c.slot_ids.clone(), c.hits, c.misses) for c in caches]


def assert_same_runs(run, other) -> None:
    """Two `greedy_run`s computed, read, kept and counted the same: tokens, logits, totals, caches."""
    (out, totals, caches), (other_out, other_totals, other_caches) = run, other
    assert torch.equal(out.sequences, other_out.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, other_out.logits, strict=True))
    for name in ("hits", "misses", "evictions", "bytes_read", "used_bytes"):
        assert totals[name] == other_totals[name]
    for (slots, *counts), (other_slots, *other_counts) in zip(caches, other_caches, strict=True):
        assert torch.equal(slots, other_slots) and counts == other_counts


@pytest.mark.parametrize(
    "options",
    [
        {"method": "dip", "density": 0.6},
        {"method": "dip", "density": 0.6, "cache_aware": 0.2},
        {"method": "glu", "density": 0.5},
        {"method": "up", "density": 0.6},
    ],
    ids=["dip", "dip-ca", "glu", "up"],
)
@pytest.mark.exactness
def test_fused_selection_and_lookup_change_nothing(options, tiny_llama, monkeypatch) -> None:
    """A decode token's top-k selection run fused with its cache lookup (`TopUnits`) computes, reads, keeps
    and counts what the selection and the lookup run apart do."""
    path, _, store = tiny_llama
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(21))
    calls = count_calls(monkeypatch, TopUnits, "__call__")
    fused_out, fused_totals, fused_caches = greedy_run(load(path, store, cached=0.35, **options), ids)
    monkeypatch.setattr(TopUnits, "__call__", lambda *args, **kwargs: None)  # every stage apart
    apart_out, apart_totals, apart_caches = greedy_run(load(path, store, cached=0.35, **options), ids)
    if select._functions() is not None:
        assert calls["calls"] > 0
    assert_same_runs((fused_out, fused_totals, fused_caches), (apart_out, apart_totals, apart_caches))


@pytest.mark.exactness
def test_fused_guess_changes_nothing(tiny_llama, monkeypatch) -> None:
    """DIP-CA's layer-ahead guess selected fused with its lookup (`guess_units`), and the guessed layer's
    fused selection counting the guess's mask as resident, compute, read, keep and count what the
    selections run apart do."""
    path, _, store = tiny_llama
    monkeypatch.setattr(sparse_module, "reads_ahead", lambda config, *_: False)  # guess
    options = {"method": "dip", "density": 0.6, "cache_aware": 0.2}
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(23))
    fused_guesses: list[bool] = []
    guess_uncached = runtime_module.FlashRuntime.guess_uncached

    def recording(runtime, layer, kind, uncached, buffer, selected=None, span=None):
        fused_guesses.append(selected is not None)
        return guess_uncached(runtime, layer, kind, uncached, buffer, selected, span)

    monkeypatch.setattr(runtime_module.FlashRuntime, "guess_uncached", recording)
    model = load(path, store, cached=0.35, **options)
    assert streaming_mlps(model)[0].guesses_ahead
    fused_out, fused_totals, fused_caches = greedy_run(model, ids)
    guesses = 7 * (len(streaming_mlps(model)) - 1)  # each decode step, each layer but the last
    assert fused_guesses == [select._functions() is not None] * guesses
    fused_guesses.clear()
    monkeypatch.setattr(TopUnits, "__call__", lambda *args, **kwargs: None)  # every selection apart
    apart_out, apart_totals, apart_caches = greedy_run(load(path, store, cached=0.35, **options), ids)
    assert fused_guesses == [False] * guesses
    assert_same_runs((fused_out, fused_totals, fused_caches), (apart_out, apart_totals, apart_caches))


@pytest.mark.parametrize(
    "options",
    [
        {"method": "dip", "density": 0.6},
        {"method": "dip", "density": 0.6, "cache_aware": 0.2},
        {"method": "glu", "density": 0.5},
    ],
    ids=["dip", "dip-ca", "glu"],
)
@pytest.mark.exactness
def test_decode_products_in_c_compute_what_torch_computes(options, tiny_llama, monkeypatch) -> None:
    """A decode token's column products and GLU in C (`TokenColumns`) give torch's path's tokens, reads and
    cache contents, and its logits up to the last bit of SiLU's exp."""
    path, _, store = tiny_llama
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(22))
    calls = count_calls(monkeypatch, TokenColumns, "result")
    model = load(path, store, cached=0.35, **options)
    c_out, c_totals, c_caches = greedy_run(model, ids)
    # every decode step's stages whose column kernel is measured fastest here ran in C
    modules = streaming_mlps(model)
    native = [w for m in modules for w in m.column_products if m._product(w).decode == "native"]
    assert calls["calls"] == 7 * len(native)  # 8 new tokens: the prompt's forward, then 7 decode steps
    model = load(path, store, cached=0.35, **options)
    streaming_mlps(model)[0].runtime.token_columns = {}  # torch's path
    torch_out, torch_totals, torch_caches = greedy_run(model, ids)
    assert torch.equal(c_out.sequences, torch_out.sequences)
    for c_logits, torch_logits in zip(c_out.logits, torch_out.logits, strict=True):
        torch.testing.assert_close(c_logits, torch_logits, rtol=1e-5, atol=1e-5)
    for name in ("hits", "misses", "evictions", "bytes_read", "used_bytes"):
        assert c_totals[name] == torch_totals[name]
    assert all(
        torch.equal(a[0], b[0]) and a[1:] == b[1:] for a, b in zip(c_caches, torch_caches, strict=True)
    )


def test_reads_ahead_where_a_read_on_demand_would_cost_the_disk_most_of_the_time_anyway(caplog) -> None:
    """The measured points of `READ_AHEAD_MIN_COST` (across a 72 KiB merge gap), and the options."""
    from types import SimpleNamespace

    from flashlm.store.reader import merged_read_cost

    def store(row_bytes: int):
        return SimpleNamespace(
            path="store", row_file=lambda layer, kind: SimpleNamespace(row_bytes=row_bytes)
        )

    def decide(row_bytes: int, merge_gap: int, **options) -> bool:
        return reads_ahead(flashlm.FlashConfig(**options), store(row_bytes), None, merge_gap)

    smollm2, qwen, gap = 6144, 35840, 72 << 10  # input columns' bytes; this VM's disk's merge gap
    threshold = sparse_module.READ_AHEAD_MIN_COST
    # where reading ahead decoded faster than on demand, and where slower
    faster = [(smollm2, 0.1), (smollm2, 0.2), (smollm2, 0.3), (qwen, 0.45), (qwen, 0.6)]
    slower = [(smollm2, 0.05), (qwen, 0.3)]
    assert all(merged_read_cost(rho, row_bytes, gap) >= threshold for row_bytes, rho in faster)
    assert all(merged_read_cost(rho, row_bytes, gap) < threshold for row_bytes, rho in slower)
    assert decide(smollm2, gap, method="dip", density=0.3, input_density=0.1)
    assert not decide(smollm2, gap, method="dip", density=0.3, input_density=0.05)
    with caplog.at_level("INFO", logger=sparse_module.__name__):
        assert decide(qwen, gap, method="dip", density=0.5)
        assert not decide(qwen, 0, method="dip", density=0.5)  # no gap: its bytes alone, half
    assert [record.getMessage() for record in caplog.records if record.name == sparse_module.__name__] == [
        "flashlm: DIP reads its uncached input columns ahead, every one: at ρ_in 0.50 a read of only the "
        "needed ones would cost the disk 88% of the time of reading them all (merge gap 72 KiB, columns of "
        "35840 bytes)",
        "flashlm: DIP reads its uncached input columns when needed: at ρ_in 0.50 a read of only the needed "
        "ones would cost the disk 50% of the time of reading them all (merge gap 0 KiB, columns of 35840 "
        "bytes)",
    ]
    assert not decide(qwen, gap, method="dip", density=0.5, input_density=0.3)
    assert decide(qwen, 0, method="dip", density=0.99, input_density=0.99)
    assert decide(qwen, 0, method="up", density=0.8)  # its first stage reads every unit
    assert not decide(smollm2, gap, method="up", density=0.8, read_ahead=False)
    assert decide(qwen, 0, method="dip", density=0.5, input_density=0.3, read_ahead=True)


@pytest.mark.parametrize(("merge_gap_bytes", "read_ahead"), [(0, ()), (4096, ("dip_in",))])
def test_dips_read_ahead_follows_the_merge_gap_of_the_stores_disk(
    merge_gap_bytes, read_ahead, tiny_llama, monkeypatch
) -> None:
    """By default DIP reads ahead whole where, with its disk's merge gap, a read of only the needed input
    columns would cost most of the time of reading them all (`reads_ahead`): at ρ_in 0.5, half of it
    across no gap, over 90% across a page (5 of the tiny llama's input columns)."""
    from flashlm.store.disk import DiskProfile
    from flashlm.store.reader import merged_read_cost

    path, dense, store = tiny_llama
    row_bytes = 2 * dense.config.intermediate_size * 4  # a dip_in row: up and gate columns, fp32
    assert merged_read_cost(0.5, row_bytes, 0) == 0.5
    assert merged_read_cost(0.5, row_bytes, 4096) > 0.9
    disk = DiskProfile(threads=4, request_cost_s=merge_gap_bytes / 1e9, bandwidth=1e9)
    assert disk.merge_gap_bytes == merge_gap_bytes
    monkeypatch.setattr(sparse_module, "reader_disk_profile", lambda config, paths: disk)
    model = load(path, store, method="dip", density=0.5)
    assert streaming_mlps(model)[0].runtime.read_ahead == read_ahead


# ---- bad configs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "dip", "density": 0.0}, "density must be in"),
        ({"method": "dip", "density": 1.2}, "density must be in"),
        ({"method": "dip", "density": 0.5, "cache_aware": 1.5}, "cache_aware"),
        ({"method": "dip", "density": 0.5, "cache_aware": -0.1}, "cache_aware"),
        ({"method": "up", "density": 0.5, "cache_aware": 0.2}, "method='dip' only"),
        ({"method": "dip", "density": 0.3, "input_density": 0.9}, "down density"),
        ({"method": "gate", "density": 0.3}, "above 1/3"),
        ({"method": "dip", "density": 0.5, "threshold": "row"}, "Unknown threshold"),
        ({"method": "dip", "density": 0.5, "threshold": "layer", "cache_aware": 0.2}, "threshold='token'"),
        ({"method": "sparse"}, "Unknown method"),
    ],
)
def test_bad_configs_raise(options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        flashlm.FlashConfig(**options)


def test_gated_method_on_a_plain_mlp_raises(make_tiny_checkpoint, tmp_path) -> None:
    path = make_tiny_checkpoint("opt", dtype=torch.float32)
    config = flashlm.FlashConfig(method="dip", density=0.5, store=str(tmp_path / "store"))
    with pytest.raises(ConfigError, match="not gated"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    model = build_tiny_model("opt")
    with pytest.raises(ConfigError, match="not gated"):
        flashlm.patch(model, flashlm.FlashConfig(method="up", density=0.5, store=str(tmp_path / "s2")))


def test_thresholds_without_calibration_raise(make_tiny_checkpoint, tmp_path) -> None:
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    config = flashlm.FlashConfig(
        method="cats", density=0.5, store=str(tmp_path / "store"), memory_budget="10MB"
    )
    with pytest.raises(flashlm.methods.calibration.CalibrationMissingError, match="flashlm calibrate"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=config)


def test_trace_replay_reproduces_the_live_cache(tiny_llama, tmp_path) -> None:
    """The units recorded in a run, replayed offline with the same policy and capacities, give the
    run's own hits and misses: the simulator's cache is the real one."""
    from flashlm.engine.trace import Trace
    from flashlm.patching import trace
    from flashlm.sim import replay

    path, _, store = tiny_llama
    model = load(path, store, cached=0.4, method="dip", density=0.5, record_trace=True)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(11))
    model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    recorded = trace(model)
    recorded.save(tmp_path / "trace.safetensors")
    loaded = Trace.load(tmp_path / "trace.safetensors")
    assert loaded == recorded and loaded.num_steps == 10  # the prompt's step, then 9 decode steps
    runtime = streaming_mlps(model)[0].runtime
    # how the simulator plans its reads
    assert loaded.metadata["reader"] == runtime.reader.plan_settings
    assert loaded.metadata["read_ahead"] == list(runtime.read_ahead)
    capacities = {key: cache.capacity for key, cache in runtime.caches.items()}
    result = replay(loaded, capacity=capacities, policy="lfu")
    live = flashlm.stats(model).totals()
    assert (int(result.hits.sum()), int(result.misses.sum())) == (live["hits"], live["misses"])
    belady = replay(loaded, capacity=capacities, policy="belady")
    assert belady.misses.sum() <= result.misses.sum()


def test_trace_outlives_a_stats_reset_so_its_replay_starts_from_the_runs_caches(tiny_llama) -> None:
    """Counters reset between two generations leave the trace whole: replayed from empty caches, its
    steps after the reset hit and miss as the second generation did, whose caches the first had filled.
    `trace(model, reset=True)` forgets the steps taken."""
    from flashlm.patching import trace
    from flashlm.sim import replay

    path, _, store = tiny_llama
    model = load(path, store, cached=0.4, method="dip", density=0.5, record_trace=True)
    prompts = torch.randint(3, 128, (2, 1, 6), generator=torch.Generator().manual_seed(12))
    model.generate(prompts[0], max_new_tokens=5, do_sample=False, pad_token_id=0)
    flashlm.stats(model, reset=True)
    model.generate(prompts[1], max_new_tokens=5, do_sample=False, pad_token_id=0)
    second = flashlm.stats(model).totals()
    recorded = trace(model, reset=True)
    assert recorded.num_steps == 10  # each generation: its prompt's step, then 4 decode steps
    runtime = streaming_mlps(model)[0].runtime
    capacities = {key: cache.capacity for key, cache in runtime.caches.items()}
    replayed = replay(recorded, capacity=capacities, policy="lfu")
    assert second["misses"] > 0 and int(replayed.misses[:5].sum()) > 0
    after_reset = (int(replayed.hits[5:].sum()), int(replayed.misses[5:].sum()))
    assert after_reset == (second["hits"], second["misses"])
    model.generate(prompts[0], max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert trace(model).num_steps == 2


# ---- the hot set: pinned units from a unit profile ----------------------------------------------


def _profiled(tiny_llama, **options):
    """The tiny llama's unit profile of DIP at density 0.5, measured and saved beside its store."""
    from flashlm.workflows.profile import profile_model

    path, _, store = tiny_llama
    model = load(path, store, cached=2.0, method="dip", density=0.5, record_trace=True, **options)
    ids = torch.randint(3, 128, (48,), generator=torch.Generator().manual_seed(5))
    profile = profile_model(model, ids, corpus="random", context_length=16, progress=False)
    profile.save(store)
    return profile


def test_hot_set_pins_the_most_frequent_units_and_keeps_them(tiny_llama) -> None:
    """With hot_share, each cache pins a prefix of its units by profiled frequency, within the budget,
    and they stay through decoding; plain DIP's selection ignores the cache, so its tokens are
    unchanged."""
    path, _, store = tiny_llama
    profile = _profiled(tiny_llama)
    assert profile.tokens == 48 and profile.key["method"] == "dip" and profile.key["density"] == 0.5
    prompt = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(11))
    # read on demand: a kind read ahead whole pins a block instead (below)
    plain = load(path, store, cached=0.4, method="dip", density=0.5, read_ahead=False)
    model = load(path, store, cached=0.4, method="dip", density=0.5, hot_share=0.6, read_ahead=False)
    runtime = streaming_mlps(model)[0].runtime
    assert runtime.hot_set is not None and sum(runtime.hot_set.counts) > 0
    pinned_before = {}
    assert any(c.pinned > 0 and c.capacity < c.num_units for c in runtime.caches.values())
    for (layer, kind), cache in runtime.caches.items():
        frequency = profile.frequencies[(layer, kind)]
        pinned = cache.slot_ids[: cache.pinned]
        assert cache.pinned <= cache.capacity
        if cache.pinned and cache.capacity < cache.num_units:
            others = torch.ones(cache.num_units, dtype=torch.bool)
            others[pinned] = False
            assert frequency[pinned].min() >= frequency[others].max()
        assert torch.equal(
            cache.rows[: cache.pinned], runtime.read(layer, kind, pinned).matrix[pinned].to(cache.rows.dtype)
        )
        pinned_before[(layer, kind)] = pinned.clone()
    assert runtime.resident_bytes() <= runtime.budget_bytes
    expected = plain.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    for key, cache in runtime.caches.items():
        assert torch.equal(cache.slot_ids[: cache.pinned], pinned_before[key])
    snapshot = flashlm.stats(model)
    assert (
        snapshot.hot_set["units"] == sum(runtime.hot_set.counts)
        and 0 < snapshot.hot_set["profiled_uses"] <= 1
    )
    assert "hot set" in str(snapshot) and not flashlm.stats(plain).hot_set
    ahead = streaming_mlps(load(path, store, cached=0.4, method="dip", density=0.5, hot_share=0.6))[0].runtime
    assert ahead.read_ahead == ("dip_in",)
    for (layer, kind), cache in ahead.caches.items():
        if kind == "dip_in":
            assert 0 < cache.pinned == cache.capacity < cache.num_units
            assert torch.equal(cache.resident_ids, torch.arange(cache.capacity))
        else:
            assert torch.equal(
                cache.slot_ids[: cache.pinned], ahead.hot_set.hot[ahead._cache_keys.index((layer, kind))]
            )


def test_hot_set_needs_a_profile_of_the_method_and_weights(tiny_llama) -> None:
    from flashlm.cache.profile import ProfileMissingError, UnitProfile

    path, _, store = tiny_llama
    with pytest.raises(ProfileMissingError, match=r"flashlm profile --store .* --method dip --density 0\.5"):
        load(path, store, cached=0.4, method="dip", density=0.5, hot_share=0.5)
    profile = _profiled(tiny_llama)
    with pytest.raises(ProfileMissingError, match=r"--density 0\.6"):  # a profile of density 0.5 only
        load(path, store, cached=0.4, method="dip", density=0.6, hot_share=0.5)
    stale = UnitProfile(
        "0" * 64, profile.key, profile.fitted, profile.corpus, profile.tokens, profile.frequencies
    )
    stale.save(store)
    with pytest.raises(ProfileMissingError, match="other MLP weights"):
        load(path, store, cached=0.4, method="dip", density=0.5, hot_share=0.5)
    profile.save(store)
    calibration = Path(store) / "calibration.json"
    calibration.write_text(calibration.read_text().replace('"corpus"', '"corpus" ', 1))  # recalibrated
    with pytest.raises(ProfileMissingError, match=r"before calibration\.json changed"):
        load(path, store, cached=0.4, method="dip", density=0.5, hot_share=0.5)
    with pytest.raises(ConfigError, match="hot_share"):
        flashlm.FlashConfig(method="dense", hot_share=0.5)
    with pytest.raises(ConfigError, match="hot_share"):
        flashlm.FlashConfig(method="dip", density=0.5, hot_share=1.5)
