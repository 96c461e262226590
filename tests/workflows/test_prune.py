"""Wanda pruning (`flashlm.workflows.prune`): masks, calibration hooks, in-place pruning, checkpoints, CLI."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import build_tiny_model, save_word_tokenizer
from torch import nn

from flashlm.cli.main import build_parser, main
from flashlm.errors import ConfigError
from flashlm.workflows.prune import (
    PRUNING_FILE,
    WandaStats,
    calibration_windows,
    collect_input_norms,
    decoder_linears,
    prune_checkpoint,
    prune_model,
    resolve_pattern,
    wanda_mask,
)

ARCHS = ["llama", "qwen2", "opt", "phi3", "falcon", "gemma3"]
# Linears per decoder layer: attention projections + MLP projections.
LINEARS_PER_LAYER = {"llama": 7, "qwen2": 7, "opt": 6, "phi3": 4, "falcon": 4, "gemma3": 7}
CONTEXT = 32


def _calibration_ids(model: nn.Module, windows: int = 4, seed: int = 0) -> torch.Tensor:
    vocab = model.get_input_embeddings().num_embeddings
    return torch.randint(3, vocab, (windows * CONTEXT,), generator=torch.Generator().manual_seed(seed))


def _other_params(model: nn.Module, linears: dict[str, nn.Linear]) -> dict[str, torch.Tensor]:
    """Every parameter that is not a decoder linear's weight (embeddings, norms, biases, LM head)."""
    weights = {f"{name}.weight" for name in linears}
    return {name: p.detach().clone() for name, p in model.named_parameters() if name not in weights}


# ---- which linears --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_linears_are_the_layers_linears(arch):
    model = build_tiny_model(arch)
    linears = decoder_linears(model)
    layers = model.config.get_text_config().num_hidden_layers
    assert len(linears) == layers * LINEARS_PER_LAYER[arch]
    assert all(isinstance(module, nn.Linear) for module in linears.values())
    everything = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    left_out = everything - set(linears)
    # Only the LM head and (Gemma 3) the vision tower and its projector stay out.
    assert all("lm_head" in name or "vision" in name or "projector" in name for name in left_out)
    assert any("lm_head" in name for name in left_out)
    assert not any("embed" in name or "lm_head" in name or "vision" in name for name in linears)


# ---- masks ----------------------------------------------------------------------------------------


def _reference_mask(weight, norms, sparsity):
    """Direct Wanda: per row, keep the top cols - round(cols * s) of |W| * ||X||."""
    score = weight.abs() * norms
    keep = weight.shape[1] - round(weight.shape[1] * sparsity)
    mask = torch.zeros_like(weight, dtype=torch.bool)
    mask.scatter_(1, torch.topk(score, keep, dim=1).indices, True)
    return mask


def _reference_n_m(weight, norms, n, m):
    score = (weight.abs() * norms).view(weight.shape[0], -1, m)
    mask = torch.zeros_like(score, dtype=torch.bool)
    mask.scatter_(2, torch.topk(score, n, dim=2).indices, True)
    return mask.view_as(weight)


@pytest.mark.parametrize("sparsity", [0.0, 0.25, 0.5, 0.6, 0.9])
def test_wanda_mask_matches_direct_score(sparsity):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(12, 20, generator=generator)
    norms = torch.rand(20, generator=generator) * 3
    mask = wanda_mask(weight, norms, sparsity)
    assert mask.dtype == torch.bool and mask.shape == weight.shape
    assert torch.equal(mask, _reference_mask(weight, norms, sparsity))
    assert (~mask).sum(1).tolist() == [round(20 * sparsity)] * 12


def test_wanda_mask_uses_the_input_norms():
    # Column 0 has the largest weights but a tiny norm: Wanda prunes it, magnitude pruning would not.
    weight = torch.tensor([[4.0, 1.0, 1.5, 2.0]])
    norms = torch.tensor([0.1, 1.0, 1.0, 1.0])
    assert wanda_mask(weight, norms, 0.5).tolist() == [[False, False, True, True]]


@pytest.mark.parametrize("n_m", [(2, 4), (1, 4), (3, 8)])
def test_wanda_mask_n_m_matches_direct_score(n_m):
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(6, 16, generator=generator)
    norms = torch.rand(16, generator=generator)
    mask = wanda_mask(weight, norms, n_m=n_m)
    assert torch.equal(mask, _reference_n_m(weight, norms, *n_m))
    assert (mask.view(6, -1, n_m[1]).sum(-1) == n_m[0]).all()


def test_wanda_mask_ties_keep_the_lower_columns():
    weight = torch.ones(3, 8, dtype=torch.bfloat16)
    norms = torch.ones(8)
    assert wanda_mask(weight, norms, 0.5)[:, :4].all() and not wanda_mask(weight, norms, 0.5)[:, 4:].any()
    mask = wanda_mask(weight, norms, n_m=(2, 4))
    assert mask.tolist() == [[True, True, False, False] * 2] * 3


def test_wanda_mask_in_chunks_equals_one_pass(monkeypatch):
    import flashlm.workflows.prune as prune

    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 24, generator=generator)
    norms = torch.rand(24, generator=generator)
    whole = wanda_mask(weight, norms, 0.5)
    monkeypatch.setattr(prune, "_SCORE_CHUNK", 50)  # two rows at a time
    assert torch.equal(wanda_mask(weight, norms, 0.5), whole)


@pytest.mark.parametrize(
    ("sparsity", "n_m"),
    [
        (1.0, None),
        (-0.1, None),
        (math.nan, None),
        (True, None),
        ("0.5", None),
        (None, (4, 2)),
        (None, (2, 2)),
        (None, (0, 4)),
        (None, (2,)),
        (None, "2:4"),
        (None, (2.0, 4)),
        (0.3, (2, 4)),
    ],
)
def test_bad_arguments_raise_config_error(sparsity, n_m):
    with pytest.raises(ConfigError):
        resolve_pattern(sparsity, n_m)
    with pytest.raises(ConfigError):
        wanda_mask(torch.randn(2, 8), torch.ones(8), sparsity, n_m)


def test_pattern_defaults():
    assert resolve_pattern() == (0.5, None)
    assert resolve_pattern(0.3) == (0.3, None)
    assert resolve_pattern(n_m=(2, 4)) == (0.5, (2, 4))
    assert resolve_pattern(0.5, (2, 4)) == (0.5, (2, 4))


def test_wanda_mask_shape_errors():
    with pytest.raises(ConfigError, match="multiple of 4"):
        wanda_mask(torch.randn(2, 6), torch.ones(6), n_m=(2, 4))
    with pytest.raises(ConfigError, match="one norm per input channel"):
        wanda_mask(torch.randn(2, 6), torch.ones(5), 0.5)
    with pytest.raises(ConfigError, match="2-D"):
        wanda_mask(torch.randn(6), torch.ones(6), 0.5)


# ---- calibration ----------------------------------------------------------------------------------


def test_hook_norms_equal_direct_norms():
    model = build_tiny_model("llama")
    linears = decoder_linears(model)
    windows = calibration_windows(_calibration_ids(model, 3), context_length=CONTEXT, num_windows=3)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    handles = [
        linear.register_forward_pre_hook(lambda _m, args, name=name: seen[name].append(args[0].detach()))
        for name, linear in linears.items()
    ]
    try:
        stats = collect_input_norms(model, windows, progress=False)
    finally:
        for handle in handles:
            handle.remove()
    norms = stats.norms()
    for name, linear in linears.items():
        inputs = torch.cat([x.reshape(-1, linear.in_features) for x in seen[name]]).double()
        assert inputs.shape[0] == 3 * CONTEXT == stats.tokens[name]
        torch.testing.assert_close(norms[name].double(), inputs.square().sum(0).sqrt(), rtol=1e-5, atol=1e-6)


def test_hooks_are_removed_after_calibration_and_on_error():
    model = build_tiny_model("qwen2")
    linears = decoder_linears(model)
    windows = calibration_windows(_calibration_ids(model), context_length=CONTEXT, num_windows=4)
    collect_input_norms(model, windows, progress=False)
    assert all(not linear._forward_pre_hooks for linear in linears.values())

    calls = []

    def explode(module, args):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("boom")

    victim = next(iter(linears.values()))
    handle = victim.register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        collect_input_norms(model, windows, progress=False)
    handle.remove()
    assert all(not linear._forward_pre_hooks for linear in linears.values())
    assert not model.training


def test_stats_without_tokens_raise():
    model = build_tiny_model("llama")
    with pytest.raises(ConfigError, match="saw no calibration token"):
        WandaStats(decoder_linears(model)).norms()


def test_calibration_windows_spread_and_checks():
    ids = torch.arange(10 * 8)
    windows = calibration_windows(ids, context_length=8, num_windows=3)
    assert windows[:, 0].tolist() == [0, 32, 72]  # windows 0, 4 (4.5 rounds half to even) and 9
    assert torch.equal(calibration_windows(ids, context_length=8, num_windows=10).flatten(), ids)
    with pytest.raises(ConfigError, match="at most 10 windows"):
        calibration_windows(ids, context_length=8, num_windows=11)
    with pytest.raises(ConfigError):
        calibration_windows(ids.float(), context_length=8, num_windows=1)
    with pytest.raises(ConfigError):
        calibration_windows(ids, context_length=1, num_windows=1)


# ---- pruning a model ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sparsity", [0.5, 0.3])
def test_prune_model_exact_row_sparsity(arch, sparsity):
    model = build_tiny_model(arch)
    linears = decoder_linears(model)
    assert all((linear.weight != 0).all() for linear in linears.values())
    before = _other_params(model, linears)
    dtypes = {name: linear.weight.dtype for name, linear in linears.items()}

    report = prune_model(
        model,
        _calibration_ids(model),
        sparsity=sparsity,
        context_length=CONTEXT,
        num_windows=4,
        progress=False,
    )

    for name, linear in linears.items():
        rows, cols = linear.weight.shape
        zeros = (linear.weight == 0).sum(1)
        assert zeros.tolist() == [round(cols * sparsity)] * rows, name
        assert linear.weight.dtype == dtypes[name]
        assert report.linears[name].sparsity == pytest.approx(round(cols * sparsity) / cols)
    for name, value in _other_params(model, linears).items():
        assert torch.equal(value, before[name]), f"{name} changed"
    assert set(report.linears) == set(linears)
    assert report.achieved_sparsity == pytest.approx(sparsity, abs=0.02)
    assert report.tokens == 4 * CONTEXT and report.windows == 4 and report.n_m is None


@pytest.mark.parametrize("arch", ARCHS)
def test_prune_model_2_4(arch):
    model = build_tiny_model(arch)
    linears = decoder_linears(model)
    before = _other_params(model, linears)
    report = prune_model(
        model, _calibration_ids(model), n_m=(2, 4), context_length=CONTEXT, num_windows=4, progress=False
    )
    for name, linear in linears.items():
        groups = (linear.weight != 0).view(linear.out_features, -1, 4).sum(-1)
        assert (groups == 2).all(), name
    for name, value in _other_params(model, linears).items():
        assert torch.equal(value, before[name])
    assert report.achieved_sparsity == 0.5 and report.n_m == (2, 4) and report.sparsity == 0.5


def test_prune_model_mask_is_wanda_of_the_dense_activations():
    model = build_tiny_model("llama")
    linears = decoder_linears(model)
    dense = {name: linear.weight.detach().clone() for name, linear in linears.items()}
    ids = _calibration_ids(model)
    windows = calibration_windows(ids, context_length=CONTEXT, num_windows=4)
    norms = collect_input_norms(model, windows, progress=False).norms()
    prune_model(model, ids, sparsity=0.5, context_length=CONTEXT, num_windows=4, progress=False)
    for name, linear in linears.items():
        expected = dense[name] * _reference_mask(dense[name], norms[name], 0.5)
        assert torch.equal(linear.weight, expected), name


def test_prune_model_bf16_keeps_dtype():
    model = build_tiny_model("llama", torch.bfloat16)
    prune_model(model, _calibration_ids(model), context_length=CONTEXT, num_windows=2, progress=False)
    for linear in decoder_linears(model).values():
        assert linear.weight.dtype == torch.bfloat16
        assert ((linear.weight == 0).sum(1) == linear.in_features // 2).all()


def test_prune_model_rejects_before_changing_anything():
    model = build_tiny_model("llama")  # hidden 64, intermediate 96: neither divisible by 5
    state = {name: p.detach().clone() for name, p in model.state_dict().items()}
    with pytest.raises(ConfigError, match="not divisible by 5"):
        prune_model(model, _calibration_ids(model), n_m=(2, 5), context_length=CONTEXT, num_windows=4)
    with pytest.raises(ConfigError, match="fewer than the 5"):
        prune_model(model, _calibration_ids(model), context_length=CONTEXT, num_windows=5)
    with pytest.raises(ConfigError, match="vocabulary"):
        prune_model(model, torch.full((CONTEXT,), 10_000), context_length=CONTEXT, num_windows=1)
    with pytest.raises(ConfigError):
        prune_model(model, _calibration_ids(model), sparsity=1.5, context_length=CONTEXT, num_windows=4)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name])


# ---- pruning a checkpoint -------------------------------------------------------------------------


@pytest.fixture
def tiny_with_tokenizer(make_tiny_checkpoint, tmp_path):
    """A copy of the tiny bf16 llama checkpoint with a word-level tokenizer whose ids fit its vocabulary."""
    path = tmp_path / "tiny"
    shutil.copytree(make_tiny_checkpoint("llama"), path)
    save_word_tokenizer(path)
    return path


def test_prune_checkpoint_writes_a_loadable_pruned_checkpoint(tiny_with_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "pruned"
    report = prune_checkpoint(
        tiny_with_tokenizer, out, sparsity=0.5, num_windows=2, context_length=64, progress=False
    )
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".pruned.*"))  # no temporary directory left behind
    AutoTokenizer.from_pretrained(out)

    record = json.loads((out / PRUNING_FILE).read_text())
    assert record["method"] == "wanda" and record["sparsity"] == 0.5 and record["n_m"] is None
    assert record["corpus"] == "shakespeare" and record["windows"] == 2 and record["context_length"] == 64
    assert record["achieved_sparsity"] == pytest.approx(report.achieved_sparsity)
    assert record["source"] == str(tiny_with_tokenizer.resolve()) and record["flashlm_version"]

    source = AutoModelForCausalLM.from_pretrained(tiny_with_tokenizer)
    pruned = AutoModelForCausalLM.from_pretrained(out)
    assert pruned.dtype == torch.bfloat16
    pruned_linears = decoder_linears(pruned)
    for name, linear in pruned_linears.items():
        assert ((linear.weight == 0).sum(1) == linear.in_features // 2).all(), name
        kept = linear.weight != 0
        assert torch.equal(linear.weight[kept], source.get_submodule(name).weight[kept])
    assert torch.equal(pruned.lm_head.weight, source.lm_head.weight)
    assert torch.equal(pruned.get_input_embeddings().weight, source.get_input_embeddings().weight)


def test_prune_checkpoint_out_dir_rules(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "pruned"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="already exists"):
        prune_checkpoint(tiny_with_tokenizer, out, num_windows=1, context_length=32, progress=False)
    assert (out / "keep.txt").is_file()
    for target in (tiny_with_tokenizer, tiny_with_tokenizer.parent):  # the source, or a folder holding it
        with pytest.raises(ConfigError, match="source checkpoint"):
            prune_checkpoint(tiny_with_tokenizer, target, overwrite=True, num_windows=1, progress=False)
    assert (tiny_with_tokenizer / "config.json").is_file()

    prune_checkpoint(
        tiny_with_tokenizer, out, n_m=(2, 4), num_windows=1, context_length=32, overwrite=True, progress=False
    )
    assert not (out / "keep.txt").exists()
    assert json.loads((out / PRUNING_FILE).read_text())["n_m"] == [2, 4]


def test_prune_checkpoint_needs_a_tokenizer_and_a_checkpoint(make_tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="tokenizer"):
        prune_checkpoint(make_tiny_checkpoint("llama"), tmp_path / "out", num_windows=1, progress=False)
    with pytest.raises(ConfigError, match=r"config\.json"):
        prune_checkpoint(tmp_path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---- command line ---------------------------------------------------------------------------------


def test_cli_prune(tiny_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "pruned"
    args = [str(tiny_with_tokenizer), str(out), "--windows", "2", "--context-length", "64"]
    assert main(["prune", *args, "--n-m", "2:4"]) == 0
    text = capsys.readouterr().out
    assert "achieved sparsity 50.00%" in text and str(out) in text
    assert json.loads((out / PRUNING_FILE).read_text())["n_m"] == [2, 4]

    assert main(["prune", *args]) == 2  # exists
    assert "--overwrite" in capsys.readouterr().err
    assert main(["prune", *args, "--sparsity", "0.25", "--overwrite"]) == 0
    assert "achieved sparsity 25.00%" in capsys.readouterr().out
    assert main(["prune", *args, "--sparsity", "1.5", "--overwrite"]) == 2
    assert "sparsity must be" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["2-4", "4:2", "2:4:8", "a:b", "0:4"])
def test_cli_prune_bad_n_m_is_an_argparse_error(text, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["prune", str(tmp_path / "out"), "--n-m", text])
    assert info.value.code == 2
    assert "--n-m" in capsys.readouterr().err


def test_cli_prune_model_defaults_to_the_embedded_model():
    args = build_parser().parse_args(["prune", "out"])
    assert args.model is None and args.out == "out" and args.sparsity is None and args.n_m is None
    args = build_parser().parse_args(["prune", "src", "out", "--n-m", "2:4"])
    assert args.model == "src" and args.out == "out" and args.n_m == (2, 4)


# ---- SmolLM2 --------------------------------------------------------------------------------------
