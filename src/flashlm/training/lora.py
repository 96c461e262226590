"""LoRA recovery for sparse models (DIP paper §4, eq. 9; §6.1: rank 32, 1000 iterations, distillation
to the dense model's logits), fused into the store.

    flashlm train lora --out OUT --method dip --density 0.5 [--model M] [--steps 1000] ...
    accelerate launch --multi_gpu --num_processes 2 -m flashlm.training.lora --out OUT --method dip ...
    flashlm fuse --adapter OUT/adapter --model M [--out STORE | --in-place]

The recipe, in steps:

1. Load the dense model in float32 (a relufied checkpoint with its FATReLU thresholds) and open its
   store: its calibration gives DIP's density split and the thresholds, its predictors the predictor
   method's masks (`flashlm.methods.selection`, the rules the streaming modules apply).
2. Put a training-time MLP (`MaskedMLP`) in place of every MLP: the model's own projections, computed
   in memory with the method's masks. A mask on a projection's input selects its columns, one on its
   output its rows, so a LoRA adapter on the projection (`W + BA`) is applied before selection,
   exactly as eq. 9 asks, and fuses into the stored weights at no runtime cost. DIP-CA trains under
   DIP's masks of the same split: at training time there is no cache for γ to favour.
3. Wrap the MLP projections (gate, up, down) in peft LoRA adapters and distil (`trainer.Trainer`)
   from the dense model: the student with its adapters disabled and its masks off (`dense_mlps`),
   so no second copy of the weights is kept.
4. Save the adapter with peft's `save_pretrained` to `OUT/adapter` (loads with peft as usual on the
   dense model), with `flashlm_lora.json` naming the store it was trained on; written under a
   temporary name and renamed. `OUT/train/` holds the trainer's log and checkpoints: the same command
   run again after a kill resumes.
5. Fuse the adapter into a copy of the store (`OUT/store.flash`, `flashlm.store.fuse`), and measure on
   the test split of the evaluation corpora the perplexity of the dense model, the method on the
   original store and the method on the fused store, each streamed by flashlm (`OUT/report.json`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._utils import peak_rss_bytes
from .._version import __version__
from ..arch import MLPSpec, find_mlps, model_type_of, spec_for
from ..config import FlashConfig
from ..data.corpora import DEFAULT_TRAIN_CORPORA
from ..errors import ConfigError, FlashLMError, UnsupportedArchitectureError
from ..methods.selection import CATSSelection, DIPSelection, GLUSelection, PredictorSelection, Selection
from ..methods.specs import parse_method_spec
from ..store.fuse import ADAPTER_RECORD
from ..workflows.fuse import fuse_adapter, fuse_pruned_checkpoint
from .data import check_teacher_prompts
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

ADAPTER_DIR = "adapter"
FUSED_STORE = "store.flash"
FUSED_CHECKPOINT = "model"
TRAIN_DIR = "train"
REPORT_NAME = "report.json"


# --------------------------------------------------------------------------------------------------
# The training-time MLP
# --------------------------------------------------------------------------------------------------


class MaskedMLP(nn.Module):
    """A gated MLP computed in memory with a sparse method's masks: `down(act(gate x) * up x)` over the
    units the method keeps. The projections are the model's own modules, under their own names, so
    peft adapters on them have the keys they would have on the dense model.

    `masking` off computes the dense MLP (the teacher); `masked(x)` is each method's computation.
    """

    def __init__(self, owner: nn.Module, spec: MLPSpec, d_model: int, d_ff: int, **selection: Any) -> None:
        super().__init__()
        self.roles = {"gate": spec.gate, "up": spec.up, "down": spec.down}
        for name in (*self.roles.values(), spec.act):
            self.add_module(name, getattr(owner, name))
        self.act_name = spec.act
        self.d_model, self.d_ff = d_model, d_ff
        for name, value in selection.items():
            setattr(self, name, value)  # the selection's attributes (a predictor becomes a submodule)
        self.masking = True

    def project(self, role: str, x: torch.Tensor) -> torch.Tensor:
        return self.get_submodule(self.roles[role])(x)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return self.get_submodule(self.act_name)(x)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = self.masked(x) if self.masking else self.dense(x)
        return out.reshape(*hidden_states.shape[:-1], out.shape[-1])

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        return self.project("down", self.act(self.project("gate", x)) * self.project("up", x))

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class MaskedDIP(DIPSelection, MaskedMLP):
    def masked(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            keep = self.select_input(x.detach(), None)
        kept = x if keep is None else x * keep  # the up/gate columns of the kept inputs
        a = self.project("up", kept) * self.act(self.project("gate", kept))
        with torch.no_grad():
            keep_out = self.select_output(a.detach(), None)
        return self.project("down", a * keep_out)  # the kept down columns


class MaskedGLU(GLUSelection, MaskedDIP):
    pass


class MaskedUp(Selection, MaskedMLP):
    def masked(self, x: torch.Tensor) -> torch.Tensor:
        up = self.project("up", x)
        with torch.no_grad():
            keep = self.select_output(up.detach(), None)
        return self.project("down", self.act(self.project("gate", x)) * up * keep)


class MaskedGate(Selection, MaskedMLP):
    def masked(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.act(self.project("gate", x))
        with torch.no_grad():
            keep = self.select_output(gate.detach(), None)
        return self.project("down", gate * self.project("up", x) * keep)


class MaskedCATS(CATSSelection, MaskedGate):
    pass


class MaskedPredictor(PredictorSelection, MaskedMLP):
    def masked(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            keep = self.select(x.detach())
        return self.project("down", self.act(self.project("gate", x)) * self.project("up", x) * keep)


class PrunedMLP(MaskedMLP):
    """A Wanda-pruned MLP (the model the Endor method streams): its zeros are its mask, and adapters keep
    to them. Each adapted projection computes `W x + ((s·BA) ⊙ M) x` with `M = (W ≠ 0)`, so the fused
    `W + (s·BA) ⊙ M` keeps the pruning pattern, and with it Endor's compression, while giving exactly
    the trained model's outputs. (peft's own `merge_and_unload` would add the unmasked delta.)"""

    def __init__(self, owner: nn.Module, spec: MLPSpec, d_model: int, d_ff: int) -> None:
        super().__init__(owner, spec, d_model, d_ff)
        for role, name in self.roles.items():
            self.register_buffer(f"pattern_{role}", getattr(owner, name).weight != 0, persistent=False)

    def project(self, role: str, x: torch.Tensor) -> torch.Tensor:
        projection = self.get_submodule(self.roles[role])
        if not hasattr(projection, "get_delta_weight") or projection.disable_adapters or projection.merged:
            return projection(x)  # no adapter, or a peft adapter switched off
        out = projection.get_base_layer()(x)
        pattern = self.get_buffer(f"pattern_{role}")
        for adapter in projection.active_adapters:
            out = out + F.linear(x, projection.get_delta_weight(adapter) * pattern)
        return out

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)  # the mask is in the weights, and in `project` for the adapters


MASKED_MLPS: dict[str, type[MaskedMLP]] = {
    "dip": MaskedDIP,
    "glu": MaskedGLU,
    "up": MaskedUp,
    "gate": MaskedGate,
    "cats": MaskedCATS,
    "predictor": MaskedPredictor,
    "predictor-gate": MaskedPredictor,  # the same neurons, read in another order
    "endor": PrunedMLP,
}
"""The training-time module of each method LoRA recovery supports."""


def mask_mlps(model: nn.Module, store: Any, config: FlashConfig) -> list[MaskedMLP]:
    """Put the training-time MLP of `config.method` in place of every MLP of `model` (in place), with the
    masks the streaming module would apply at `config.density` on `store` (its calibration, its
    predictors). Returns the new modules in layer order.

    Raises `UnsupportedArchitectureError` for MLPs that are not gated with separate gate and up
    projections, and `ConfigError` for a method without a training-time module.
    """
    from ..methods.calibration import Calibration
    from ..methods.selection import selection_options

    if config.method not in MASKED_MLPS:
        raise ConfigError(
            f"LoRA recovery trains under the masks of {', '.join(MASKED_MLPS)}; method={config.method!r} "
            "has no training-time module."
        )
    spec = spec_for(model_type_of(model.config))
    if spec.gate is None or not spec.owner:
        raise UnsupportedArchitectureError(
            f"LoRA recovery needs a gated MLP with separate gate and up projections under one owner module; "
            f"{spec.family} models do not have one."
        )
    calibration = Calibration.load(store.path, store.content_sha256)
    cls = MASKED_MLPS[config.method]
    predictors = None
    if cls is MaskedPredictor:
        from ..predictors import Predictors

        predictors = Predictors.load(store)
    masked = []
    for layer, name, owner in find_mlps(model, spec):
        selection = (
            {}
            if cls is PrunedMLP  # the pruned weights are the mask
            else selection_options(config, layer, store.d_model, store.d_ff, calibration, store.path)
        )
        if predictors is not None:
            selection["predictor"] = (
                predictors[layer].to(next(owner.parameters()).device).requires_grad_(False)
            )
        module = cls(owner, spec, store.d_model, store.d_ff, **selection)
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, module)
        masked.append(module)
    return masked


@contextlib.contextmanager
def dense_mlps(model: nn.Module) -> Iterator[None]:
    """Within the block, every `MaskedMLP` of `model` computes the dense MLP (the distillation teacher)."""
    modules = [m for m in model.modules() if isinstance(m, MaskedMLP)]
    states = [m.masking for m in modules]
    for module in modules:
        module.masking = False
    try:
        yield
    finally:
        for module, state in zip(modules, states, strict=True):
            module.masking = state


# --------------------------------------------------------------------------------------------------
# Options, saving
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraOptions:
    """The recipe's choices (the trainer's are a `TrainConfig`). `method` is a method spec as the bench
    takes them (`dip`, `dip-ca`, `cats`, `predictor`, ..., `endor` for a Wanda-pruned checkpoint),
    trained at MLP `density` (None: 0.5; 1.0 for `endor`, whose sparsity is in its weights) on `store`
    (None: the model's default store), whose calibration and predictors give the masks."""

    output_dir: str | os.PathLike
    model: str | os.PathLike | None = None
    method: str = "dip"
    density: float | None = None
    store: str | os.PathLike | None = None
    rank: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    corpora: tuple[str, ...] = DEFAULT_TRAIN_CORPORA
    train_texts: tuple[str, ...] = ()
    seq_len: int = 128
    teacher_samples: int = 0
    teacher_prompts: str = "rows"
    mixed_precision: str = "no"
    fuse: bool = True
    evaluate: bool = True
    eval_corpora: tuple[str, ...] = DEFAULT_EVAL_CORPORA
    eval_tokens: int = 4096
    eval_context: int = 512
    memory_budget: int | str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.density is None:
            object.__setattr__(self, "density", 1.0 if self.method == "endor" else 0.5)
        if not 0 < self.density <= 1:
            raise ConfigError(f"density must be in (0, 1], got {self.density}.")
        if self.rank < 1:
            raise ConfigError(f"rank must be >= 1, got {self.rank}.")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be >= 2, got {self.seq_len}.")
        if self.teacher_samples < 0:
            raise ConfigError(f"teacher_samples must be >= 0, got {self.teacher_samples}.")
        check_teacher_prompts(self.teacher_prompts)
        if self.flash_config().method not in MASKED_MLPS:
            raise ConfigError(
                f"LoRA recovery trains under the masks of {', '.join(MASKED_MLPS)}; {self.method!r} is not "
                "one of them."
            )
        if self.evaluate and not self.fuse:
            raise ConfigError("The evaluation streams the fused store: keep fuse=True, or evaluate=False.")

    def flash_config(self) -> FlashConfig:
        """The sparse method the adapters recover (and the fused store is streamed with)."""
        return FlashConfig(**parse_method_spec(self.method), density=self.density, store=self.store)


_RUNTIME_OPTIONS = (
    "output_dir",
    "store",  # what matters of it, its content hash, is in the run's fingerprint
    "fuse",
    "evaluate",
    "eval_corpora",
    "eval_tokens",
    "eval_context",
    "progress",
)
"""LoraOptions that do not change training, left out of the run's fingerprint."""


def lora_record(options: LoraOptions, store: Any, model: str) -> dict[str, Any]:
    """`flashlm_lora.json`: what `flashlm.store.fuse` checks, and how the adapter was trained."""
    return {
        "flashlm_version": __version__,
        "store_content_sha256": store.content_sha256,
        "store_fingerprint": store.fingerprint,
        "model": model,
        "method": options.method,
        "density": options.density,
        "recipe": {k: v for k, v in asdict(options).items() if k not in _RUNTIME_OPTIONS},
    }


def save_adapter(peft_model: nn.Module, path: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Save `peft_model`'s adapter to `path` with peft's `save_pretrained`, plus `flashlm_lora.json`;
    written under a temporary name and renamed, replacing an adapter already there."""
    from ..store.convert import move_into_place

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        peft_model.save_pretrained(str(tmp))
        (tmp / ADAPTER_RECORD).write_text(json.dumps(record, indent=2))
        move_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


@dataclass
class LoraReport:
    """What `run` did and measured; `to_dict()` is `OUT/report.json`."""

    model: str
    options: dict[str, Any]
    store: str
    """The store trained on, whose calibration and predictors gave the masks."""
    adapter: str
    fused: str | None
    """The store with the adapter fused in (`OUT/store.flash`); for `endor`, the pruned checkpoint with
    the adapter fused in (`OUT/model`), which the Endor method compresses when it loads it."""
    steps: int
    start_step: int
    train_seconds: float
    first_loss: float
    final_loss: float
    peak_rss_mb: float
    """This process's peak resident memory by the end of training (the model in float32, the adapters
    and their optimizer state, one batch's activations and the teacher's logits)."""
    measurements: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def gap_closed(self, corpus: str) -> float:
        """The fraction of the sparse model's perplexity gap to dense that the adapter closes."""
        m = self.measurements
        return gap_closed(*(m[stage][corpus]["perplexity"] for stage in ("dense", "sparse", "sparse+lora")))


def gap_closed(dense: float, sparse: float, recovered: float) -> float:
    """`(sparse - recovered) / (sparse - dense)`: the share of the sparse model's perplexity gap to the
    dense model that recovery closes (NaN when there is no gap)."""
    return (sparse - recovered) / (sparse - dense) if sparse != dense else math.nan


def format_report(report: LoraReport) -> str:
    """The measurements as a table: perplexity per stage and corpus, and the gap closed."""
    corpora = list(report.measurements.get("dense", {}))
    width = corpus_column_width(corpora)
    lines = [
        f"{report.steps} steps, loss {report.first_loss:.4f} -> {report.final_loss:.4f}, "
        f"peak RSS {report.peak_rss_mb:.0f} MB",
        f"{'stage':<14} {'corpus':<{width}} {'perplexity':>11} {'vs dense':>9}",
    ]
    for corpus in corpora:
        dense = report.measurements["dense"][corpus]["perplexity"]
        for stage in ("dense", "sparse", "sparse+lora"):
            ppl = report.measurements[stage][corpus]["perplexity"]
            lines.append(f"{stage:<14} {corpus:<{width}} {ppl:>11.3f} {ppl / dense - 1:>+9.1%}")
        lines.append(f"{'gap closed':<14} {corpus:<{width}} {report.gap_closed(corpus):>11.1%}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------------------------------


def run(
    options: LoraOptions,
    train: TrainConfig | None = None,
    *,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> LoraReport:
    """Train, save, fuse and measure (see the module docstring). Every process calls it; only the main
    process saves, fuses and measures. `train.output_dir` is ignored: the trainer writes to `OUT/train`."""
    from accelerate.utils import set_seed
    from transformers import AutoTokenizer

    from ..data.models import model_path
    from ..methods.mlp import open_checkpoint_store
    from .checkpoints import load_checkpoint
    from .data import SAMPLES_NAME, corpus_sequences, teacher_samples
    from .relufy import target_linears
    from .trainer import ModelTeacher, Trainer, make_accelerator, report_options

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise TrainingError("LoRA recovery needs the peft package: pip install 'flashlm[training]'.") from exc

    out = Path(options.output_dir)
    if train is None:
        train = TrainConfig(output_dir=out, steps=1000, lr=1e-3, warmup_steps=20)
    train = TrainConfig(**{**asdict(train), "output_dir": out / TRAIN_DIR})
    flash_config = options.flash_config()
    accelerator = make_accelerator(options.mixed_precision)
    main = accelerator.is_main_process
    with accelerator.main_process_first():  # convert the bundled model and its store, tokenize, once
        path = model_path(options.model, progress=options.progress and main)
        tokenizer = AutoTokenizer.from_pretrained(path)
        sequences = corpus_sequences(options.corpora, tokenizer, options.seq_len, texts=options.train_texts)
        store = open_checkpoint_store(path, flash_config, progress=options.progress and main)

    set_seed(train.seed)
    model = load_checkpoint(path, dtype=torch.float32)
    dense = None
    if flash_config.method == "endor":  # the pruned weights are not the dense ones: a frozen dense copy
        dense = load_checkpoint(dense_source(path), dtype=torch.float32).requires_grad_(False)
    with accelerator.main_process_first():  # the main process samples, the others read its rows
        sampled = teacher_samples(
            dense if dense is not None else model,
            sequences,
            options.teacher_samples,
            seed=train.seed,
            source=str(dense_source(path) if dense is not None else path),
            cache=out / SAMPLES_NAME,
            device=accelerator.device,
            progress=options.progress and main,
            prompts=options.teacher_prompts,
        )
    mask_mlps(model, store, flash_config)
    lora = LoraConfig(
        r=options.rank,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=target_linears(model, "mlp"),
        bias="none",
    )
    student = get_peft_model(model, lora)
    if dense is not None:
        teacher = ModelTeacher(dense.to(accelerator.device))
    else:
        teacher = ModelTeacher(student, (student.disable_adapter, lambda: dense_mlps(student)))
    record = lora_record(options, store, str(path))
    trainer = Trainer(
        student,
        torch.cat([sequences, sampled]),
        train,
        teacher=teacher,
        accelerator=accelerator,
        fingerprint_extra={"store": store.content_sha256, "recipe": record["recipe"]},
    )
    result = trainer.train(on_step=on_step)
    losses = result.losses
    report = LoraReport(
        model=str(path),
        options=report_options(options, accelerator, train),
        store=str(store.path),
        adapter=str(out / ADAPTER_DIR),
        fused=None,
        steps=train.steps,
        start_step=result.start_step,
        train_seconds=result.seconds,
        first_loss=losses[0]["loss"] if losses else math.nan,
        final_loss=result.final_loss,
        peak_rss_mb=peak_rss_bytes() / 2**20,
    )
    if main:
        save_adapter(trainer.unwrapped(), out / ADAPTER_DIR, record)
        if options.fuse and flash_config.method == "endor":
            fused_dir = fuse_pruned_checkpoint(
                path, out / ADAPTER_DIR, out / FUSED_CHECKPOINT, overwrite=True
            )
            report.fused = str(fused_dir)
        elif options.fuse:  # the run's own output: a run started again replaces it
            fused = fuse_adapter(
                store, out / ADAPTER_DIR, out / FUSED_STORE, overwrite=True, progress=options.progress
            )
            report.fused = str(fused.path)
        if options.evaluate:
            report.measurements = measure(report, options, path)
        (out / REPORT_NAME).write_text(json.dumps(report.to_dict(), indent=2, default=str))
    accelerator.wait_for_everyone()
    # Gloo's worker threads can abort the interpreter's exit (SIGABRT) unless the group is destroyed first.
    accelerator.end_training()
    return report


def measure(report: LoraReport, options: LoraOptions, path: Path) -> dict[str, dict[str, Any]]:
    """Perplexity on the test splits: dense (in RAM), the method as trained on, the method with the
    adapter fused in. For `endor`: the unpruned source, the pruned checkpoint, the fused checkpoint."""
    from ..eval.perplexity import evaluate

    sparse = {"method_spec": options.method, "density": options.density}
    if options.method == "endor":
        stages = {
            "dense": (dense_source(path), {"method_spec": "dense", "density": 1.0}),
            "sparse": (path, sparse),
            "sparse+lora": (Path(report.fused), sparse),
        }
    else:
        stages = {
            "dense": (path, {"method_spec": "dense", "density": 1.0}),
            "sparse": (path, {**sparse, "store": options.store}),
            "sparse+lora": (path, {**sparse, "store": report.fused}),
        }
    measurements: dict[str, dict[str, Any]] = {}
    for stage, (model, kwargs) in stages.items():
        for corpus in options.eval_corpora:
            print(f"measuring {stage} on {corpus} ...", file=sys.stderr, flush=True)
            result = evaluate(
                model,
                corpus,
                context_length=options.eval_context,
                num_tokens=options.eval_tokens,
                memory_budget=options.memory_budget,
                progress=options.progress,
                **kwargs,
            )
            measurements.setdefault(stage, {})[corpus] = result.to_dict()
    return measurements


def dense_source(pruned: Path) -> Path:
    """The checkpoint a Wanda-pruned one was pruned from (its `pruning.json`): the Endor recipe's teacher."""
    from ..workflows.prune import read_pruning_record

    record = read_pruning_record(pruned)
    if record is None or not Path(record.get("source", "")).is_dir():
        raise ConfigError(
            f"method='endor' recovers a checkpoint `flashlm prune` wrote, distilling from the checkpoint it "
            f"was pruned from; {pruned} has no pruning.json naming one that exists here."
        )
    return Path(record["source"])


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def build_parser(prog: str = "python -m flashlm.training.lora") -> argparse.ArgumentParser:
    """The recipe's arguments (shared by `python -m`, `accelerate launch -m` and `flashlm train lora`)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train LoRA adapters on a sparse model's MLPs by distillation from the dense model "
        "(DIP paper §4), save them, fuse them into a copy of the store and measure perplexity.",
    )
    add_recipe_arguments(p, outputs="train/, adapter/, store.flash, report.json")
    p.add_argument(
        "--method", default="dip", help=f"method spec to recover ({', '.join(MASKED_MLPS)}, dip-ca, ...)"
    )
    p.add_argument("--density", type=float, default=None, help="MLP density (default: 0.5; endor: 1)")
    p.add_argument("--store", default=None, help="the store to train on and fuse from (default: the model's)")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank (default: 32, the paper's)")
    p.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (default: 32)")
    p.add_argument("--dropout", type=float, default=0.0)
    add_trainer_arguments(p, steps=1000, lr_default="1e-3")
    add_eval_arguments(p)
    p.add_argument("--memory-budget", default=None, help="the flashlm rows' budget (default: FlashConfig's)")
    return p


def options_from_args(args: argparse.Namespace) -> tuple[LoraOptions, TrainConfig]:
    """The recipe's and the trainer's settings from parsed arguments."""
    options = LoraOptions(
        **recipe_options_from_args(args),
        method=args.method,
        density=args.density,
        store=args.store,
        rank=args.rank,
        alpha=args.alpha,
        dropout=args.dropout,
        memory_budget=args.memory_budget,
    )
    lr = args.lr if args.lr is not None else 1e-3
    return options, train_config_from_args(args, Path(args.out) / TRAIN_DIR, lr=lr)


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m flashlm.training.lora") -> int:
    """Run the recipe from command-line arguments; prints the report on the main process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser(prog).parse_args(argv)
    try:
        options, train = options_from_args(args)
        started = time.perf_counter()
        report = run(options, train)
    except FlashLMError as exc:
        print(f"flashlm: error: {exc}", file=sys.stderr)
        return 2
    if report.measurements:
        print(json.dumps(report.to_dict(), indent=2, default=str) if args.json else format_report(report))
    print(
        f"adapter {report.adapter}, fused {report.fused}, {time.perf_counter() - started:.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
