"""The `flashlm` command line: convert, info, generate, and errors reported without a traceback."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import save_word_tokenizer
from transformers import AutoModelForCausalLM

import flashlm
from flashlm.cli.main import main


def test_convert_then_info(make_tiny_checkpoint, tmp_path, capsys):
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    assert main(["convert", str(path), str(tmp_path / "store")]) == 0
    assert (tmp_path / "store" / "manifest.json").exists()
    capsys.readouterr()

    assert main(["info", str(tmp_path / "store")]) == 0
    text = capsys.readouterr().out
    assert "llama: 2 layers" in text and "kind gate" in text and "kind up" in text and "kind down" in text

    assert main(["info", str(tmp_path / "store"), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["format"] == "flashlm-store" and manifest["model_type"] == "llama"


def test_convert_stores_the_dtype_asked_for(make_tiny_checkpoint, tmp_path, capsys):
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    assert main(["convert", str(path), str(tmp_path / "kept")]) == 0
    assert "float32" in capsys.readouterr().out
    assert main(["convert", str(path), str(tmp_path / "halved"), "--dtype", "bfloat16"]) == 0
    assert "bfloat16" in capsys.readouterr().out
    kept, halved = (flashlm.Store.open(tmp_path / name) for name in ("kept", "halved"))
    assert (kept.dtype, halved.dtype) == (torch.float32, torch.bfloat16)
    assert halved.nbytes() * 2 == kept.nbytes()
    # the float32 checkpoint loaded in bfloat16 over the bfloat16 store decodes as it does without flashlm
    config = flashlm.FlashConfig(store=str(tmp_path / "halved"), memory_budget=400_000)
    streamed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    greedy = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(streamed.generate(ids, **greedy), plain.generate(ids, **greedy))
    endor = ["convert", str(path), str(tmp_path / "endor"), "--format", "endor", "--dtype", "float16"]
    assert main(endor) == 2
    assert "--dtype applies to MLP stores" in capsys.readouterr().err
    assert not (tmp_path / "endor").exists()


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "flashlm convert" in capsys.readouterr().err


# ---- eval ppl / eval sweep ----------------------------------------------------------------------


def _tiny_with_tokenizer(make_tiny_checkpoint, tmp_path):
    """A copy of the tiny llama checkpoint with a word-level tokenizer whose ids fit its vocabulary."""
    import shutil

    path = tmp_path / "tiny"
    shutil.copytree(make_tiny_checkpoint("llama", dtype=torch.float32), path)
    save_word_tokenizer(path)
    return path


def test_eval_help(capsys):
    for command in (["eval", "ppl", "--help"], ["eval", "sweep", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(command)
        assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--corpus", "--context-length", "--tokens", "--json", "--cache-aware", "--threshold"):
        assert option in out
    assert "dip-ca" in out and "--methods" in out and "--densities" in out and "--corpora" in out


def test_runtime_options_map_to_flash_config():
    from flashlm.cli.main import _config, build_parser

    args = build_parser().parse_args(
        ["generate", "--method", "dip-ca", "--density", "0.5", "--policy", "none"]
    )
    config = _config(args)
    assert (config.method, config.cache_aware, config.density, config.policy) == ("dip", 0.2, 0.5, "none")
    args = build_parser().parse_args(
        ["generate", "--method", "dip-ca", "--cache-aware", "0.1", "--density", "0.5"]
    )
    assert _config(args).cache_aware == 0.1
    args = build_parser().parse_args(
        ["generate", "--method", "dip", "--threshold", "layer", "--input-density", "0.5", "--density", "0.5"]
    )
    config = _config(args)
    assert (config.threshold, config.input_density, config.policy) == ("layer", 0.5, "lfu")


def test_eval_errors_exit_2(make_tiny_checkpoint, tmp_path, capsys):
    path = str(make_tiny_checkpoint("llama", dtype=torch.float32))
    assert main(["eval", "ppl", "--model", path, "--method", "sparse"]) == 2
    assert "dip-ca" in capsys.readouterr().err
    assert main(["eval", "ppl", "--model", path, "--corpus", "wikitext"]) == 2
    assert "Available corpora" in capsys.readouterr().err
    assert main(["eval", "ppl", "--model", path, "--tokens", "100", "--context-length", "128"]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert main(["eval", "sweep", "--model", path, "--methods", "dense,nope"]) == 2
    assert main(["eval", "ppl", "--model", path, "--text", str(tmp_path / "missing.txt")]) == 2
    assert "Evaluation text file" in capsys.readouterr().err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert main(["eval", "ppl", "--model", path, "--text", str(tmp_path / "latin1.txt")]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a corpus or a file, not both
        main(["eval", "ppl", "--corpus", "jargon", "--text", str(tmp_path / "latin1.txt")])
    with pytest.raises(SystemExit):
        main(["eval", "ppl", "--context-length", "1"])


def test_eval_ppl_and_sweep_end_to_end(make_tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from flashlm.data import corpora

    head = corpora.corpus_text("shakespeare")[:100_000]  # tokenizing all of it takes seconds
    monkeypatch.setitem(corpora._READERS, "shakespeare", lambda: head)
    model = str(_tiny_with_tokenizer(make_tiny_checkpoint, tmp_path))
    common = ["--model", model, "--tokens", "256", "--context-length", "64", "--dtype", "float32"]
    store = ["--store", str(tmp_path / "store"), "--memory-budget", "10MB"]
    assert main(["eval", "ppl", *common, *store, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["corpus"] == "shakespeare" and record["method"] == "dense"
    assert record["windows"] == 4 and record["tokens"] == 4 * 63 and record["mlp_density"] == 1.0
    assert record["perplexity"] > 1

    text = tmp_path / "own.txt"
    text.write_text(head[:20_000], encoding="utf-8")
    assert main(["eval", "ppl", *common, *store, "--text", str(text), "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["text"] == str(text) and "corpus" not in own
    assert own["windows"] == 4 and own["perplexity"] > 1
    assert own["perplexity"] != record["perplexity"]  # the file's start, not the corpus's test split

    assert main(["eval", "ppl", *common, *store, "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"perplexity\s+\d", out) and re.search(r"MLP density\s+100\.0%", out)
    assert "tokens/s" in out

    out_dir = tmp_path / "sweep"
    argv = ["eval", "sweep", *common, *store, "--methods", "dense", "--corpora", "shakespeare"]
    assert main([*argv, "--densities", "0.5", "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "shakespeare" in out and f"wrote {out_dir / 'sweep.csv'}" in out
    assert (out_dir / "sweep.csv").is_file() and (out_dir / "ppl_vs_density.png").is_file()


def test_profile_writes_the_unit_profile_hot_share_reads(make_tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from flashlm.cache.profile import UnitProfile, fitted_digests, profile_key
    from flashlm.config import FlashConfig
    from flashlm.data import corpora
    from flashlm.store import Store

    head = corpora.corpus_text("shakespeare")[:20_000]
    monkeypatch.setitem(corpora._READERS, "shakespeare", lambda: head)
    model = str(_tiny_with_tokenizer(make_tiny_checkpoint, tmp_path))
    store = str(tmp_path / "store")
    argv = ["profile", "--model", model, "--method", "dip-ca", "--density", "0.5", "--store", store]
    assert main([*argv, "--tokens", "32", "--context-length", "16"]) == 0
    out = capsys.readouterr().out
    assert "profiled 32 tokens of shakespeare" in out and "unit-profile-dip-d0.5.safetensors" in out
    opened = Store.open(store)
    key = profile_key(FlashConfig(method="dip", density=0.5))
    profile = UnitProfile.load(
        opened.path, opened.content_sha256, key, fitted_digests(opened.path, ("calibration.json",))
    )
    assert profile.tokens == 32 and len(profile.frequencies) == 2 * opened.num_layers
    assert all(float(f.min()) >= 0 and float(f.max()) <= 1 for f in profile.frequencies.values())
    assert main(["profile", "--model", model, "--method", "dense", "--store", store]) == 2
    assert "nothing to profile" in capsys.readouterr().err
