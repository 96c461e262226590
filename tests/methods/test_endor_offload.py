"""The Endor store and offload path: conversion, placement, exactness against the pruned model in RAM,
row-subset reads, stats, errors, save / unpatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import flashlm
from flashlm.arch import decoder_layers
from flashlm.endor.codec import decompress
from flashlm.endor.store import EndorStore, convert_endor, endor_layout, layer_placement
from flashlm.errors import (
    BudgetTooSmallError,
    ConfigError,
    EndorFormatError,
    StoreCorruptError,
    StoreMismatchError,
)
from flashlm.methods.endor import EndorLinear, endor_linears, working_bytes

ARCHITECTURES = ["llama", "qwen2", "phi3", "opt", "gemma2"]


def prune_half_per_row(model: torch.nn.Module, seed: int = 0) -> None:
    """Zero exactly half of every row of every decoder linear (random positions): a stand-in for Wanda."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, layer in decoder_layers(model):
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    rows, cols = module.weight.shape
                    order = torch.rand(rows, cols, generator=generator).argsort(dim=1)
                    module.weight.scatter_(1, order[:, : cols // 2], 0.0)


@pytest.fixture(scope="module")
def pruned_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Factory `pruned_checkpoint(name) -> Path`: a bf16 tiny checkpoint, every decoder linear 50% pruned."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            model = build_tiny_model(name, torch.bfloat16)
            prune_half_per_row(model)
            path = tmp_path_factory.mktemp(f"pruned-{name}")
            model.save_pretrained(path)
            made[name] = path
        return made[name]

    return make


def load_endor(path: Path, store: Path, **options) -> torch.nn.Module:
    config = flashlm.FlashConfig(method="endor", store=str(store), direct_io=False, **options)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config).eval()


def greedy(model: torch.nn.Module, tokens: int = 12) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 17, 33, 2, 70]])
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)


def test_store_holds_every_decoder_linear_compressed_and_exact(pruned_checkpoint, tmp_path: Path) -> None:
    path = pruned_checkpoint("llama")
    reference = AutoModelForCausalLM.from_pretrained(path)
    store = convert_endor(path, tmp_path / "store", endor_layout(reference), progress=False)
    assert store.num_layers == reference.config.num_hidden_layers
    # 50% per row, every width a multiple of 8: exactly (0.5 * 2 + 1/8) / 2 of the dense bytes.
    assert store.nbytes() == pytest.approx(0.5625 * store.dense_nbytes(), abs=0)
    state = reference.state_dict()
    for entry in store.layers:
        assert set(entry.linears) == {
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        }
        for name, matrix in store.load_layer(entry.index).items():
            dense = state[f"{entry.prefix}.{name}.weight"]
            assert torch.equal(decompress(matrix).view(torch.int16), dense.view(torch.int16))


def test_layer_placement_fills_device_then_memory_in_order() -> None:
    assert layer_placement([5, 5, 5, 5], [10, 10, 10, 10], budget=11, device_budget=10) == [
        "device",
        "cpu",
        "cpu",
        "disk",
    ]
    assert layer_placement([5, 5, 5], [10, 10, 10], budget=0) == ["disk"] * 3
    assert layer_placement([5, 9, 5], [10, 10, 10], budget=12) == [
        "cpu",
        "disk",
        "disk",
    ]  # in order, like Accelerate


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("budget", ["min", "half", "all"])
def test_greedy_output_equals_the_pruned_model_in_ram(
    pruned_checkpoint, tmp_path: Path, name: str, budget: str
) -> None:
    path = pruned_checkpoint(name)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    store = convert_endor(path, tmp_path / "store", endor_layout(reference), progress=False)
    overhead = working_bytes(store)
    memory = {
        "min": overhead,
        "half": overhead + store.layers[0].data_bytes,
        "all": overhead + store.nbytes(),
    }
    model = load_endor(path, tmp_path / "store", memory_budget=memory[budget])
    placement = endor_linears(model)[0].runtime.placement
    expected = {"min": ["disk", "disk"], "half": ["cpu", "disk"], "all": ["cpu", "cpu"]}[budget]
    assert placement == expected
    assert not any(isinstance(p, torch.nn.Parameter) and p.is_meta for p in model.parameters())
    assert torch.equal(greedy(model), greedy(reference))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_device_budget_keeps_dense_linears(pruned_checkpoint, tmp_path: Path) -> None:
    path = pruned_checkpoint("llama")
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    store = convert_endor(path, tmp_path / "store", endor_layout(reference), progress=False)
    model = load_endor(
        path,
        tmp_path / "store",
        memory_budget=working_bytes(store) + store.layers[1].data_bytes,
        device_budget=store.layers[0].dense_bytes,
    )
    assert endor_linears(model)[0].runtime.placement == ["device", "cpu"]
    layer0 = decoder_layers(model)[0][2]
    assert isinstance(layer0.self_attn.q_proj, torch.nn.Linear)
    assert all(module.layer == 1 for module in endor_linears(model))
    assert torch.equal(greedy(model), greedy(reference))


def test_stats_count_reads_and_phases(pruned_checkpoint, tmp_path: Path) -> None:
    path = pruned_checkpoint("llama")
    store = convert_endor(path, tmp_path / "store", endor_layout(build_tiny_model("llama")), progress=False)
    model = load_endor(path, store.path, memory_budget=working_bytes(store) + store.layers[0].data_bytes)
    greedy(model, tokens=4)
    stats = flashlm.stats(model)
    decode = stats.totals(decode_only=True)
    assert decode["steps"] == 3  # 4 new tokens: a prefill step, then 3 one-token steps
    disk = [layer for layer, where in zip(store.layers, stats.placement, strict=True) if where == "disk"]
    assert disk
    wanted = sum(layer.data_bytes for layer in disk)
    # Buffered reads fetch exactly the data regions; with O_DIRECT an aligned superset.
    assert wanted <= decode["bytes_read_per_step"] < wanted + 4096 * len(disk)
    assert decode["dense_bytes_per_step"] == store.dense_nbytes()
    for phase in ("read", "decompress", "compute"):
        assert any(event[0] == phase for event in stats.events)
    assert "decompress" in stats.summary()
    flashlm.stats(model, reset=True)
    assert flashlm.stats(model).totals()["steps"] == 0


def test_truncated_store_raises(pruned_checkpoint, tmp_path: Path) -> None:
    path = pruned_checkpoint("llama")
    store = convert_endor(path, tmp_path / "store", endor_layout(build_tiny_model("llama")), progress=False)
    layer_file = store.layers[1].path
    layer_file.write_bytes(layer_file.read_bytes()[:-10])
    with pytest.raises(StoreCorruptError, match="truncated"):
        EndorStore.open(store.path)


def test_corrupted_bitmap_raises_at_use(pruned_checkpoint, tmp_path: Path) -> None:
    path = pruned_checkpoint("llama")
    store = convert_endor(path, tmp_path / "store", endor_layout(build_tiny_model("llama")), progress=False)
    entry = store.layers[0]
    data = bytearray(entry.path.read_bytes())
    data[entry.data_offset + entry.linears["mlp.up_proj"].bitmap[0]] ^= 0b1  # one more or one fewer non-zero
    entry.path.write_bytes(bytes(data))
    model = load_endor(path, store.path, memory_budget=working_bytes(store))
    with pytest.raises(EndorFormatError):
        greedy(model, tokens=1)


def test_store_of_another_model_is_refused(pruned_checkpoint, tmp_path: Path) -> None:
    llama = pruned_checkpoint("llama")
    convert_endor(llama, tmp_path / "store", endor_layout(build_tiny_model("llama")), progress=False)
    with pytest.raises(StoreMismatchError):
        load_endor(pruned_checkpoint("qwen2"), tmp_path / "store")


def test_budget_too_small(pruned_checkpoint, tmp_path: Path) -> None:
    with pytest.raises(BudgetTooSmallError, match="at least"):
        load_endor(pruned_checkpoint("llama"), tmp_path / "store", memory_budget=1000)


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"density must be 1\.0"):
        flashlm.FlashConfig(method="endor", density=0.5)
    with pytest.raises(ConfigError, match="device_budget applies to method='endor'"):
        flashlm.FlashConfig(method="dense", device_budget="1MB")


def test_patch_in_memory_save_and_unpatch(pruned_checkpoint, tmp_path: Path) -> None:
    path = pruned_checkpoint("qwen2")
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    dense = {k: v.clone() for k, v in reference.state_dict().items()}
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    # The store is compressed from the model in memory; a second patch finds it by content hash.
    flashlm.patch(
        model, flashlm.FlashConfig(method="endor", store=str(tmp_path / "store"), memory_budget="100%")
    )
    store = endor_linears(model)[0].runtime.store
    flashlm.unpatch(model)
    budget = working_bytes(store) + store.layers[0].data_bytes
    flashlm.patch(model, flashlm.FlashConfig(method="endor", store=str(store.path), memory_budget=budget))
    assert endor_linears(model)[0].runtime.placement == ["cpu", "disk"]
    assert endor_linears(model) and all(isinstance(m, EndorLinear) for m in endor_linears(model))
    assert torch.equal(greedy(model), greedy(reference))
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    for key, tensor in dense.items():
        if key != "lm_head.weight" or key in saved:  # tied to the embeddings
            assert torch.equal(saved[key], tensor), key
    flashlm.unpatch(model)
    assert not endor_linears(model)
    for key, tensor in dense.items():
        assert torch.equal(model.state_dict()[key], tensor), key


def test_cli_converts_and_generates_with_endor(pruned_checkpoint, tmp_path: Path, capsys) -> None:
    from flashlm.cli.main import main

    path = pruned_checkpoint("llama")
    assert main(["convert", str(path), str(tmp_path / "store"), "--format", "endor"]) == 0
    assert "56.25% of" in capsys.readouterr().out
    assert EndorStore.open(tmp_path / "store").num_layers == 2
