"""Every method on the model's execution device: the caches live where the model is (`device_map` or
`.to()`), reads land in host memory and move to it once, and density 1.0 is the dense model there too.

Each test runs on the CPU and, where CUDA is available, on the GPU (the `gpu` marker skips it
elsewhere); the sparse methods, which have no dense reference, are compared with themselves on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, tiny_config
from test_endor_offload import prune_half_per_row
from test_predictor import exact_predictors, relu_checkpoint
from transformers import AutoModelForCausalLM

import flashlm
from flashlm.endor.store import convert_endor, endor_layout
from flashlm.engine.runtime import FlashRuntime
from flashlm.errors import BudgetTooSmallError
from flashlm.methods.endor import endor_linears, working_bytes
from flashlm.patching import streaming_mlps
from flashlm.store.format import dense_kinds

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GREEDY = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}


def budget_caching(store_path, cached: float, *, headroom: int = 2) -> int:
    """A budget whose dense caches hold about `cached` of every unit (all of them at 1.0), beyond
    `headroom` times the smallest budget that works (its staging buffers grow with the model)."""
    store = flashlm.Store.open(store_path)
    with pytest.raises(BudgetTooSmallError) as info:
        FlashRuntime(store, flashlm.FlashConfig(memory_budget=1))
    units = sum(
        store.row_file(0, kind).rows * (store.row_file(0, kind).row_bytes + 8)
        for kind in dense_kinds(store.gated)
    )
    return headroom * info.value.minimum_bytes + int(cached * units * store.num_layers)


def load_on(device: str, path, store, cached: float, *, move: bool = False, **options) -> torch.nn.Module:
    """The checkpoint patched with `options`, placed on `device` by `device_map` (or, with `move`,
    loaded on the CPU and moved with `.to`)."""
    config = flashlm.FlashConfig(store=str(store), memory_budget=budget_caching(store, cached), **options)
    if move:
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=config).to(device).eval()
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map=device).eval()


def prompt(device: str) -> torch.Tensor:
    return torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(4)).to(device)


@pytest.fixture
def tiny_llama_store(make_tiny_checkpoint, tmp_path):
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    return path, flashlm.convert(path, tmp_path / "store", progress=False).path


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("move", [False, True], ids=["device_map", "to"])
@pytest.mark.parametrize("cached", [0.0, 0.5, 1.0])
@pytest.mark.parametrize(
    "options",
    [{}, {"method": "dip", "density": 1.0}, {"method": "dip", "density": 1.0, "cache_aware": 0.2}],
    ids=["dense", "dip", "dip-ca"],
)
@pytest.mark.exactness
def test_density_one_is_the_dense_model_on_the_device(options, cached, move, device, tiny_llama_store):
    path, store = tiny_llama_store
    reference = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    model = load_on(device, path, store, cached, move=move, **options)
    for module in streaming_mlps(model):
        assert all(cache.rows.device.type == device for cache in module.caches())
    ids = prompt(device)
    with torch.no_grad():
        logits = model(ids).logits
        assert logits.device.type == device
        torch.testing.assert_close(logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.generate(ids, **GREEDY), reference.generate(ids, **GREEDY))
    assert flashlm.stats(model).totals()["bytes_read"] > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.exactness
def test_dense_streaming_decodes_bit_for_bit_as_the_dense_model_on_the_device(device, tmp_path):
    """bf16, half of each matrix cached and half read every step, at a width where a GPU's kernels
    may split a product's reduction differently for a part of the matrix than for the whole."""
    wide = tiny_config("llama")
    wide.hidden_size, wide.intermediate_size, wide.num_attention_heads = 512, 2048, 8
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(wide).to(torch.bfloat16).save_pretrained(tmp_path / "wide")
    store = flashlm.convert(tmp_path / "wide", tmp_path / "store", progress=False).path
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "wide", device_map=device).eval()
    config = flashlm.FlashConfig(store=str(store), memory_budget=budget_caching(store, 0.5, headroom=1))
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "wide", quantization_config=config, device_map=device
    )
    ids = prompt(device)[:1]  # one sequence: its decode steps take the one-token path
    with torch.no_grad():
        out, expected = model(ids, use_cache=True), reference(ids, use_cache=True)
        assert torch.equal(out.logits, expected.logits)
        for _ in range(4):
            ids = expected.logits[:, -1:].argmax(-1)
            out = model(ids, past_key_values=out.past_key_values, use_cache=True)
            expected = reference(ids, past_key_values=expected.past_key_values, use_cache=True)
            assert torch.equal(out.logits, expected.logits)
    totals = flashlm.stats(model).totals()
    assert totals["hits"] > 0 and totals["misses"] > 0  # cached and read rows both took part


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [
        {"method": "dip", "density": 0.5},
        {"method": "dip", "density": 0.5, "cache_aware": 0.2},
        {"method": "glu", "density": 0.5},
        {"method": "up", "density": 0.5},
        {"method": "gate", "density": 0.5},
        {"method": "dip", "density": 0.5, "sequential_prefill": True},
    ],
    ids=["dip", "dip-ca", "glu", "up", "gate", "dip-sequential"],
)
def test_sparse_methods_on_the_gpu_compute_what_they_compute_on_the_cpu(options, tiny_llama_store):
    """The same units selected, read and cached (the counters agree) and the same logits to rounding."""
    device = "cuda"
    path, store = tiny_llama_store
    on_cpu = load_on("cpu", path, store, 0.3, **options)
    on_device = load_on(device, path, store, 0.3, **options)
    ids = prompt(device)
    with torch.no_grad():
        for _ in range(3):  # a prompt, then two steps whose selections see what the caches kept
            expected = on_cpu(ids.cpu()).logits
            torch.testing.assert_close(on_device(ids).logits.cpu(), expected, rtol=1e-4, atol=1e-4)
            ids = expected[:, -1:].argmax(-1).to(device)
    cpu_totals, device_totals = flashlm.stats(on_cpu).totals(), flashlm.stats(on_device).totals()
    for counter in ("bytes_read", "hits", "misses", "density"):
        assert device_totals[counter] == cpu_totals[counter], counter


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["predictor", "predictor-gate"])
def test_a_predictor_that_never_misses_reproduces_the_dense_model_on_the_device(method, device, tmp_path):
    model, path = relu_checkpoint("llama", tmp_path)
    store = flashlm.convert(path, tmp_path / "store", progress=False)
    exact_predictors(model).save(store.path)
    config = flashlm.FlashConfig(
        method=method,
        store=str(store.path),
        memory_budget=10**7,
        density=(store.d_ff - 0.4) / store.d_ff,
        cache_split="size",  # no unit profile needed
    )
    patched = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map=device)
    model = model.to(device)
    ids = prompt(device)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(patched.generate(ids, **GREEDY), model.generate(ids, **GREEDY))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["disk", "memory", "device"])
def test_endor_layers_decompress_on_the_device(placement, device, tmp_path):
    model = build_tiny_model("llama", torch.bfloat16)
    prune_half_per_row(model)
    path = tmp_path / "pruned"
    model.save_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    store = convert_endor(path, tmp_path / "endor", endor_layout(reference), progress=False)
    budgets = {
        "disk": {"memory_budget": working_bytes(store)},
        "memory": {"memory_budget": working_bytes(store) + store.nbytes()},
        "device": {
            "memory_budget": working_bytes(store) + store.layers[1].data_bytes,
            "device_budget": store.layers[0].dense_bytes,
        },
    }[placement]
    config = flashlm.FlashConfig(method="endor", store=str(tmp_path / "endor"), direct_io=False, **budgets)
    patched = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map=device).eval()
    expected = {"disk": ["disk", "disk"], "memory": ["cpu", "cpu"], "device": ["device", "cpu"]}[placement]
    assert endor_linears(patched)[0].runtime.placement == expected
    ids = prompt(device)
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, reference(ids).logits)
    assert torch.equal(patched.generate(ids, **GREEDY), reference.generate(ids, **GREEDY))
