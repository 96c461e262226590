"""LoRA recovery (`flashlm.training.lora`, `flashlm.store.fuse`): the training-time masks are the streaming
masks, fused stores reproduce the adapter model, bad adapters are refused, and the recipe runs, resumes
after a SIGKILL and runs on two processes under `accelerate launch`."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, save_word_tokenizer, tiny_config
from test_relufy_recipe import CORPUS, _free_port, _require_corpus, _run, run_recipe
from transformers import AutoModelForCausalLM

import flashlm
from flashlm import FlashConfig
from flashlm.cli.main import main as flashlm_main
from flashlm.errors import StoreMismatchError
from flashlm.methods.calibration import Calibration
from flashlm.methods.mlp import open_checkpoint_store
from flashlm.store import Store
from flashlm.store.fuse import (
    ADAPTER_RECORD,
    ADAPTER_WEIGHTS,
    AdapterCorruptError,
    AdapterMismatchError,
)
from flashlm.training.lora import (
    ADAPTER_DIR,
    FUSED_STORE,
    REPORT_NAME,
    TRAIN_DIR,
    LoraOptions,
    MaskedMLP,
    dense_mlps,
    lora_record,
    main,
    mask_mlps,
    save_adapter,
)
from flashlm.training.relufy import target_linears
from flashlm.training.trainer import LOG_NAME, RESULT_NAME, read_log
from flashlm.workflows.fuse import fuse_adapter, fuse_pruned_checkpoint

RECIPE = "flashlm.training.lora"

IDS = torch.arange(3, 40).reshape(1, -1)


def _logits(model: torch.nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _config(**options) -> FlashConfig:
    return FlashConfig(memory_budget="1GB", **options)


@pytest.fixture
def fp32_dir(make_tiny_checkpoint) -> Path:
    return make_tiny_checkpoint("llama", torch.float32)


def _masked(path: Path, config: FlashConfig) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mask_mlps(model, open_checkpoint_store(path, config, progress=False), config)
    return model


def _streamed(path: Path, config: FlashConfig) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32).eval()


def _adapted(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`model` with rank-4 LoRA adapters on the MLP projections, their B matrices random (as trained)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # peft initializes A at random
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=target_linears(model, "mlp"))
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return peft_model.eval()


# ---- the training-time masks ----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["dip", "glu", "up", "gate"])
def test_the_training_masks_are_the_streaming_masks(fp32_dir, method):
    # A forward of many tokens through the streaming module computes each token with its own masks,
    # the masks the training-time module applies to the weights in memory.
    config = _config(method=method, density=0.6, input_density=0.7 if method == "dip" else None)
    masked = _masked(fp32_dir, config)
    assert sum(isinstance(m, MaskedMLP) for m in masked.modules()) == 2
    dense = _logits(AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.float32).eval())
    sparse = _logits(masked)
    assert not torch.allclose(sparse, dense, atol=1e-3)  # the masks do something
    torch.testing.assert_close(sparse, _logits(_streamed(fp32_dir, config)), atol=1e-4, rtol=1e-4)
    with dense_mlps(masked):
        assert torch.equal(_logits(masked), dense)  # the teacher is exactly the dense model
    assert all(m.masking for m in masked.modules() if isinstance(m, MaskedMLP))


@pytest.mark.parametrize("method", ["predictor", "predictor-gate"])
def test_the_predictor_methods_training_masks_are_its_streaming_masks(method, tmp_path):
    from flashlm.predictors import LowRankPredictor, Predictors

    config = tiny_config("llama")
    config.hidden_act = "relu"  # the predictor method needs a ReLU-family activation
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "relu")
    store = flashlm.convert(tmp_path / "relu", tmp_path / "store", progress=False)
    Predictors([LowRankPredictor(store.d_model, store.d_ff, 4) for _ in range(store.num_layers)]).save(store)
    # (predictor-gate splits its budget by a unit profile unless told otherwise)
    options = _config(method=method, density=0.4, store=str(store.path), cache_split="size")
    masked = _masked(tmp_path / "relu", options)
    dense = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "relu", dtype=torch.float32).eval())
    assert not torch.allclose(_logits(masked), dense, atol=1e-3)
    torch.testing.assert_close(
        _logits(masked), _logits(_streamed(tmp_path / "relu", options)), atol=1e-4, rtol=1e-4
    )


def test_at_density_one_the_masked_model_is_the_dense_model(fp32_dir):
    dense = _logits(AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.float32).eval())
    assert torch.equal(_logits(_masked(fp32_dir, _config(method="dip", density=1.0))), dense)


def test_methods_without_a_training_module_are_refused(fp32_dir):
    with pytest.raises(flashlm.errors.ConfigError, match="dip"):
        LoraOptions(output_dir="x", method="dense", density=1.0)


# ---- fusing ------------------------------------------------------------------------------------------


def _adapter(path: Path, tmp_path: Path, config: FlashConfig, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    store = open_checkpoint_store(path, config, progress=False)
    peft_model = _adapted(_masked(path, config), seed)
    options = LoraOptions(output_dir=tmp_path, method=config.method, density=config.density)
    return save_adapter(
        peft_model, tmp_path / f"adapter-{seed}", lora_record(options, store, str(path))
    ), peft_model


def test_a_fused_store_streams_the_adapter_model(fp32_dir, tmp_path):
    config = _config(method="dip", density=0.6, input_density=0.7)
    adapter, peft_model = _adapter(fp32_dir, tmp_path, config)
    expected = _logits(peft_model)
    assert not torch.allclose(expected, _logits(_masked(fp32_dir, config)), atol=1e-3)  # the adapter matters

    store = open_checkpoint_store(fp32_dir, config, progress=False)
    fused = fuse_adapter(store, adapter, tmp_path / "fused.flash", progress=False)
    assert fused.kinds == store.kinds and fused.fingerprint != store.fingerprint
    assert fused.content_sha256 != store.content_sha256
    assert fused.fused_from["adapters"][0]["path"] == str(adapter)
    streamed = _streamed(fp32_dir, _config(method="dip", density=0.6, input_density=0.7, store=fused.path))
    torch.testing.assert_close(_logits(streamed), expected, atol=1e-4, rtol=1e-4)
    # dense streaming of the fused store is peft's merged model
    merged = _logits(
        _adapted(AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.float32)).merge_and_unload()
    )
    torch.testing.assert_close(
        _logits(_streamed(fp32_dir, _config(store=fused.path))), merged, atol=1e-4, rtol=1e-4
    )
    assert Store.open(store.path).content_sha256 == store.content_sha256  # the original is untouched


def test_the_saved_adapter_loads_with_peft(fp32_dir, tmp_path):
    from peft import PeftModel

    adapter, peft_model = _adapter(fp32_dir, tmp_path, _config(method="dip", density=0.6))
    assert not list(tmp_path.glob(".*"))  # the temporary name is gone
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.float32), adapter
    )
    saved = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert saved and all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())


def test_fusing_in_place_keeps_the_checkpoint_match_and_rekeys_what_was_fitted(fp32_dir, tmp_path):
    store_path = tmp_path / "store.flash"
    store = flashlm.store.convert(fp32_dir, store_path, progress=False)
    stale = Calibration(store.content_sha256, "test", 8, [[0.0, 1.0]] * 2, [0.0, 1.0], [[0.0, 1.0]] * 2)
    stale.save(store_path)
    adapter, _ = _adapter(fp32_dir, tmp_path, _config(method="dip", density=0.6, store=store_path))
    fused = fuse_adapter(store_path, adapter, progress=False)
    assert fused.path == store_path and fused.content_sha256 != store.content_sha256
    assert not list(tmp_path.glob(".store.flash*"))
    fingerprint = flashlm.store.SafetensorsSource(fp32_dir).fingerprint()
    fused.check_matches(fingerprint=fingerprint)  # a model loaded from the checkpoint streams it
    carried = Calibration.load(store_path, fused.content_sha256)
    assert carried is not None and carried.measured_on == store.content_sha256
    # anything fitted to the unfused weights no longer matches the fused store
    stale.save(store_path)
    assert Calibration.load(store_path, fused.content_sha256) is None
    with pytest.raises(AdapterMismatchError, match="other weights"):  # and the adapter is fused already
        fuse_adapter(store_path, adapter, tmp_path / "twice.flash", progress=False)


def test_bad_adapters_are_refused_with_what_to_do(fp32_dir, tmp_path):
    config = _config(method="dip", density=0.6)
    adapter, _ = _adapter(fp32_dir, tmp_path, config)
    store = open_checkpoint_store(fp32_dir, config, progress=False)

    def damaged(name: str, change) -> Path:
        copy = tmp_path / f"damaged-{name}"
        shutil.copytree(adapter, copy)
        change(copy)
        return copy

    truncated = damaged(
        "truncated", lambda p: (p / ADAPTER_WEIGHTS).write_bytes((p / ADAPTER_WEIGHTS).read_bytes()[:200])
    )
    without_record = damaged("record", lambda p: (p / ADAPTER_RECORD).unlink())
    for bad in (truncated, without_record):
        with pytest.raises(AdapterCorruptError, match="flashlm train lora"):
            fuse_adapter(store, bad, tmp_path / "never.flash", progress=False)
    other = damaged(
        "other",
        lambda p: (p / ADAPTER_RECORD).write_text(
            json.dumps({**json.loads((p / ADAPTER_RECORD).read_text()), "store_content_sha256": "0" * 64})
        ),
    )
    with pytest.raises(AdapterMismatchError, match="trained on other weights"):
        fuse_adapter(store, other, tmp_path / "never.flash", progress=False)
    assert isinstance(AdapterMismatchError("x"), StoreMismatchError)
    assert not (tmp_path / "never.flash").exists() and not list(tmp_path.glob(".never*"))


# ---- the recipe ------------------------------------------------------------------------------------


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    """A bf16 tiny Llama whose MLPs weigh in its output (weights scaled up from the tiny init), so that
    pruning them moves the logits enough for the adapters to have something to recover."""
    model = build_tiny_model("llama")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".mlp." in name:
                parameter.mul_(6)
    path = tmp_path / "tiny"
    model.to(torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path)
    return path


def _common(model: Path, out: Path, *, steps: int = 6, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        *("--model", str(model), "--out", str(out), "--corpora", CORPUS, "--eval-corpora", CORPUS),
        *("--eval-tokens", "512", "--eval-context", "64", "--seq-len", "32", "--steps", str(steps)),
        *("--checkpoint-every", "3", "--warmup-steps", "0", "--lr", "1e-2", "--rank", "8", "--no-progress"),
        *("--memory-budget", "1GB"),
        *extra,
    ]


def test_the_recipe_trains_fuses_and_measures(tiny_dir, tmp_path, capsys):
    _require_corpus()
    out = tmp_path / "out"
    assert main([*_common(tiny_dir, out, steps=8), "--method", "dip-ca", "--density", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((out / REPORT_NAME).read_text())
    losses = [r["loss"] for r in read_log(out / TRAIN_DIR / LOG_NAME)]
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < losses[0], losses
    assert report["fused"] == str(out / FUSED_STORE) and (out / ADAPTER_DIR / ADAPTER_RECORD).is_file()
    stages = report["measurements"]
    assert list(stages) == ["dense", "sparse", "sparse+lora"]
    for stage in stages.values():
        assert stage[CORPUS]["perplexity"] > 1 and stage[CORPUS]["tokens"] == 8 * 63
    assert stages["sparse"][CORPUS]["mlp_density"] < 0.75
    assert stages["sparse+lora"][CORPUS]["perplexity"] != stages["sparse"][CORPUS]["perplexity"]
    # run again, unchanged: the run is complete, so it only saves and fuses again, replacing its outputs
    argv = [*_common(tiny_dir, out, steps=8), "--method", "dip-ca", "--density", "0.5", "--no-eval"]
    assert main(argv) == 0
    assert len(read_log(out / TRAIN_DIR / LOG_NAME)) == 8 and Store.open(out / FUSED_STORE).fused_from


def test_flashlm_train_lora_and_fuse_on_the_command_line(tiny_dir, tmp_path, capsys):
    _require_corpus()
    out = tmp_path / "out"
    assert flashlm_main(["train", "lora", *_common(tiny_dir, out, steps=3), "--no-eval"]) == 0
    store = tmp_path / "cli.flash"
    assert (
        flashlm_main(
            ["fuse", "--model", str(tiny_dir), "--adapter", str(out / ADAPTER_DIR), "--out", str(store)]
        )
        == 0
    )
    assert f"fused {out / ADAPTER_DIR} into {store}" in capsys.readouterr().out
    assert flashlm_main(["info", str(store)]) == 0
    assert "fused adapter" in capsys.readouterr().out
    assert (
        flashlm_main(
            ["train", "lora", *_common(tiny_dir, tmp_path / "x"), "--method", "dense", "--density", "1"]
        )
        == 2
    )
    assert "LoRA recovery trains under the masks of dip" in capsys.readouterr().err


def test_a_run_killed_with_sigkill_resumes_to_the_uninterrupted_losses(tiny_dir, tmp_path):
    _require_corpus()
    extra = ("--no-eval", "--steps", "9", "--density", "0.5")
    reference = run_recipe(RECIPE, _common(tiny_dir, tmp_path / "a", extra=extra))
    assert reference.returncode == 0, reference.stderr
    killed_dir = tmp_path / "b"
    args = _common(tiny_dir, killed_dir, extra=extra)
    killed = run_recipe(RECIPE, args, kill_at=5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (killed_dir / ADAPTER_DIR).exists()
    resumed = run_recipe(RECIPE, args)
    assert resumed.returncode == 0, resumed.stderr
    a = read_log(tmp_path / "a" / TRAIN_DIR / LOG_NAME)
    b = read_log(killed_dir / TRAIN_DIR / LOG_NAME)
    assert [r["step"] for r in b] == list(range(1, 10))
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-6)
    assert json.loads((killed_dir / TRAIN_DIR / RESULT_NAME).read_text())["start_step"] == 3


def test_two_processes_under_accelerate_launch(tiny_dir, tmp_path):
    _require_corpus()
    accelerate = Path(sys.executable).parent / "accelerate"
    out = tmp_path / "out"
    launch = [
        *(str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"),
        *("--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())),
        *("-m", "flashlm.training.lora"),
    ]
    done = _run([*launch, *_common(tiny_dir, out, extra=("--no-eval", "--steps", "8", "--density", "0.5"))])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / TRAIN_DIR / RESULT_NAME).read_text())
    assert result["num_processes"] == 2
    assert len(result["checksums"]) == 2 and result["checksums"][0] == result["checksums"][1]
    losses = [r["loss"] for r in read_log(out / TRAIN_DIR / LOG_NAME)]
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < losses[0], losses
    assert (out / FUSED_STORE / "manifest.json").is_file()


# ---- a Wanda-pruned model (the Endor method) -----------------------------------------------------------


def _pruned(dense: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Half of every MLP weight of `dense` zeroed at random, saved with a `pruning.json` naming `dense`
    (what `flashlm prune` writes; the pattern does not matter here)."""
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".mlp." in name:
                parameter.mul_(torch.rand(parameter.shape, generator=generator) > 0.5)
    model.to(dtype).save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if (dense / file).is_file():
            shutil.copy(dense / file, out / file)
    (out / "pruning.json").write_text(json.dumps({"method": "wanda", "source": str(dense)}))
    return out


def test_a_fused_pruned_checkpoint_keeps_the_pattern_and_gives_the_adapter_model(fp32_dir, tmp_path):
    from safetensors.torch import load_file

    pruned = _pruned(fp32_dir, tmp_path / "pruned")
    adapter, peft_model = _adapter(pruned, tmp_path, _config(method="endor"))
    expected = _logits(peft_model)
    fused = fuse_pruned_checkpoint(pruned, adapter, tmp_path / "fused")
    before, after = load_file(pruned / "model.safetensors"), load_file(fused / "model.safetensors")
    mlp = [name for name in before if ".mlp." in name]
    assert mlp and all(torch.equal(after[n] == 0, before[n] == 0) for n in mlp)  # the same pattern
    assert not all(torch.equal(after[n], before[n]) for n in mlp)  # and new values
    assert all(torch.equal(after[n], before[n]) for n in before if n not in mlp)
    plain = AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(plain), expected, atol=1e-5, rtol=1e-5)
    endor = _streamed(fused, _config(method="endor"))
    torch.testing.assert_close(_logits(endor), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(FileExistsError, match="new directory"):
        fuse_pruned_checkpoint(pruned, adapter, tmp_path / "fused")


def test_the_recipe_recovers_a_pruned_model_from_its_dense_source(tiny_dir, tmp_path, capsys):
    _require_corpus()
    pruned = _pruned(tiny_dir, tmp_path / "pruned", torch.bfloat16)
    out = tmp_path / "out"
    assert main([*_common(pruned, out, steps=6), "--method", "endor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fused"] == str(out / "model") and report["options"]["density"] == 1.0
    assert json.loads((out / "model" / "pruning.json").read_text())["fused_adapters"][0]["path"] == str(
        out / ADAPTER_DIR
    )
    stages = report["measurements"]
    assert stages["dense"][CORPUS]["perplexity"] != stages["sparse"][CORPUS]["perplexity"]
    losses = [r["loss"] for r in read_log(out / TRAIN_DIR / LOG_NAME)]
    assert sum(losses[-2:]) / 2 < losses[0], losses
