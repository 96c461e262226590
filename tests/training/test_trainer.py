"""The distillation trainer (`flashlm.training.trainer`): loss, learning, checkpoints, kill and resume."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers
from conftest import build_tiny_model, save_word_tokenizer, tiny_config
from torch import nn

from flashlm.activations import relufy
from flashlm.data.corpora import CorpusNotFoundError, corpus_tokens
from flashlm.errors import ConfigError
from flashlm.training.activations import dense_activations
from flashlm.training.data import (
    SAMPLE_PROMPT_TOKENS,
    SequenceSampler,
    corpus_sequences,
    evenly_spaced_rows,
    pack,
    start_token,
    teacher_samples,
)
from flashlm.training.lora import LoraReport
from flashlm.training.lora import format_report as lora_report_table
from flashlm.training.relufy import RelufyReport
from flashlm.training.relufy import format_report as relufy_report_table
from flashlm.training.trainer import (
    LOG_NAME,
    RESULT_NAME,
    STATE_NAME,
    ModelTeacher,
    ResumeMismatchError,
    TrainConfig,
    Trainer,
    bf16_autocast_pays,
    checkpoint_dirs,
    distillation_loss,
    hidden_state_loss,
    make_accelerator,
    read_log,
)


def _sequences(rows: int = 48, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (rows, length), generator=torch.Generator().manual_seed(seed))


def _student(seed: int = 1, dropout: float = 0.0) -> nn.Module:
    config = tiny_config("llama")
    config.attention_dropout = dropout
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


class Killed(Exception):
    """Stands for a SIGKILL between two checkpoints (the subprocess test sends a real one)."""


# ---- the loss -------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distillation_loss_is_zero_for_the_teacher_and_positive_otherwise(temperature):
    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(2, 5, 11, generator=generator) * 3
    loss, parts = distillation_loss(teacher.clone(), teacher, temperature=temperature)
    assert loss.item() == 0.0 and parts == {"kl": 0.0}
    student = teacher + torch.randn(2, 5, 11, generator=generator)
    loss, parts = distillation_loss(student, teacher, temperature=temperature)
    assert loss.item() > 0 and parts["kl"] == pytest.approx(loss.item())
    # the KL of the definition, T² · mean over tokens of Σ p (log p - log q)
    p = torch.softmax(teacher / temperature, -1)
    q = torch.softmax(student / temperature, -1)
    expected = temperature**2 * (p * (p.log() - q.log())).sum(-1).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    # shifting every logit of a token by a constant changes no distribution
    assert distillation_loss(teacher + 5.0, teacher, temperature=temperature)[0].item() == pytest.approx(
        0, abs=1e-5
    )


def test_distillation_loss_adds_the_next_token_cross_entropy():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 9, generator=generator)
    ids = torch.randint(0, 9, (2, 6), generator=generator)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 9), ids[:, 1:].reshape(-1))
    loss, parts = distillation_loss(logits, logits, ids, ce_weight=0.5)
    assert parts["kl"] == 0 and parts["ce"] == pytest.approx(ce.item())
    assert loss.item() == pytest.approx(0.5 * ce.item())
    alone, parts = distillation_loss(logits, None, ids)  # no teacher: the cross-entropy alone
    assert alone.item() == pytest.approx(ce.item()) and "kl" not in parts
    with pytest.raises(ConfigError, match="shape"):
        distillation_loss(logits, logits[..., :5])
    with pytest.raises(ConfigError, match="input ids"):
        distillation_loss(logits, None)


# ---- data -------------------------------------------------------------------------------------------


def test_pack_and_the_sampler_are_deterministic_and_disjoint():
    rows = pack(torch.arange(100), 16)
    assert rows.shape == (6, 16) and torch.equal(rows.flatten(), torch.arange(96))
    sampler = SequenceSampler(10, batch_size=2, accumulation=2, world=2, seed=3)
    step = [sampler.rows(0, m, r) for m in range(2) for r in range(2)]
    flat = [i for rows in step for i in rows]
    assert len(set(flat)) == 8  # one step's micro-batches and ranks never share a row
    again = SequenceSampler(10, batch_size=2, accumulation=2, world=2, seed=3)
    assert all(
        again.rows(s, m, r) == sampler.rows(s, m, r) for s in (5, 0, 7) for m in (0, 1) for r in (0, 1)
    )
    epoch = [i for s in range(5) for m in range(2) for r in range(2) for i in sampler.rows(s, m, r)][:10]
    assert sorted(epoch) == list(range(10))  # every row once per epoch
    with pytest.raises(ConfigError):
        pack(torch.arange(10), 1)


def test_evenly_spaced_rows_span_first_to_last():
    rows = torch.arange(10)[:, None].expand(10, 3)
    assert evenly_spaced_rows(rows, 4)[:, 0].tolist() == [0, 3, 6, 9]
    assert evenly_spaced_rows(rows, 1)[:, 0].tolist() == [0]
    assert evenly_spaced_rows(rows, 10) is rows and evenly_spaced_rows(rows, 25) is rows
    # two streams packed back to back, 8 rows and 2: a spaced sample holds both, the first rows only one
    assert evenly_spaced_rows(torch.tensor([0] * 8 + [1] * 2)[:, None], 3)[:, 0].tolist() == [0, 0, 1]
    for count in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="count must be an int >= 1"):
            evenly_spaced_rows(rows, count)


def test_text_files_train_whole_after_the_corpora_and_bad_ones_are_refused(tmp_path):
    save_word_tokenizer(tmp_path / "tok")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    words = ["the", "and", "to", "of", "I", "you", "a", "my", "in", "is", "that", "not", "me", "it", "his"]
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text(" ".join(words[i % len(words)] for i in range(70)), encoding="utf-8")
    second.write_text(" ".join(reversed(words)) * 3, encoding="utf-8")
    ids = [tokenizer(p.read_text(), add_special_tokens=False)["input_ids"] for p in (first, second)]
    rows = corpus_sequences((), tokenizer, 16, texts=(first, str(second)))
    # each file packed on its own (70 tokens: 4 rows; the second's 45: 2), no row spanning the two
    assert torch.equal(rows, torch.cat([pack(torch.tensor(i), 16) for i in ids]))
    assert rows.shape == (6, 16) and torch.equal(rows[0], torch.tensor(ids[0][:16]))
    try:
        jargon = corpus_sequences(("jargon",), tokenizer, 16)
    except CorpusNotFoundError:
        jargon = None
    if jargon is not None:  # the corpora's calibration rows first, then the files'
        both = corpus_sequences(("jargon",), tokenizer, 16, texts=(first,))
        assert torch.equal(
            both, torch.cat([pack(corpus_tokens("jargon", tokenizer, split="calibration"), 16), rows[:4]])
        )
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 the and".encode("latin-1"))
    for texts, message in (
        ((tmp_path / "missing.txt",), "missing.txt does not exist"),
        ((tmp_path,), "is a directory"),
        ((tmp_path / "latin1.txt",), "not UTF-8 text \\(byte 3\\)"),
        ((), "Name at least one corpus"),
    ):
        with pytest.raises(ConfigError, match=message):
            corpus_sequences((), tokenizer, 16, texts=texts)
    with pytest.raises(ConfigError, match=r"second.txt hold fewer than seq_len=64 tokens"):
        corpus_sequences((), tokenizer, 64, texts=(second,))


def test_teacher_samples_continue_real_prompts_and_are_cached(tmp_path, monkeypatch):
    teacher = build_tiny_model("llama")
    eos = teacher.generation_config.eos_token_id

    def prefer_the_end(module, inputs, logits):  # unsuppressed, every sampled token would be the end
        logits[..., eos] += 30.0

    teacher.lm_head.register_forward_hook(prefer_the_end)
    sequences = torch.randint(3, 100, (5, 24), generator=torch.Generator().manual_seed(0))
    cache = tmp_path / "samples.pt"
    rows = teacher_samples(teacher, sequences, 7, seed=1, source="tiny", cache=cache)
    assert rows.shape == (7, 24) and rows.dtype == torch.int64
    prompts = {tuple(r[:SAMPLE_PROMPT_TOKENS].tolist()) for r in sequences}
    assert all(tuple(r[:SAMPLE_PROMPT_TOKENS].tolist()) in prompts for r in rows)
    assert len({tuple(r[:SAMPLE_PROMPT_TOKENS].tolist()) for r in rows}) == 5  # every row prompts once first
    assert not (rows[:, SAMPLE_PROMPT_TOKENS:] == eos).any()  # no early end, so no padding
    assert not torch.equal(
        rows, teacher_samples(teacher, sequences, 7, seed=2, source="tiny", cache=tmp_path / "b")
    )

    def refuse(*args, **kwargs):
        raise AssertionError("sampled again instead of reading the cache")

    monkeypatch.setattr(teacher, "generate", refuse)
    assert torch.equal(teacher_samples(teacher, sequences, 7, seed=1, source="tiny", cache=cache), rows)
    with pytest.raises(AssertionError, match="sampled again"):  # another teacher: the cache does not fit
        teacher_samples(teacher, sequences, 7, seed=1, source="other", cache=cache)
    assert teacher_samples(teacher, sequences, 0, seed=1, source="tiny", cache=cache).shape == (0, 24)
    with pytest.raises(ConfigError, match="seq_len > 16"):
        teacher_samples(teacher, sequences[:, :16], 3, seed=1, source="tiny", cache=cache)
    with pytest.raises(ConfigError, match=">= 0"):
        teacher_samples(teacher, sequences, -1, seed=1, source="tiny", cache=cache)


def test_teacher_samples_from_the_start_begin_at_the_start_token_and_differ(tmp_path, monkeypatch):
    teacher = build_tiny_model("llama")
    teacher.generation_config.bos_token_id = 1
    sequences = torch.randint(3, 100, (5, 12), generator=torch.Generator().manual_seed(0))
    cache = tmp_path / "samples.pt"
    rows = teacher_samples(teacher, sequences, 6, seed=1, source="tiny", cache=cache, prompts="start")
    assert rows.shape == (6, 12)  # 12 <= SAMPLE_PROMPT_TOKENS is fine: no row's prompt is needed
    assert (rows[:, 0] == 1).all()
    assert len({tuple(r.tolist()) for r in rows}) == 6  # sampled, so every row is its own text
    longer = torch.randint(3, 100, (5, 24), generator=torch.Generator().manual_seed(1))
    shared = tmp_path / "shared.pt"
    started = teacher_samples(teacher, longer, 4, seed=1, source="tiny", cache=shared, prompts="start")
    continued = teacher_samples(teacher, longer, 4, seed=1, source="tiny", cache=shared)
    assert (started[:, 0] == 1).all()  # the cache is keyed by the prompts: each kind samples its own
    assert all(
        any(torch.equal(r[:SAMPLE_PROMPT_TOKENS], p[:SAMPLE_PROMPT_TOKENS]) for p in longer)
        for r in continued
    )

    teacher.generation_config.bos_token_id = None  # no BOS: start after the document separator
    assert start_token(teacher) == teacher.generation_config.eos_token_id
    teacher.generation_config.eos_token_id = None
    with pytest.raises(ConfigError, match="neither: set one, or use prompts='rows'"):
        teacher_samples(teacher, sequences, 2, seed=1, source="tiny", cache=tmp_path / "c", prompts="start")
    with pytest.raises(ConfigError, match=r"prompts must be one of \('rows', 'start'\), got 'bos'"):
        teacher_samples(teacher, sequences, 2, seed=1, source="tiny", cache=cache, prompts="bos")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_teacher_samples_on_another_device_come_back_to_the_cpu(device, tmp_path):
    teacher = build_tiny_model("llama")
    sequences = torch.randint(3, 100, (4, 20), generator=torch.Generator().manual_seed(0))
    rows = teacher_samples(teacher, sequences, 3, seed=0, source="tiny", cache=tmp_path / "s", device=device)
    assert rows.device.type == "cpu" and rows.shape == (3, 20)
    assert next(teacher.parameters()).device.type == "cpu"  # the recipe's model stays where it was


def test_hidden_state_loss_is_each_tokens_relative_error():
    generator = torch.Generator().manual_seed(0)
    teacher = [torch.randn(2, 5, 8, generator=generator) for _ in range(3)]
    assert hidden_state_loss([t.clone() for t in teacher], teacher).item() == 0.0
    # every token off by 10% of its own size, whatever that size: 0.01, also where one token is 1000x larger
    teacher[0][0, 0] *= 1000.0
    student = [t * 1.1 for t in teacher]
    assert hidden_state_loss(student, teacher).item() == pytest.approx(0.01, rel=1e-4)
    # one layer of three completely wrong (the zero vector): that layer's error is 1, the mean a third
    student = [teacher[0], torch.zeros_like(teacher[1]), teacher[2]]
    assert hidden_state_loss(student, teacher).item() == pytest.approx(1 / 3, rel=1e-5)
    with pytest.raises(ConfigError, match="same layers"):
        hidden_state_loss(student[:2], teacher)
    logits = torch.randn(2, 5, 16, generator=generator)
    loss, parts = distillation_loss(
        logits, logits, hidden_weight=3.0, student_hidden=student, teacher_hidden=teacher
    )
    assert parts["kl"] == pytest.approx(0.0, abs=1e-6) and parts["hidden"] == pytest.approx(1 / 3, rel=1e-5)
    assert loss.item() == pytest.approx(1.0, rel=1e-5)


# ---- training ---------------------------------------------------------------------------------------


def _config(tmp_path: Path, **overrides) -> TrainConfig:
    options = dict(
        output_dir=tmp_path,
        steps=8,
        batch_size=2,
        lr=3e-3,
        warmup_steps=1,
        checkpoint_every=3,
        progress=False,
    )
    return TrainConfig(**{**options, **overrides})


def test_training_reduces_a_planted_distillation_loss(tmp_path):
    # the planted target: a teacher that puts most of its mass on token (t + 1) mod vocab after token t
    def teacher(ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot((ids + 1) % 128, 128).float() * 8.0

    student = _student(seed=1)
    config = _config(tmp_path, steps=60, batch_size=8, lr=1e-2, schedule="constant", checkpoint_every=0)
    result = Trainer(student, _sequences(), config, teacher=teacher).train()
    losses = [r["loss"] for r in result.losses]
    assert len(losses) == 60 and [r["step"] for r in result.losses] == list(range(1, 61))
    assert sum(losses[-5:]) / 5 < 0.25 * losses[0], losses
    assert all(r["kl"] is not None and r["ce"] is None for r in result.losses)
    saved = json.loads((tmp_path / RESULT_NAME).read_text())
    assert saved["steps"] == 60 and saved["final_loss"] == losses[-1] and len(saved["checksums"]) == 1


def _setup(kind: str, dropout: float) -> tuple[nn.Module, ModelTeacher]:
    """The recipe's two set-ups on a tiny model: full fine-tune with a frozen dense copy as teacher, or
    LoRA with the student itself (adapters off, dense activations) as teacher."""
    dense = _student(seed=0, dropout=dropout)
    student = _student(seed=0, dropout=dropout)
    relufy(student, 0.05)
    if kind == "full":
        return student, ModelTeacher(dense.requires_grad_(False))
    import peft  # the training extra, which the README's set-up installs

    torch.manual_seed(0)
    lora = peft.get_peft_model(
        student, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "down_proj"])
    )
    for name, parameter in lora.named_parameters():  # B starts at zero; make the adapters matter at once
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    return lora, ModelTeacher(lora, (lora.disable_adapter, lambda: dense_activations(lora)))


def test_hidden_weight_pulls_every_layer_towards_the_teacher(tmp_path):
    student, teacher = _student(seed=1), ModelTeacher(_student(seed=0).requires_grad_(False))
    sequences = _sequences()

    def layer_error() -> float:
        with torch.no_grad():
            out = student(input_ids=sequences[:8], output_hidden_states=True)
            return hidden_state_loss(
                out.hidden_states[1:], teacher(sequences[:8], hidden_states=True)[1]
            ).item()

    before = layer_error()
    config = _config(tmp_path, steps=30, batch_size=8, lr=3e-3, hidden_weight=1.0, checkpoint_every=0)
    result = Trainer(student, sequences, config, teacher=teacher).train()
    hidden = [r["hidden"] for r in result.losses]
    assert all(r["loss"] == pytest.approx(r["kl"] + r["hidden"], rel=1e-4) for r in result.losses)
    assert sum(hidden[-5:]) / 5 < 0.5 * hidden[0], hidden
    assert layer_error() < 0.5 * before
    # without the term the log says so, and a teacher without hidden states is refused
    logits_only = Trainer(student, sequences, _config(tmp_path / "kl", steps=1), teacher=teacher).train()
    assert logits_only.losses[0]["hidden"] is None
    with pytest.raises(ConfigError, match="ModelTeacher"):
        Trainer(student, sequences, config, teacher=lambda ids: teacher(ids))
    with pytest.raises(ConfigError, match="hidden_weight"):
        _config(tmp_path, hidden_weight=-1.0)


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_kill_and_resume_gives_the_uninterrupted_loss_curve(tmp_path, kind):
    sequences = _sequences()
    # dropout in the student: equal losses after a resume need the RNG state back, not only the weights
    model, teacher = _setup(kind, dropout=0.1)
    reference = Trainer(model, sequences, _config(tmp_path / "a"), teacher=teacher).train()
    expected = _trainable(model)

    model, teacher = _setup(kind, dropout=0.1)

    def kill_at_5(step: int, record: dict) -> None:
        if step == 5:  # after checkpoint 3, before checkpoint 6: steps 4 and 5 are lost
            raise Killed

    with pytest.raises(Killed):
        Trainer(model, sequences, _config(tmp_path / "b"), teacher=teacher).train(on_step=kill_at_5)
    assert [s for s, _ in checkpoint_dirs(tmp_path / "b")] == [3]
    assert [r["step"] for r in read_log(tmp_path / "b" / LOG_NAME)] == [1, 2, 3, 4, 5]

    model, teacher = _setup(kind, dropout=0.1)  # a new process: the model as it was first built
    resumed = Trainer(model, sequences, _config(tmp_path / "b"), teacher=teacher).train()
    assert resumed.start_step == 3 and reference.start_step == 0
    assert [r["step"] for r in resumed.losses] == list(range(1, 9))
    for a, b in zip(reference.losses, resumed.losses, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-10), (a, b)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-12)
    final = _trainable(model)
    assert final.keys() == expected.keys()
    assert all(torch.allclose(final[k], expected[k], rtol=1e-6, atol=1e-8) for k in expected)
    # the last two checkpoints are kept, complete, and nothing temporary is left behind
    assert [s for s, _ in checkpoint_dirs(tmp_path / "b")] == [6, 8]
    assert not list((tmp_path / "b").glob(".*"))


def test_resume_skips_incomplete_checkpoints_and_refuses_other_settings(tmp_path):
    sequences = _sequences()
    model, teacher = _setup("full", dropout=0.0)
    Trainer(model, sequences, _config(tmp_path, steps=3), teacher=teacher).train()
    # a kill during a save leaves a temporary directory; a checkpoint without its state file is not one
    (tmp_path / ".checkpoint-000004.tmp").mkdir()
    (tmp_path / "checkpoint-000005").mkdir()
    with open(tmp_path / LOG_NAME, "a") as log:
        log.write('{"step": 4, "loss": 1.')  # a line a kill cut short
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [3]
    assert [r["step"] for r in read_log(tmp_path / LOG_NAME)] == [1, 2, 3]

    model, teacher = _setup("full", dropout=0.0)
    result = Trainer(model, sequences, _config(tmp_path, steps=3), teacher=teacher).train()
    assert result.start_step == 3 and len(result.losses) == 3  # already done: nothing to train
    assert not (tmp_path / ".checkpoint-000004.tmp").exists()
    state = json.loads((tmp_path / "checkpoint-000003" / STATE_NAME).read_text())
    assert state["step"] == 3

    model, teacher = _setup("full", dropout=0.0)
    with pytest.raises(ResumeMismatchError, match=r"config\.lr"):
        Trainer(model, sequences, _config(tmp_path, steps=3, lr=1e-4), teacher=teacher).train()
    model, teacher = _setup("full", dropout=0.0)
    with pytest.raises(ResumeMismatchError, match="data"):
        Trainer(model, _sequences(seed=1), _config(tmp_path, steps=3), teacher=teacher).train()


def test_accumulation_and_checkpointing_do_not_change_the_losses(tmp_path):
    sequences = _sequences()

    def losses(name: str, **overrides) -> list[float]:
        model, teacher = _setup("full", dropout=0.0)
        config = _config(tmp_path / name, steps=3, checkpoint_every=0, **overrides)
        return [r["loss"] for r in Trainer(model, sequences, config, teacher=teacher).train().losses]

    plain = losses("plain", batch_size=4)
    # the same 4 rows per step, as 2 micro-batches of 2: the same mean loss and gradient
    assert losses("accumulated", batch_size=2, grad_accum=2) == pytest.approx(plain, rel=1e-5)
    assert losses("checkpointed", batch_size=4, gradient_checkpointing=True) == pytest.approx(plain, rel=1e-5)


def test_train_config_rejects_bad_values(tmp_path):
    for bad in ({"steps": 0}, {"lr": 0.0}, {"batch_size": 1.5}, {"temperature": 0}, {"schedule": "step"}):
        with pytest.raises(ConfigError):
            _config(tmp_path, **bad)
    model = _student()
    with pytest.raises(ConfigError, match="Nothing to train on"):
        Trainer(model, _sequences(), _config(tmp_path))
    model.requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameter"):
        Trainer(model, _sequences(), _config(tmp_path, ce_weight=1.0))
    cfg = _config(tmp_path, steps=10, warmup_steps=2, min_lr_ratio=0.1)
    factors = [cfg.lr_factor(s) for s in range(10)]
    assert factors[0] < factors[1] < factors[2] == 1.0 and factors[-1] > 0.1 - 1e-9
    assert all(a >= b for a, b in itertools.pairwise(factors[2:])) and not math.isnan(sum(factors))


@pytest.mark.parametrize(("autocast_ms", "pays"), [(1, True), (20, False)], ids=["faster", "slower"])
def test_bf16_autocast_pays_where_its_products_are_measured_faster(monkeypatch, tmp_path, autocast_ms, pays):
    monkeypatch.setenv("FLASHLM_CACHE", str(tmp_path))  # nothing remembered yet

    def product(x, weight, sleep_ms):  # float32 takes 5 ms; under autocast, what the CPU at hand would
        time.sleep((sleep_ms if torch.is_autocast_enabled("cpu") else 5) / 1e3)

    monkeypatch.setattr(torch.nn.functional, "linear", partial(product, sleep_ms=autocast_ms))
    assert bf16_autocast_pays(torch.device("cpu"), rows=4, width=4) is pays
    # remembered for this machine: a resumed run trains in the precision it started in
    monkeypatch.setattr(torch.nn.functional, "linear", partial(product, sleep_ms=21 - autocast_ms))
    assert bf16_autocast_pays(torch.device("cpu"), rows=4, width=4) is pays


@pytest.mark.parametrize("pays", [True, False])
def test_auto_mixed_precision_trains_in_what_the_measurement_chose(pays):
    # in a process of its own: Accelerate keeps one mixed precision per process
    script = (
        "import flashlm.training.trainer as t\n"
        f"t.bf16_autocast_pays = lambda device: {pays}\n"
        "print('used', t.make_accelerator('auto').mixed_precision)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    chosen = "bf16" if pays else "no"
    assert f"mixed precision auto: {chosen}" in done.stdout and f"used {chosen}" in done.stdout


def test_an_unknown_mixed_precision_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="no, bf16, auto"):
        make_accelerator("fp16")


def _relufy_table(measurements):
    report = RelufyReport(
        model="m", output_dir="o", saved="o/model", options={"activation": "fatrelu"}, thresholds=[0.0, 0.5],
        steps=2, start_step=0, train_seconds=1.0, total_seconds=2.0, tokens_per_step=8, first_loss=2.0,
        final_loss=1.0, reload_exact=True, measurements=measurements,
    )  # fmt: skip
    return relufy_report_table(report)


def _lora_table(measurements):
    report = LoraReport(
        model="m", options={}, store="s", adapter="a", fused=None, steps=2, start_step=0, train_seconds=1.0,
        first_loss=2.0, final_loss=1.0, peak_rss_mb=10.0, measurements=measurements,
    )  # fmt: skip
    return lora_report_table(report)


@pytest.mark.parametrize(
    ("table", "stages", "rows_per_corpus"),
    [
        (_relufy_table, ("dense", "relufied, trained"), 2),
        (_lora_table, ("dense", "sparse", "sparse+lora"), 4),  # and "gap closed"
    ],
    ids=["relufy", "lora"],
)
def test_report_tables_keep_their_columns_for_long_corpus_names(table, stages, rows_per_corpus):
    corpora = ("jargon", "debian-reference")
    text = table(
        {
            stage: {c: {"perplexity": 20.0 + i + j, "zero_fraction": 0.8} for j, c in enumerate(corpora)}
            for i, stage in enumerate(stages)
        }
    )
    header = next(line for line in text.splitlines() if line.startswith("stage"))
    rows = [line for line in text.splitlines() if any(f" {c} " in line for c in corpora)]
    assert len(rows) == rows_per_corpus * len(corpora)
    # every row's first figure (its perplexity, or the gap closed) ends under the header's "perplexity"
    end = header.index("perplexity") + len("perplexity")
    for line in rows:
        assert re.search(r"-?\d+\.\d+%?", line).end() == end, (header, line)
