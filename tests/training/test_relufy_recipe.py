"""The relufication recipe (`flashlm.training.relufy`): saving and reloading, the run end to end, the
command lines (`python -m`, `flashlm train relufy`, `accelerate launch` on two processes) and a real
SIGKILL followed by a resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, save_word_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from flashlm.activations import FATReLU, activations, relufy
from flashlm.cli.main import main as flashlm_main
from flashlm.data.corpora import CorpusNotFoundError, corpus_tokens, require
from flashlm.errors import ConfigError, RelufiedCheckpointError
from flashlm.training.activations import ZERO_LEVELS, calibrate_thresholds
from flashlm.training.checkpoints import NotRelufiedError, load_checkpoint, load_relufied
from flashlm.training.data import SAMPLES_NAME, corpus_sequences, evenly_spaced_rows, pack, start_token
from flashlm.training.relufy import (
    CE_WEIGHT,
    MODEL_DIR,
    RECORD_NAME,
    REPORT_NAME,
    THRESHOLDS_NAME,
    TRAIN_DIR,
    RelufyOptions,
    cast_parameters,
    main,
    save_relufied,
)
from flashlm.training.trainer import LOG_NAME, RESULT_NAME, read_log

RECIPE = "flashlm.training.relufy"
CORPUS = "jargon"  # the smallest corpus: tokenizing it with the word tokenizer takes a fraction of a second


def _require_corpus() -> None:
    try:
        require(CORPUS)
    except CorpusNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def tiny_dir(make_tiny_checkpoint, tmp_path) -> Path:
    """A bf16 tiny Llama checkpoint with a word-level tokenizer, in a directory of its own."""
    path = tmp_path / "tiny"
    shutil.copytree(make_tiny_checkpoint("llama"), path)
    save_word_tokenizer(path)
    return path


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids.reshape(1, -1), use_cache=False).logits


def _common(model: Path, out: Path, *, steps: int = 6, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "--model",
        str(model),
        "--out",
        str(out),
        "--corpora",
        CORPUS,
        "--eval-corpora",
        CORPUS,
        "--eval-tokens",
        "512",
        "--eval-context",
        "64",
        "--seq-len",
        "32",
        "--steps",
        str(steps),
        "--checkpoint-every",
        "3",
        "--warmup-steps",
        "0",
        "--lr",
        "1e-2",
        "--no-progress",
        *extra,
    ]


# ---- saving and reloading --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("thresholds", [0.0, [0.05, 0.2]], ids=["relu", "fatrelu"])
def test_the_saved_checkpoint_reloads_with_identical_logits(tmp_path, thresholds, dtype):
    model = build_tiny_model("llama")
    relufy(model, thresholds)
    with torch.no_grad():  # stands for training: every weight moved
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    model = cast_parameters(model, dtype)
    ids = torch.arange(3, 67)
    expected = _logits(model, ids)
    saved = save_relufied(model, tmp_path / "model")
    assert not list(tmp_path.glob(".*"))  # the temporary name is gone

    reloaded = load_relufied(saved)
    assert torch.equal(_logits(reloaded, ids), expected)
    assert torch.equal(_logits(load_checkpoint(saved), ids), expected)  # recognises the record itself
    assert all(isinstance(a.module, FATReLU) for a in activations(reloaded))
    expected_thresholds = [0.0, 0.0] if thresholds == 0.0 else thresholds
    assert [a.module.threshold for a in activations(reloaded)] == pytest.approx(expected_thresholds)
    assert next(reloaded.parameters()).dtype == dtype
    config = json.loads((saved / "config.json").read_text())
    assert config["relufication"]["replaces"] == "silu"
    if thresholds == 0.0:
        # ReLU is in transformers' own table: the checkpoint loads anywhere, with the same logits
        assert config["hidden_act"] == "relu"
        plain = AutoModelForCausalLM.from_pretrained(saved)
        assert torch.equal(_logits(plain, ids), expected)
    else:
        # a thresholded ReLU is not: plain transformers refuses it, saying how to load it, instead of
        # building another model
        assert config["hidden_act"] == "fatrelu"
        with pytest.raises(RelufiedCheckpointError, match=r"load_checkpoint\(path\)"):
            AutoModelForCausalLM.from_pretrained(saved)
    # the weights file holds the architecture's ordinary tensors, nothing more
    from safetensors import safe_open

    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(build_tiny_model("llama").state_dict())
    # saving again replaces the checkpoint only once the new one is complete
    save_relufied(reloaded, saved)
    assert torch.equal(_logits(load_relufied(saved), ids), expected)


def test_load_relufied_refuses_a_checkpoint_it_did_not_write(make_tiny_checkpoint):
    with pytest.raises(NotRelufiedError, match="from_pretrained"):
        load_relufied(make_tiny_checkpoint("llama"))
    plain = load_checkpoint(make_tiny_checkpoint("llama"))  # the loader for either kind
    assert not plain.training and not any(isinstance(a.module, FATReLU) for a in activations(plain))


# ---- the recipe ------------------------------------------------------------------------------------


def test_the_recipe_relufies_trains_saves_and_measures(tiny_dir, tmp_path, capsys):
    _require_corpus()
    out = tmp_path / "out"
    argv = _common(
        tiny_dir,
        out,
        extra=(
            *(
                "--lora-rank",
                "4",
                "--target-zeros",
                "0.8",
                "--teacher-samples",
                "5",
                "--teacher-prompts",
                "start",
            ),
            *("--threshold-ramp", "3", "--json"),
        ),
    )
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((out / REPORT_NAME).read_text())
    assert report["steps"] == 6 and report["reload_exact"] is True
    assert report["options"]["teacher_samples"] == 5
    # reload_exact: the ramp ended at the thresholds the checkpoint records
    assert report["options"]["threshold_ramp"] == 3
    samples = torch.load(out / SAMPLES_NAME, weights_only=True)["rows"]
    assert samples.shape == (5, 32) and report["options"]["teacher_prompts"] == "start"
    assert (samples[:, 0] == start_token(AutoModelForCausalLM.from_pretrained(tiny_dir))).all()
    assert report["options"]["mode"] == "lora" and len(report["thresholds"]) == 2
    stages = report["measurements"]
    assert list(stages) == ["dense", "relufied, not trained", "relufied, trained"]
    for stage in stages.values():
        assert stage[CORPUS]["tokens"] == 8 * 63 and stage[CORPUS]["perplexity"] > 1
        assert len(stage[CORPUS]["zero_fraction_per_layer"]) == 2
    assert stages["dense"][CORPUS]["zero_fraction"] < 0.01  # SiLU is (almost) never exactly zero
    # layer 0 of the untrained model sees the dense model's inputs: its zeros hit the calibrated target
    # (measured on held-out text, the test split, while the thresholds came from the calibration split)
    assert stages["relufied, not trained"][CORPUS]["zero_fraction_per_layer"][0] == pytest.approx(
        0.8, abs=0.1
    )
    log = read_log(out / TRAIN_DIR / LOG_NAME)
    assert [r["step"] for r in log] == list(range(1, 7))
    # the recipe's loss: the distillation KL plus CE_WEIGHT times the next-token cross-entropy
    assert report["options"]["train"]["ce_weight"] == CE_WEIGHT > 0
    for record in log:
        assert record["ce"] > 0 and record["loss"] == pytest.approx(record["kl"] + CE_WEIGHT * record["ce"])
    model = load_relufied(out / MODEL_DIR)
    assert [a.module.threshold for a in activations(model)] == pytest.approx(report["thresholds"])
    assert (out / MODEL_DIR / "tokenizer.json").is_file()
    # run again, unchanged: the run is complete, so it only saves and measures again
    assert main([*argv[:-1], "--no-eval"]) == 0
    assert "reload exact True" in capsys.readouterr().out
    assert len(read_log(out / TRAIN_DIR / LOG_NAME)) == 6


def test_zeros_allocated_by_sensitivity_average_the_target_and_are_kept(tiny_dir, tmp_path, capsys):
    _require_corpus()
    out = tmp_path / "out"
    extra = ("--mode", "full", "--target-zeros", "0.75", "--zero-allocation", "sensitivity", "--no-eval")
    argv = _common(tiny_dir, out, steps=2, extra=extra)
    assert main(argv) == 0
    saved = json.loads((out / THRESHOLDS_NAME).read_text())
    assert saved["zero_allocation"] == "sensitivity" and saved["target_zeros"] == 0.75
    assert saved["levels"] == list(ZERO_LEVELS) and len(saved["costs"]) == len(saved["layer_targets"]) == 2
    assert set(saved["layer_targets"]) <= set(ZERO_LEVELS) and sum(saved["layer_targets"]) / 2 >= 0.75
    assert "zeros per layer by sensitivity" in capsys.readouterr().err
    model = load_relufied(out / MODEL_DIR)
    assert [a.module.threshold for a in activations(model)] == pytest.approx(saved["thresholds"])
    # the uniform allocation of the same target is another choice: it is calibrated anew, not reused
    uniform = _common(tiny_dir, tmp_path / "uniform", steps=2, extra=(*extra[:4], "--no-eval"))
    assert main(uniform) == 0
    recorded = json.loads((tmp_path / "uniform" / THRESHOLDS_NAME).read_text())
    assert recorded["zero_allocation"] == "uniform" and "layer_targets" not in recorded
    shutil.copy(out / THRESHOLDS_NAME, tmp_path / "uniform" / THRESHOLDS_NAME)
    shutil.rmtree(tmp_path / "uniform" / TRAIN_DIR)
    assert main(uniform) == 0
    assert json.loads((tmp_path / "uniform" / THRESHOLDS_NAME).read_text()) == recorded
    with pytest.raises(ConfigError, match="shares out target_zeros"):
        RelufyOptions(
            output_dir=tmp_path / "z", threshold=0.1, target_zeros=None, zero_allocation="sensitivity"
        )
    with pytest.raises(ConfigError, match=r"give target_zeros in \[0.6, 0.9\]"):
        RelufyOptions(output_dir=tmp_path / "z", target_zeros=0.95, zero_allocation="sensitivity")
    with pytest.raises(ConfigError, match=r"zero_allocation must be one of uniform, sensitivity"):
        RelufyOptions(output_dir=tmp_path / "z", zero_allocation="greedy")


def test_thresholds_are_calibrated_on_rows_from_every_source(tiny_dir, tmp_path):
    _require_corpus()
    # a training file after the corpus, unlike it: one word over and over
    text = tmp_path / "repeated.txt"
    text.write_text("the " * 4000, encoding="utf-8")
    out = tmp_path / "out"
    extra = ("--mode", "full", "--target-zeros", "0.8", "--train-text", str(text), "--no-eval")
    assert main(_common(tiny_dir, out, steps=1, extra=extra)) == 0
    recorded = json.loads((out / THRESHOLDS_NAME).read_text())["thresholds"]

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    rows = corpus_sequences((CORPUS,), AutoTokenizer.from_pretrained(tiny_dir), 32, texts=(text,))
    tokens = RelufyOptions(output_dir=out).threshold_tokens
    first = rows.reshape(-1)[:tokens]  # the corpus's first rows alone: the file would count for nothing
    spread = evenly_spaced_rows(rows, tokens // 32).reshape(-1)
    assert (rows[-1] == rows[-1, 0]).all() and (spread[-32:] == rows[-1, 0]).all()
    calibrate = {"context_length": 32, "num_tokens": tokens}
    assert recorded == calibrate_thresholds(model, spread, 0.8, **calibrate)
    assert recorded != calibrate_thresholds(model, first, 0.8, **calibrate)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_mlp_targets_train_the_mlp_projections_alone(tiny_dir, tmp_path, mode):
    _require_corpus()
    out = tmp_path / "out"
    extra = ("--mode", mode, "--targets", "mlp", "--lora-rank", "4", "--save-dtype", "float32", "--no-eval")
    assert main(_common(tiny_dir, out, steps=3, extra=extra)) == 0
    source = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()
    trained = load_relufied(out / MODEL_DIR).state_dict()
    assert trained.keys() == source.keys()
    mlp = [name for name in source if ".mlp." in name]
    assert mlp and len(mlp) < len(source)
    for name, weight in source.items():
        if name in mlp:
            assert not torch.equal(trained[name], weight), f"{name} did not train"
        else:
            assert torch.equal(trained[name], weight), f"{name} changed"


def test_flashlm_train_relufy_on_the_command_line(tiny_dir, tmp_path, capsys):
    _require_corpus()
    out = tmp_path / "out"
    text = tmp_path / "domain.txt"
    text.write_text("the and to of I you a my in is " * 10, encoding="utf-8")  # 100 tokens: 3 rows of 32
    argv = ["train", "relufy", *_common(tiny_dir, out, steps=3), "--activation", "relu", "--mode", "full"]
    assert flashlm_main([*argv, "--train-text", str(text), "--no-eval"]) == 0
    printed = capsys.readouterr()
    assert "reload exact True" in printed.out and "relu" in printed.out
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    rows = len(pack(corpus_tokens(CORPUS, tokenizer, split="calibration"), 32)) + 3
    assert f"training on {rows} sequences of 32 tokens ({CORPUS}, {text})" in printed.err
    assert json.loads((out / MODEL_DIR / RECORD_NAME).read_text())["options"]["train_texts"] == [str(text)]
    config = json.loads((out / MODEL_DIR / "config.json").read_text())
    assert config["hidden_act"] == "relu" and config["relufication"]["thresholds"] == [0.0, 0.0]
    # a bad combination is refused before anything loads, with what to do
    assert (
        flashlm_main(
            ["train", "relufy", *_common(tiny_dir, tmp_path / "x"), "--mode", "full", "--teacher", "shared"]
        )
        == 2
    )
    assert "teacher='copy'" in capsys.readouterr().err
    for bad, says in (
        (("--threshold-ramp", "7"), "longer than training"),
        (("--activation", "relu", "--threshold-ramp", "2"), "no threshold to ramp"),
        (("--activation", "relu", "--zero-allocation", "sensitivity"), "shares out target_zeros"),
    ):
        assert flashlm_main(["train", "relufy", *_common(tiny_dir, tmp_path / "y"), *bad]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "y").exists()  # refused before anything was written
    with pytest.raises(ConfigError, match=r"teacher_prompts must be one of \('rows', 'start'\), got 'bos'"):
        RelufyOptions(output_dir=tmp_path / "z", teacher_prompts="bos")


# ---- processes ---------------------------------------------------------------------------------------


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=env or os.environ.copy(), timeout=300)


KILLED_CHILD = """
import importlib, os, signal, sys
recipe = importlib.import_module(sys.argv[1])

def kill(step, record):
    if step == int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind, as a crash or an OOM kill

recipe.run(*recipe.options_from_args(recipe.build_parser().parse_args(sys.argv[2:])), on_step=kill)
"""


def run_recipe(module: str, args: list[str], *, kill_at: int | None = None) -> subprocess.CompletedProcess:
    """Run the recipe `module` (`python -m module args`) in a new process; with `kill_at`, SIGKILL it once
    step `kill_at` is done."""
    if kill_at is None:
        return _run([sys.executable, "-m", module, *args])
    return _run(
        [sys.executable, "-c", KILLED_CHILD, module, *args], env={**os.environ, "KILL_AT": str(kill_at)}
    )


def test_a_run_killed_with_sigkill_resumes_to_the_uninterrupted_losses(tiny_dir, tmp_path):
    _require_corpus()
    # full fine-tune and the CE term: a loss that moves a lot, so any divergence would show
    # the thresholds ramp up over 8 steps: the resumed run must continue their schedule, not restart it
    extra = ("--mode", "full", "--ce-weight", "1", "--no-eval", "--steps", "9", "--threshold-ramp", "8")
    reference = run_recipe(RECIPE, _common(tiny_dir, tmp_path / "a", extra=extra))
    assert reference.returncode == 0, reference.stderr

    killed_dir = tmp_path / "b"
    args = _common(tiny_dir, killed_dir, extra=extra)
    killed = run_recipe(RECIPE, args, kill_at=5)  # after checkpoint 3, before checkpoint 6
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [r["step"] for r in read_log(killed_dir / TRAIN_DIR / LOG_NAME)] == [1, 2, 3, 4, 5]
    assert not (killed_dir / MODEL_DIR).exists()

    resumed = run_recipe(RECIPE, args)
    assert resumed.returncode == 0, resumed.stderr
    a = read_log(tmp_path / "a" / TRAIN_DIR / LOG_NAME)
    b = read_log(killed_dir / TRAIN_DIR / LOG_NAME)
    assert [r["step"] for r in b] == list(range(1, 10))
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-6)
    assert json.loads((killed_dir / TRAIN_DIR / RESULT_NAME).read_text())["start_step"] == 3
    ids = torch.arange(3, 35)
    assert torch.equal(
        _logits(load_relufied(killed_dir / MODEL_DIR), ids),
        _logits(load_relufied(tmp_path / "a" / MODEL_DIR), ids),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_two_processes_under_accelerate_launch(tiny_dir, tmp_path, mode):
    _require_corpus()
    accelerate = Path(sys.executable).parent / "accelerate"  # accelerate is a dependency: its CLI is there
    out = tmp_path / "out"
    launch = [
        str(accelerate),
        "launch",
        "--multi_gpu",  # on a machine without CUDA: torchrun processes, which the trainer runs on CPU (gloo)
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        "-m",
        "flashlm.training.relufy",
    ]
    extra = ("--mode", mode, "--ce-weight", "1", "--no-eval", "--steps", "8", "--lora-rank", "8")
    extra += ("--mixed-precision", "auto")  # measured on the main process, one choice for both
    done = _run([*launch, *_common(tiny_dir, out, extra=extra)])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / TRAIN_DIR / RESULT_NAME).read_text())
    assert result["num_processes"] == 2
    assert len(result["checksums"]) == 2 and result["checksums"][0] == result["checksums"][1]
    losses = [r["loss"] for r in read_log(out / TRAIN_DIR / LOG_NAME)]
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < 0.8 * losses[0], losses
    assert result["tokens_per_step"] == 2 * 4 * 32  # two processes of batch 4 per step
    assert "reload exact True" in done.stdout and done.stdout.count("reload exact") == 1  # main process only
    assert done.stdout.count("mixed precision auto:") == 1
    used = json.loads((out / REPORT_NAME).read_text())["options"]["mixed_precision_used"]
    assert f"mixed precision auto: {used}" in done.stdout
