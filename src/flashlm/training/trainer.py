"""A small distillation trainer on Accelerate: one code path for one process and `accelerate launch`.

What it does, and why each piece is there:

- **Accelerate, not a runtime of our own.** The model and optimizer go through
  `Accelerator.prepare`, so the same script trains in one process, or in several (DDP over gloo on
  CPUs, NCCL on GPUs, or whatever `accelerate config` sets up: FSDP, DeepSpeed) when started with
  `accelerate launch`. flashlm never writes its own distributed code (DESIGN.md).
- **Distillation** (`distillation_loss`): the student matches the teacher's next-token distribution,
  `T² · KL(softmax(t/T) ‖ softmax(s/T))` per token, optionally plus `ce_weight ·` cross-entropy on
  the next token. The teacher is whatever callable returns logits for a batch (`ModelTeacher`): a
  frozen copy of the dense model, or the student itself with its changes switched off (LoRA adapters
  disabled and the dense activation swapped back), which saves a second copy of the weights.
  With `hidden_weight`, every decoder layer's output is also pulled towards the teacher's
  (`hidden_state_loss`, TinyBERT's intermediate-layer distillation), so that each layer's residual
  stream, which later layers' attention reads, stays close, and not only the last layer's logits.
- **Deterministic data** (`SequenceSampler`): the rows of each step are a pure function of the step
  and the seed, so resuming needs no data-loader state.
- **Checkpoints that survive a kill**: every `checkpoint_every` steps, `Accelerator.save_state`
  writes the trainable parameters (frozen weights are not saved: they come from the model's own
  checkpoint), the optimizer, the LR scheduler and every process's RNG state into
  `.checkpoint-NNNNNN.tmp`, each file is fsynced, and the directory is renamed to `checkpoint-NNNNNN`
  only when complete, with `trainer_state.json` (the step and a fingerprint of everything that shapes
  the trajectory). A run started again with the same arguments resumes from the newest complete
  checkpoint and produces the same losses as a run that was never interrupted; different arguments
  raise `ResumeMismatchError` rather than silently continuing another run.
- **A per-step JSON log** (`log.jsonl`, one object per optimizer step: loss, its KL, CE and hidden
  parts, the learning rate, the gradient norm, tokens, seconds). On resume the steps after the
  checkpoint, which will be recomputed, are dropped from it.

Exceptions defined here (subclasses of `flashlm.errors.FlashLMError`): `TrainingError`,
`ResumeMismatchError`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .._measurements import machine_key, median_seconds, recall, remember
from ..data.corpora import DEFAULT_TRAIN_CORPORA
from ..errors import ConfigError, FlashLMError
from .data import TEACHER_PROMPTS, SequenceSampler, fingerprint

LOG_NAME = "log.jsonl"
"""One JSON object per optimizer step, in the trainer's output directory."""
RESULT_NAME = "train_result.json"
"""Written at the end of a run: steps, time, final loss, and each process's parameter checksum."""
STATE_NAME = "trainer_state.json"
"""Inside each checkpoint: the step it holds and the fingerprint of the run that wrote it."""
CHECKPOINT_PREFIX = "checkpoint-"


class TrainingError(FlashLMError):
    """A training run cannot go on (for example, the processes' parameters diverged)."""


class ResumeMismatchError(TrainingError, ValueError):
    """The output directory holds checkpoints of a run with other settings than the one asked for."""


Teacher = Callable[[torch.Tensor], torch.Tensor]
"""Maps a batch of input ids `[b, L]` to the teacher's logits `[b, L, vocab]` (no gradient)."""


# --------------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------------


def hidden_state_loss(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean over layers and tokens of `‖s − t‖² / ‖t‖²`, each token's relative squared error.

    Relative per token, because a few tokens (the first, attention's sink) carry hidden states
    hundreds of times larger than the rest: a plain mean squared error would match those alone.
    """
    if len(student) != len(teacher):
        raise ConfigError(
            f"The student has {len(student)} hidden states and the teacher {len(teacher)}: hidden-state "
            "matching needs models with the same layers."
        )
    errors = []
    for s, t in zip(student, teacher, strict=True):
        t = t.float()
        errors.append(((s.float() - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-6)).mean())
    return torch.stack(errors).mean()


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    input_ids: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ce_weight: float = 0.0,
    hidden_weight: float = 0.0,
    student_hidden: Sequence[torch.Tensor] = (),
    teacher_hidden: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, dict[str, float]]:
    """`T² · KL(p_teacher ‖ p_student)` at temperature `T`, mean over tokens, `+ ce_weight · CE`.

    Both distributions are taken at every position of `[b, L, vocab]` logits (softmax over the last
    dimension, in float32). The `T²` factor keeps the gradient's scale independent of `T` (Hinton
    et al.), so a temperature can be changed without retuning the learning rate. The cross-entropy
    term needs `input_ids` (position i predicts token i+1); with `teacher_logits=None` the loss is
    the cross-entropy alone. `hidden_weight > 0` adds `hidden_weight · hidden_state_loss` over the
    decoder layers' outputs. Returns the loss and its parts (`kl`, `ce`, `hidden`) as floats for the
    log. The KL is exactly 0 when the student's logits equal the teacher's.
    """
    if temperature <= 0:
        raise ConfigError(f"The distillation temperature must be positive, got {temperature}.")
    parts: dict[str, float] = {}
    loss = student_logits.new_zeros((), dtype=torch.float32)
    if teacher_logits is not None:
        if teacher_logits.shape != student_logits.shape:
            raise ConfigError(
                f"Teacher logits {tuple(teacher_logits.shape)} and student logits "
                f"{tuple(student_logits.shape)} differ in shape: do the two models share a vocabulary?"
            )
        vocab = student_logits.shape[-1]
        log_q = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
        log_p = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * temperature**2
        loss = loss + kl
        parts["kl"] = kl.item()
    if ce_weight > 0 or teacher_logits is None:
        if input_ids is None:
            raise ConfigError("The cross-entropy term needs the input ids (the next-token targets).")
        vocab = student_logits.shape[-1]
        ce = F.cross_entropy(
            student_logits[:, :-1].float().reshape(-1, vocab),
            input_ids[:, 1:].reshape(-1).to(student_logits.device),
        )
        loss = loss + (ce_weight if teacher_logits is not None else 1.0) * ce
        parts["ce"] = ce.item()
    if hidden_weight > 0:
        hidden = hidden_state_loss(student_hidden, teacher_hidden)
        loss = loss + hidden_weight * hidden
        parts["hidden"] = hidden.item()
    return loss, parts


class ModelTeacher:
    """Teacher logits from `model`, in eval mode and without gradients, inside `contexts`; with
    `hidden_states=True`, the logits and the decoder layers' outputs (`hidden_weight`'s targets).

    Each item of `contexts` makes a context manager that turns the model into its teacher form for
    the forward (and back after it). For a LoRA student whose base is the dense model,
    `(peft_model.disable_adapter, lambda: dense_activations(peft_model))` turns the student into the
    exact dense model without a second copy of its weights. The model's train/eval mode is restored.
    """

    def __init__(
        self, model: nn.Module, contexts: Sequence[Callable[[], AbstractContextManager]] = ()
    ) -> None:
        self.model = model
        self.contexts = tuple(contexts)

    def __call__(
        self, input_ids: torch.Tensor, *, hidden_states: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        was_training = self.model.training
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for make in self.contexts:
                stack.enter_context(make())
            self.model.eval()
            try:
                out = self.model(input_ids=input_ids, use_cache=False, output_hidden_states=hidden_states)
            finally:
                self.model.train(was_training)
        return (out.logits, layer_outputs(out)) if hidden_states else out.logits


def layer_outputs(output: Any) -> tuple[torch.Tensor, ...]:
    """The decoder layers' outputs of a forward run with `output_hidden_states=True` (the embeddings,
    its first hidden state, left out)."""
    return tuple(output.hidden_states[1:])


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------

_RUNTIME_FIELDS = ("output_dir", "checkpoint_every", "keep_checkpoints", "gradient_checkpointing", "progress")
"""TrainConfig fields that do not change the trajectory: a run may be resumed with other values."""


@dataclass(frozen=True)
class TrainConfig:
    """How `Trainer` trains. Fields outside `_RUNTIME_FIELDS` are part of a run's fingerprint.

    `batch_size` is per process and per micro-batch: one optimizer step sees
    `batch_size * grad_accum * num_processes` sequences. The learning rate warms up linearly over
    `warmup_steps`, then stays (`schedule="constant"`) or follows a cosine down to
    `min_lr_ratio * lr` at `steps` (`"cosine"`). `checkpoint_every=0` saves only at the end.
    `hidden_weight` weighs the hidden-state term of the loss (`distillation_loss`; 0: logits only).
    """

    output_dir: str | os.PathLike
    steps: int
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "cosine"
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = 1.0
    temperature: float = 1.0
    ce_weight: float = 0.0
    hidden_weight: float = 0.0
    seed: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    gradient_checkpointing: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"TrainConfig.{name} must be a positive int, got {value!r}.")
        for name in ("warmup_steps", "checkpoint_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"TrainConfig.{name} must be an int >= 0, got {value!r}.")
        if self.keep_checkpoints < 1:
            raise ConfigError(
                f"keep_checkpoints must be >= 1 (resuming needs one), got {self.keep_checkpoints}."
            )
        if not self.lr > 0:
            raise ConfigError(f"The learning rate must be positive, got {self.lr}.")
        if self.schedule not in ("constant", "cosine"):
            raise ConfigError(f"schedule must be 'constant' or 'cosine', got {self.schedule!r}.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
        if not self.temperature > 0:
            raise ConfigError(f"The distillation temperature must be positive, got {self.temperature}.")
        if self.ce_weight < 0:
            raise ConfigError(f"ce_weight must be >= 0, got {self.ce_weight}.")
        if not self.hidden_weight >= 0:
            raise ConfigError(f"hidden_weight must be >= 0, got {self.hidden_weight}.")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}.")

    def trajectory(self) -> dict[str, Any]:
        """The fields that decide the losses a run produces (everything but `_RUNTIME_FIELDS`)."""
        return {k: v for k, v in asdict(self).items() if k not in _RUNTIME_FIELDS}

    def lr_factor(self, step: int) -> float:
        """Multiplier of `lr` for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.schedule == "constant":
            return 1.0
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


DEFAULT_EVAL_CORPORA = ("shakespeare", "jargon")


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list on the command line (`shakespeare,jargon`)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def corpus_column_width(corpora: Sequence[str]) -> int:
    """Width of a report table's corpus column: the longest name (`debian-reference`), at least 14."""
    return max([14, *(len(name) for name in corpora)])


def add_recipe_arguments(parser: argparse.ArgumentParser, *, outputs: str) -> None:
    """What every recipe's command line starts with: `--out` (holding `outputs`), `--model`, the training
    corpora and sequence length."""
    p = parser
    p.add_argument("--out", required=True, help=f"output directory: {outputs}")
    p.add_argument(
        "--model", default=None, help="bundled model name or checkpoint directory (default: smollm2-135m)"
    )
    p.add_argument(
        "--corpora", type=names, default=DEFAULT_TRAIN_CORPORA, help="training corpora (calibration splits)"
    )
    p.add_argument(
        "--train-text",
        dest="train_texts",
        action="append",
        default=[],
        metavar="FILE",
        help="also train on this UTF-8 text file, whole: text from the domain the model will run on "
        "(repeat for several files)",
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence (default: 128)")
    p.add_argument(
        "--teacher-samples",
        type=int,
        default=0,
        help="also train on this many sequences sampled from the dense model (default: 0)",
    )
    p.add_argument(
        "--teacher-prompts",
        choices=TEACHER_PROMPTS,
        default="rows",
        help="where teacher samples start: 'rows' continue a training row's first tokens (the training "
        "domains), 'start' samples from the model's start-of-text token (its whole distribution, "
        "LLM-QAT's data-free text) (default: rows)",
    )


def recipe_options_from_args(args: argparse.Namespace) -> dict:
    """The recipe options every recipe's arguments carry (`add_recipe_arguments`, `add_eval_arguments`,
    `--mixed-precision`, `--no-progress`), by their options' field names."""
    return {
        "output_dir": args.out,
        "model": args.model,
        "corpora": args.corpora,
        "train_texts": tuple(args.train_texts),
        "seq_len": args.seq_len,
        "teacher_samples": args.teacher_samples,
        "teacher_prompts": args.teacher_prompts,
        "mixed_precision": args.mixed_precision,
        "evaluate": args.evaluate,
        "eval_corpora": args.eval_corpora,
        "eval_tokens": args.eval_tokens,
        "eval_context": args.eval_context,
        "progress": args.progress,
    }


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipes' measurement options: `--no-eval`, the test-split corpora, tokens and window."""
    p = parser
    p.add_argument("--no-eval", dest="evaluate", action="store_false", help="skip the measurements")
    p.add_argument("--eval-corpora", type=names, default=DEFAULT_EVAL_CORPORA, help="test-split corpora")
    p.add_argument("--eval-tokens", type=int, default=4096, help="test tokens per corpus (default: 4096)")
    p.add_argument("--eval-context", type=int, default=512, help="perplexity window (default: 512)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def add_trainer_arguments(
    parser: argparse.ArgumentParser, *, steps: int, lr_default: str, ce_weight: float = 0.0
) -> None:
    """The command-line options of a `TrainConfig` (and `--mixed-precision`, `--no-progress`), shared by
    the recipes; `lr_default` says in the help what `--lr` defaults to (the recipe decides), and
    `ce_weight` is the recipe's default weight of the cross-entropy term."""
    p = parser
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default: {steps})")
    p.add_argument(
        "--batch-size", type=int, default=4, help="sequences per process per micro-batch (default: 4)"
    )
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: 1)")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default: {lr_default})")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature (default: 1)")
    p.add_argument(
        "--ce-weight",
        type=float,
        default=ce_weight,
        help=f"weight of the next-token cross-entropy term (default: {ce_weight:g})",
    )
    p.add_argument(
        "--hidden-weight",
        type=float,
        default=0.0,
        help="weight of the term matching every layer's hidden states to the teacher's (default: 0)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between checkpoints (0: at the end only)"
    )
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument(
        "--mixed-precision",
        choices=MIXED_PRECISIONS,
        default="no",
        help="autocast (default: no); auto: bf16 where it runs faster than float32 here",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def train_config_from_args(
    args: argparse.Namespace, output_dir: str | os.PathLike, *, lr: float
) -> TrainConfig:
    """The `TrainConfig` of arguments `add_trainer_arguments` parsed (`lr`: the learning rate to use)."""
    return TrainConfig(
        output_dir=output_dir,
        steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        schedule=args.schedule,
        max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
        temperature=args.temperature,
        ce_weight=args.ce_weight,
        hidden_weight=args.hidden_weight,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        gradient_checkpointing=args.gradient_checkpointing,
        progress=args.progress,
    )


@dataclass
class TrainResult:
    """What a `Trainer.train` call did.

    `losses` is the whole run's log, steps before a resume included, on the main process (empty on
    the others, which write no log).
    """

    steps: int
    start_step: int
    seconds: float
    output_dir: Path
    losses: list[dict[str, Any]] = field(default_factory=list)
    checksums: list[str] = field(default_factory=list)
    """sha256 of the trainable parameters on each process, rank order: equal unless ranks diverged."""

    @property
    def resumed(self) -> bool:
        return self.start_step > 0

    @property
    def final_loss(self) -> float:
        return self.losses[-1]["loss"] if self.losses else math.nan


# --------------------------------------------------------------------------------------------------
# Checkpoint files
# --------------------------------------------------------------------------------------------------


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (`checkpoint-NNNNNN` holding `trainer_state.json`) of a run, oldest first."""
    found = []
    root = Path(output_dir)
    if not root.is_dir():
        return []
    for path in root.iterdir():
        suffix = path.name.removeprefix(CHECKPOINT_PREFIX)
        if path.name.startswith(CHECKPOINT_PREFIX) and suffix.isdigit() and (path / STATE_NAME).is_file():
            found.append((int(suffix), path))
    return sorted(found)


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a `log.jsonl`, skipping a last line cut short by a kill."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _fsync_tree(path: Path) -> None:
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _checksum(parameters: list[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, tensor in parameters:
        digest.update(name.encode())
        digest.update(tensor.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------


MIXED_PRECISIONS = ("no", "bf16", "auto")
BF16_PAYS_AT = 1.25
"""`mixed_precision="auto"` trains under bf16 autocast where its products run at least this many times
faster than float32's: a CPU without bf16 instructions converts every operand and runs them slower
(on a 2-core Intel Xeon with AVX-512F alone, a relufy step took 14 s under bf16 and 4 s without)."""


BF16_MEASUREMENTS = "bf16_autocast.json"
"""File in flashlm's cache that remembers each machine's `bf16_autocast_pays` answer on the CPU, so that
a resumed run trains in the precision it started in."""


def bf16_autocast_pays(device: torch.device, *, rows: int = 512, width: int = 1024) -> bool:
    """Whether bf16 autocast speeds training up on `device`: on CUDA, whether the GPU supports bf16;
    on the CPU, a `[rows, width] x [width, 4 width]` product timed in float32 and under autocast
    (median of 3 after a warm-up each), once per machine (`BF16_MEASUREMENTS`)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    key = f"{machine_key()}|{torch.get_num_threads()}|{rows}x{width}"
    if (known := recall(BF16_MEASUREMENTS, key, dict)) is not None:
        return bool(known["pays"])
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=generator)
    weight = torch.randn(4 * width, width, generator=generator)
    seconds = {}
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            seconds[autocast] = median_seconds(partial(F.linear, x, weight), repeats=3)
    pays = seconds[False] >= BF16_PAYS_AT * seconds[True]
    remember(BF16_MEASUREMENTS, key, {"pays": pays, "float32_s": seconds[False], "bf16_s": seconds[True]})
    return pays


def make_accelerator(mixed_precision: str = "no") -> Any:
    """The `accelerate.Accelerator` a training run uses (`mixed_precision`: `"no"`, `"bf16"`, or
    `"auto"`: bf16 where `bf16_autocast_pays`, decided on the main process for every process).

    Created once per process; under `accelerate launch` it joins the launched process group. On a
    machine without CUDA, a run launched on several processes (`WORLD_SIZE > 1`) is a CPU run over
    gloo: Accelerate only picks that when told `cpu=True` (or `ACCELERATE_USE_CPU=true`), and
    `accelerate launch --cpu` itself starts one process unless MPI is set up, so the processes are
    started with `accelerate launch --multi_gpu --num_processes N` (torchrun) and this says CPU.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import broadcast_object_list

    if mixed_precision not in MIXED_PRECISIONS:
        raise ConfigError(
            f"mixed_precision must be one of {', '.join(MIXED_PRECISIONS)}, got {mixed_precision!r}."
        )
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if (
        not several
        and os.environ.get("MASTER_ADDR")
        and os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true"
    ):
        warnings.warn(
            "`accelerate launch --cpu --num_processes N` started a single process (without MPI it does "
            "not start N): training runs on one process. For several CPU processes over gloo, use "
            "`accelerate launch --multi_gpu --num_processes N` on this machine without CUDA.",
            stacklevel=2,
        )
    cpu = several and not torch.cuda.is_available()
    if mixed_precision == "auto":
        state = PartialState(cpu=cpu)
        pays = [bf16_autocast_pays(state.device) if state.is_main_process else None]
        broadcast_object_list(pays)  # every process trains in the same precision
        mixed_precision = "bf16" if pays[0] else "no"
        if state.is_main_process:
            print(f"mixed precision auto: {mixed_precision}")
    return Accelerator(mixed_precision=mixed_precision, cpu=cpu)


def report_options(options: Any, accelerator: Any, train: TrainConfig) -> dict[str, Any]:
    """A recipe report's `options`: the recipe's (a dataclass), the precision the run used (which
    `mixed_precision="auto"` chose), and the trainer's settings."""
    return {
        **asdict(options),
        "mixed_precision_used": accelerator.mixed_precision,
        "train": train.trajectory(),
    }


class Trainer:
    """Distils `teacher` into the trainable parameters of `model` on the rows of `sequences`.

    `sequences` is an `[n, L]` int64 table (`flashlm.training.data.corpus_sequences`); every process
    must pass the same one. Only parameters with `requires_grad` are optimized (AdamW) and saved in
    checkpoints. `teacher=None` trains on the next-token cross-entropy alone. `fingerprint_extra`
    names whatever else shapes the run (the recipe's options): a resume checks it matches.
    """

    def __init__(
        self,
        model: nn.Module,
        sequences: torch.Tensor,
        config: TrainConfig,
        *,
        teacher: Teacher | None = None,
        accelerator: Any = None,
        fingerprint_extra: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2 or sequences.dtype != torch.int64:
            raise ConfigError("sequences must be an [n, L] int64 tensor of token ids (see corpus_sequences).")
        if teacher is None and config.ce_weight == 0:
            raise ConfigError(
                "Nothing to train on: without a teacher the loss is the cross-entropy; pass a teacher "
                "to distil, or set ce_weight > 0."
            )
        if config.hidden_weight > 0 and not isinstance(teacher, ModelTeacher):
            raise ConfigError(
                "hidden_weight > 0 matches the student's hidden states to a teacher model's: pass a "
                "ModelTeacher (a callable that returns logits alone has no hidden states)."
            )
        self.config = config
        self.sequences = sequences
        self.teacher = teacher
        self.accelerator = accelerator if accelerator is not None else make_accelerator()
        self.output_dir = Path(config.output_dir)
        self.model = model
        self._trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self._trainable:
            raise ConfigError("The model has no trainable parameter (every requires_grad is False).")
        self.fingerprint = self._fingerprint(fingerprint_extra or {})

    # ---- set-up ----------------------------------------------------------------------------------

    def _fingerprint(self, extra: dict[str, Any]) -> dict[str, Any]:
        shapes = hashlib.sha256(
            "\n".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in self._trainable).encode()
        ).hexdigest()
        return {
            "config": json.loads(json.dumps(self.config.trajectory())),
            "num_processes": self.accelerator.num_processes,
            "trainable": shapes,
            "data": fingerprint(self.sequences),
            "extra": json.loads(json.dumps(extra, default=str)),
        }

    @staticmethod
    def _trainable_keys(model: nn.Module) -> set[str]:
        """State-dict keys of `model`'s trainable tensors, one per storage (tied weights once)."""
        keys, seen = set(), set()
        for name, parameter in model.named_parameters(remove_duplicate=False):
            if parameter.requires_grad and parameter.data_ptr() not in seen:
                seen.add(parameter.data_ptr())
                keys.add(name)
        return keys

    def _register_hooks(self) -> None:
        # The hooks get the models whose state dicts Accelerate saves and loads: the DDP wrapper on GPUs,
        # the bare model on CPUs. Keys are taken from those very objects, so they always match.
        def keep_trainable(models: list, weights: list, output_dir: str) -> None:
            # Frozen weights come from the model's own checkpoint; saving them would cost the whole model
            # per checkpoint for a LoRA run.
            for model, state in zip(models, weights, strict=True):
                keys = self._trainable_keys(model)
                for key in [k for k in state if k not in keys]:
                    del state[key]

        def check_saved(models: list, input_dir: str) -> None:
            from safetensors import safe_open

            path = Path(input_dir) / "model.safetensors"
            if not models or not path.is_file():
                return
            keys = self._trainable_keys(models[0])
            with safe_open(str(path), "pt") as f:
                saved = set(f.keys())
            if saved != keys:
                raise ResumeMismatchError(
                    f"Checkpoint {input_dir} holds other trainable tensors than this model "
                    f"({len(saved ^ keys)} differ, e.g. {sorted(saved ^ keys)[:3]}). Resume with the "
                    "same options, or use a new output directory."
                )

        self.accelerator.register_save_state_pre_hook(keep_trainable)
        self.accelerator.register_load_state_pre_hook(check_saved)

    def _batch(self, sampler: SequenceSampler, step: int, micro: int) -> torch.Tensor:
        rows = sampler.rows(step, micro, self.accelerator.process_index)
        return self.sequences[rows].to(self.accelerator.device)

    # ---- checkpoints -----------------------------------------------------------------------------

    def _save(self, step: int) -> None:
        acc = self.accelerator
        final = self.output_dir / f"{CHECKPOINT_PREFIX}{step:06d}"
        tmp = self.output_dir / f".{final.name}.tmp"
        if acc.is_main_process and tmp.exists():
            shutil.rmtree(tmp)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            _write_json_atomic(tmp / STATE_NAME, {"step": step, "fingerprint": self.fingerprint})
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.output_dir)
            for _, old in checkpoint_dirs(self.output_dir)[: -self.config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def _resume(self, log_path: Path) -> int:
        """Load the newest complete checkpoint, if any; returns its step (0 when starting fresh)."""
        acc = self.accelerator
        found = checkpoint_dirs(self.output_dir)
        if not found:
            if acc.is_main_process and log_path.exists():
                log_path.unlink()  # a log without a checkpoint is a run that never saved: start again
            acc.wait_for_everyone()
            return 0
        step, path = found[-1]
        saved = json.loads((path / STATE_NAME).read_text())
        if saved.get("fingerprint") != self.fingerprint:
            differences = _differences(saved.get("fingerprint", {}), self.fingerprint)
            raise ResumeMismatchError(
                f"{self.output_dir} holds checkpoints of another run (differs in: {', '.join(differences)}). "
                "Run again with the options it was started with to resume it, or choose a new output "
                "directory (or delete this one) to start over."
            )
        acc.load_state(str(path), strict=False)
        if acc.is_main_process:
            kept = [r for r in read_log(log_path) if r.get("step", math.inf) <= step]
            tmp = log_path.with_name(f".{log_path.name}.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, log_path)
        acc.wait_for_everyone()
        return step

    # ---- the loop --------------------------------------------------------------------------------

    def train(
        self,
        *,
        on_step: Callable[[int, dict[str, Any]], None] | None = None,
        before_step: Callable[[int], None] | None = None,
    ) -> TrainResult:
        """Train to `config.steps`, resuming from the newest checkpoint in `output_dir` if there is one.

        `before_step(step)` runs before every optimizer step (0-based step, so after a resume it starts
        at the first step run), on every process: state that depends on the step, such as a schedule
        the model follows, is set there. `on_step(step, record)` runs after every optimizer step's log
        record is written (1-based step), on every process.
        """
        from tqdm.auto import tqdm

        cfg, acc = self.config, self.accelerator
        self.output_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.output_dir / LOG_NAME
        from accelerate.utils import set_seed

        set_seed(cfg.seed)
        model = self.model
        if cfg.gradient_checkpointing:
            # transformers 5 renamed gradient checkpointing to activation checkpointing (the old name warns).
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False}
                )
            elif hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                raise ConfigError(
                    f"{type(model).__name__} cannot recompute activations (it has no "
                    "activation_checkpointing_enable): train without gradient checkpointing."
                )
        optimizer = torch.optim.AdamW(
            [p for _, p in self._trainable], lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cfg.lr_factor)
        prepared, optimizer = acc.prepare(model, optimizer)
        # The scheduler is registered, not prepared: a prepared one steps once per process, which ties the
        # schedule to the number of processes; here a step is an optimizer step whatever the world size.
        acc.register_for_checkpointing(scheduler)
        self._register_hooks()
        if acc.is_main_process:
            for stale in self.output_dir.glob(f".{CHECKPOINT_PREFIX}*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)  # a checkpoint a kill interrupted
        acc.wait_for_everyone()
        start = self._resume(log_path)
        sampler = SequenceSampler(
            self.sequences.shape[0],
            batch_size=cfg.batch_size,
            accumulation=cfg.grad_accum,
            world=acc.num_processes,
            seed=cfg.seed,
        )
        trainable = [p for _, p in self._trainable]
        tokens_per_step = cfg.batch_size * cfg.grad_accum * acc.num_processes * self.sequences.shape[1]
        started = time.perf_counter()
        bar = tqdm(
            total=cfg.steps,
            initial=start,
            desc="train",
            unit="step",
            disable=not (cfg.progress and acc.is_main_process),
        )
        prepared.train()
        log = open(log_path, "a") if acc.is_main_process else None  # noqa: SIM115 (closed below)
        try:
            for step in range(start, cfg.steps):
                step_started = time.perf_counter()
                if before_step is not None:
                    before_step(step)
                sums = torch.zeros(4, dtype=torch.float64)  # loss, kl, ce, hidden
                matching = cfg.hidden_weight > 0
                for micro in range(cfg.grad_accum):
                    input_ids = self._batch(sampler, step, micro)
                    teacher_logits, teacher_hidden = None, ()
                    if self.teacher is not None:
                        with acc.autocast():
                            if matching:
                                teacher_logits, teacher_hidden = self.teacher(input_ids, hidden_states=True)
                            else:
                                teacher_logits = self.teacher(input_ids)
                    sync = micro == cfg.grad_accum - 1
                    with contextlib.nullcontext() if sync else acc.no_sync(prepared), acc.autocast():
                        out = prepared(input_ids=input_ids, use_cache=False, output_hidden_states=matching)
                        loss, parts = distillation_loss(
                            out.logits,
                            teacher_logits,
                            input_ids,
                            temperature=cfg.temperature,
                            ce_weight=cfg.ce_weight,
                            hidden_weight=cfg.hidden_weight,
                            student_hidden=layer_outputs(out) if matching else (),
                            teacher_hidden=teacher_hidden,
                        )
                        acc.backward(loss / cfg.grad_accum)
                    sums += torch.tensor(
                        [loss.item(), *(parts.get(k, 0.0) for k in ("kl", "ce", "hidden"))],
                        dtype=torch.float64,
                    )
                    del out, teacher_logits, teacher_hidden, loss
                grad_norm = None
                if cfg.max_grad_norm is not None:
                    grad_norm = float(acc.clip_grad_norm_(trainable, cfg.max_grad_norm))
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                means = acc.reduce(sums.to(acc.device) / cfg.grad_accum, reduction="mean").cpu()
                record = {
                    "step": step + 1,
                    "loss": means[0].item(),
                    "kl": means[1].item() if self.teacher is not None else None,
                    "ce": means[2].item() if (cfg.ce_weight > 0 or self.teacher is None) else None,
                    "hidden": means[3].item() if matching else None,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens": (step + 1) * tokens_per_step,
                    "seconds": time.perf_counter() - step_started,
                }
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}")
                done = step + 1
                if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                    self._save(done)
                if on_step is not None:
                    on_step(done, record)
        finally:
            bar.close()
            if log is not None:
                log.close()
        checksums = self._checksums()
        if len(set(checksums)) > 1:
            raise TrainingError(
                f"The processes' trainable parameters differ after training ({checksums}): the "
                "distributed backend did not keep them in sync. Check the accelerate configuration."
            )
        result = TrainResult(
            steps=cfg.steps,
            start_step=start,
            seconds=time.perf_counter() - started,
            output_dir=self.output_dir,
            losses=read_log(log_path) if acc.is_main_process else [],
            checksums=checksums,
        )
        if acc.is_main_process:
            _write_json_atomic(
                self.output_dir / RESULT_NAME,
                {
                    "steps": result.steps,
                    "start_step": result.start_step,
                    "seconds_this_run": result.seconds,
                    "final_loss": result.final_loss,
                    "num_processes": acc.num_processes,
                    "tokens_per_step": tokens_per_step,
                    "checksums": checksums,
                },
            )
        acc.wait_for_everyone()
        return result

    def _checksums(self) -> list[str]:
        from accelerate.utils import gather_object

        mine = _checksum(self._trainable)
        if self.accelerator.num_processes == 1:
            return [mine]
        return list(gather_object([mine]))

    def unwrapped(self) -> nn.Module:
        """The trained model without Accelerate's wrappers (the object passed in, trained in place)."""
        return self.accelerator.unwrap_model(self.model)


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    names = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            names += [f"{key}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            names.append(key)
    return names or ["unknown"]
