"""The relufication recipe's tools around the activations `flashlm.activations` installs.

- `dense_activations(model)`: a context manager that swaps the original activations back, so a LoRA
  student computes its dense teacher's logits with the same weights (adapters disabled as well).
- `calibrate_thresholds(model, ids, target)`: per-layer thresholds at the `target` quantile of the
  gate pre-activations on calibration text, so each layer starts with `target` of its outputs zero.
- `threshold_ramp(model, thresholds, steps)`: a trainer hook that grows the FATReLU thresholds from
  0 (ReLU) to `thresholds` over the first `steps` optimizer steps.
- `ZeroCounter` / `zero_fractions`: forward hooks on the activation modules that count exact zeros
  per layer, on held-out text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..activations import FATReLU, activations
from ..errors import ConfigError


@contextlib.contextmanager
def dense_activations(model: nn.Module) -> Iterator[None]:
    """Inside the block, every FATReLU of `model` is back to the activation it replaced.

    The weights are untouched, so for a LoRA student (adapters disabled too) the model inside is the
    dense teacher; the FATReLU modules, with their thresholds, come back on exit, even on error.
    """
    from transformers.activations import ACT2FN

    swapped = []
    try:
        for act in activations(model):
            module = act.module
            if isinstance(module, FATReLU):
                setattr(act.owner, act.attribute, ACT2FN[module.replaces])
                swapped.append((act, module))
        yield
    finally:
        for act, module in swapped:
            setattr(act.owner, act.attribute, module)


def _windows(ids: torch.Tensor, context_length: int, num_tokens: int | None) -> torch.Tensor:
    ids = ids.reshape(-1)
    usable = ids.numel() if num_tokens is None else min(ids.numel(), num_tokens)
    count = usable // context_length
    if count < 1:
        raise ConfigError(
            f"Need at least one window of {context_length} tokens, got {usable}: use more text or a "
            "shorter context."
        )
    return ids[: count * context_length].reshape(count, context_length)


def _device_of(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


@torch.no_grad()
def calibrate_thresholds(
    model: nn.Module,
    ids: torch.Tensor,
    target: float,
    *,
    context_length: int = 256,
    num_tokens: int | None = 4096,
    sample: int = 1 << 20,
) -> list[float]:
    """Per-layer FATReLU thresholds that zero a `target` fraction of each layer's activations on `ids`.

    The threshold of a layer is the `target` quantile of its activation's inputs (the gate
    pre-activations) over the windows of `ids`, floored at 0 (a layer whose inputs are already more
    than `target` negative gets ReLU). A uniform threshold would not do: SmolLM2's gate inputs have
    their 80th percentile anywhere between 0.1 and 1.0 depending on the layer. About `sample` values
    per layer (a seeded random subset) enter the quantile, bounding the memory.
    """
    if not 0 < target < 1:
        raise ConfigError(f"The target zero fraction must be in (0, 1), got {target}.")
    found = activations(model)
    windows = _windows(ids, context_length, num_tokens)
    per_call = -(-sample // windows.shape[0])
    generator = torch.Generator().manual_seed(0)
    collected: dict[int, list[torch.Tensor]] = {act.layer: [] for act in found}

    def keep(layer: int, values: torch.Tensor) -> None:
        values = values.detach().float().flatten().cpu()
        if values.numel() > per_call:  # a random subset: a stride could alias onto a few neurons
            values = values[torch.randint(values.numel(), (per_call,), generator=generator)]
        collected[layer].append(values)

    handles = [
        act.module.register_forward_hook(lambda module, args, output, layer=act.layer: keep(layer, args[0]))
        for act in found
    ]
    was_training = model.training
    model.eval()
    try:
        device = _device_of(model)
        for window in windows:
            model(input_ids=window.unsqueeze(0).to(device), use_cache=False)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    thresholds = []
    for act in found:
        values = torch.cat(collected[act.layer])
        k = min(values.numel(), max(1, round(target * values.numel())))
        thresholds.append(max(0.0, torch.kthvalue(values.cpu(), k).values.item()))
    return thresholds


def threshold_ramp(model: nn.Module, thresholds: Sequence[float], steps: int) -> Callable[[int], None]:
    """A `Trainer.train(before_step=...)` hook: at 0-based step `s`, every FATReLU of `model` has
    `min(1, (s + 1) / steps)` times its final threshold, so training starts near plain ReLU and reaches
    the full thresholds (and sparsity) at step `steps - 1`.

    Sparsity raised gradually rather than at once is ProSparse's recipe (Song et al. 2024, the FATReLU
    model LLM in a flash runs). The hook sets the thresholds from the step alone, so a resumed run
    continues the same schedule. The modules' own thresholds, which `relufy` set and the checkpoint
    records, are the final ones: the hook leaves them there from step `steps - 1` on.
    """
    found = [act.module for act in activations(model)]
    if len(found) != len(thresholds) or not all(isinstance(m, FATReLU) for m in found):
        raise ConfigError(
            f"threshold_ramp needs a relufied model with one FATReLU per threshold: got {len(thresholds)} "
            f"thresholds for {len(found)} activations ({sorted({type(m).__name__ for m in found})})."
        )

    def before_step(step: int) -> None:
        scale = min(1.0, (step + 1) / steps)
        for module, final in zip(found, thresholds, strict=True):
            module.threshold = final * scale

    return before_step


class ZeroCounter:
    """Counts, per layer, the exact zeros among the MLP activations' outputs while attached.

    `with ZeroCounter(model) as counter: model(...)`; then `counter.fractions()` (per layer) and
    `counter.overall()` (every output of every layer). For a gated MLP an exact zero of the gate's
    activation makes the neuron's product with `up x` zero, so the neuron's up row and down column
    are not needed for that token: this is the sparsity the streaming runtime can exploit.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.zeros: dict[int, int] = {}
        self.total: dict[int, int] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> ZeroCounter:
        for act in activations(self.model):
            self.zeros[act.layer] = 0
            self.total[act.layer] = 0
            self._handles.append(act.module.register_forward_hook(self._hook(act.layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            self.zeros[layer] += int((output == 0).sum())
            self.total[layer] += output.numel()

        return hook

    def fractions(self) -> list[float]:
        """Exact-zero fraction of each layer's activation outputs, by layer."""
        return [self.zeros[k] / self.total[k] if self.total[k] else float("nan") for k in sorted(self.total)]

    def overall(self) -> float:
        total = sum(self.total.values())
        return sum(self.zeros.values()) / total if total else float("nan")


@torch.no_grad()
def zero_fractions(
    model: nn.Module, ids: torch.Tensor, *, context_length: int = 512, num_tokens: int | None = 4096
) -> tuple[float, list[float]]:
    """(overall, per layer) exact-zero fraction of the MLP activations over windows of `ids`."""
    was_training = model.training
    model.eval()
    device = _device_of(model)
    try:
        with ZeroCounter(model) as counter:
            for window in _windows(ids, context_length, num_tokens):
                model(input_ids=window.unsqueeze(0).to(device), use_cache=False)
    finally:
        model.train(was_training)
    return counter.overall(), counter.fractions()
