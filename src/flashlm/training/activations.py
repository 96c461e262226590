"""The relufication recipe's tools around the activations `flashlm.activations` installs.

- `dense_activations(model)`: a context manager that swaps the original activations back, so a LoRA
  student computes its dense teacher's logits with the same weights (adapters disabled as well).
- `calibrate_thresholds(model, ids, target)`: per-layer thresholds at the `target` quantile of the
  gate pre-activations on calibration text, so each layer starts with `target` of its outputs zero.
- `allocate_zeros(model, ids, mean_target)`: per-layer zero fractions with that mean, fewer where a
  layer's zeros cost the model more (each layer's cost measured with it alone relufied), and their
  thresholds.
- `threshold_ramp(model, thresholds, steps)`: a trainer hook that grows the FATReLU thresholds from
  0 (ReLU) to `thresholds` over the first `steps` optimizer steps.
- `ZeroCounter` / `zero_fractions`: forward hooks on the activation modules that count exact zeros
  per layer, on held-out text.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._utils import model_device
from ..activations import FATReLU, activations
from ..errors import ConfigError
from .data import evenly_spaced_rows


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


@torch.no_grad()
def _gate_inputs(model: nn.Module, windows: torch.Tensor, sample: int) -> list[torch.Tensor]:
    """About `sample` of each layer's activation inputs (the gate pre-activations) over `windows`, by
    layer: a seeded random subset, because a stride could alias onto a few neurons."""
    found = activations(model)
    generator = torch.Generator().manual_seed(0)
    per_call = -(-sample // windows.shape[0])
    collected: dict[int, list[torch.Tensor]] = {act.layer: [] for act in found}

    def keep(layer: int, values: torch.Tensor) -> None:
        values = values.detach().float().flatten().cpu()
        if values.numel() > per_call:
            values = values[torch.randint(values.numel(), (per_call,), generator=generator)]
        collected[layer].append(values)

    handles = [
        act.module.register_forward_hook(lambda module, args, output, layer=act.layer: keep(layer, args[0]))
        for act in found
    ]
    try:
        for _ in _window_logits(model, windows):
            pass
    finally:
        for handle in handles:
            handle.remove()
    return [torch.cat(collected[act.layer]) for act in found]


def _window_logits(model: nn.Module, windows: torch.Tensor) -> Iterator[torch.Tensor]:
    """The logits of each window, run one at a time in eval mode (the mode is restored after)."""
    was_training = model.training
    model.eval()
    device = model_device(model)
    try:
        for window in windows:
            yield model(input_ids=window.unsqueeze(0).to(device), use_cache=False).logits[0]
    finally:
        model.train(was_training)


def _quantile_thresholds(inputs: Sequence[torch.Tensor], target: float) -> list[float]:
    """Each layer's `target` quantile of its sampled inputs, floored at 0 (already that negative: ReLU)."""
    thresholds = []
    for values in inputs:
        k = min(values.numel(), max(1, round(target * values.numel())))
        thresholds.append(max(0.0, torch.kthvalue(values, k).values.item()))
    return thresholds


def _check_target(target: float) -> None:
    if not 0 < target < 1:
        raise ConfigError(f"The target zero fraction must be in (0, 1), got {target}.")


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
    _check_target(target)
    windows = _windows(ids, context_length, num_tokens)
    inputs = _gate_inputs(model, windows, sample)
    return _quantile_thresholds(inputs, target)


ZERO_LEVELS = (0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
"""The zero fractions a layer may get in `allocate_zeros` unless told."""


@dataclass(frozen=True)
class ZeroAllocation:
    """Per-layer zero fractions chosen by `allocate_zeros`, their thresholds, and the costs behind them.

    `costs[layer][i]` is the mean KL divergence (nats per token) of the model's next-token
    distribution from the dense one's with FATReLU at `levels[i]` zeros on that layer alone.
    """

    targets: list[float]
    thresholds: list[float]
    levels: list[float]
    costs: list[list[float]]

    @property
    def mean_target(self) -> float:
        return sum(self.targets) / len(self.targets)


def _check_levels(levels: Sequence[float], mean_target: float) -> None:
    if not levels or not all(0 < level < 1 for level in levels):
        raise ConfigError(f"Zero levels must lie in (0, 1), got {list(levels)}.")
    if not min(levels) <= mean_target <= max(levels):
        raise ConfigError(
            f"The zero levels {list(levels)} cannot average {mean_target}: choose levels on both sides of it."
        )


def cheapest_levels(
    costs: Sequence[Sequence[float]], levels: Sequence[float], mean_target: float
) -> list[int]:
    """The index of a level for each layer that minimizes the summed cost with levels averaging at least
    `mean_target`: an exact multiple-choice knapsack, by dynamic programming over the zero fraction
    reached so far (in thousandths, capped at the need)."""
    _check_levels(levels, mean_target)
    units = [round(level * 1000) for level in levels]
    need = math.ceil(len(costs) * mean_target * 1000 - 1e-6)  # 30 x 0.78 x 1000 is 23400.000000000004
    best = {0: (0.0, [])}  # zero units reached (capped at `need`) -> (cost, level indices)
    for layer_costs in costs:
        step: dict[int, tuple[float, list[int]]] = {}
        for reached, (cost, picks) in best.items():
            for index, (unit, level_cost) in enumerate(zip(units, layer_costs, strict=True)):
                key = min(need, reached + unit)
                candidate = cost + level_cost
                if key not in step or candidate < step[key][0]:
                    step[key] = (candidate, [*picks, index])
        best = step
    return best[need][1]


@torch.no_grad()
def allocate_zeros(
    model: nn.Module,
    ids: torch.Tensor,
    mean_target: float,
    *,
    levels: Sequence[float] = ZERO_LEVELS,
    context_length: int = 256,
    num_tokens: int | None = 4096,
    sensitivity_tokens: int = 1024,
    sample: int = 1 << 20,
    progress: bool = False,
) -> ZeroAllocation:
    """Per-layer zero fractions averaging at least `mean_target`, fewer where a layer's zeros cost more.

    Each layer's cost at each of `levels` is measured with that layer alone relufied (FATReLU at the
    level's threshold, every other layer dense): the mean KL divergence from the dense model's
    next-token distribution over `sensitivity_tokens` of the windows (whole windows, evenly spaced over
    `ids`, at least one: text packed from several sources is scored on each). The choice minimizes
    the summed costs (`cheapest_levels`), which treats the layers' costs as adding up. The
    thresholds are the chosen quantiles of each layer's inputs over all of `ids`'s windows, as in
    `calibrate_thresholds`. A layer's cost also holds what replacing its activation by a ReLU shape
    costs at any level; that part is the same for every choice of that layer, so it moves nothing.
    """
    from tqdm.auto import tqdm

    _check_target(mean_target)
    levels = sorted(float(level) for level in levels)
    _check_levels(levels, mean_target)  # before the forwards, not after them
    windows = _windows(ids, context_length, num_tokens)
    inputs = _gate_inputs(model, windows, sample)
    by_level = [_quantile_thresholds(inputs, level) for level in levels]
    scored = evenly_spaced_rows(windows, max(1, sensitivity_tokens // context_length))
    dense = [logits.float().log_softmax(-1) for logits in _window_logits(model, scored)]

    found = activations(model)  # in the order of `inputs`, so a layer's position indexes both
    costs = [[0.0] * len(levels) for _ in found]
    runs = [(layer, i) for layer in range(len(found)) for i in range(len(levels))]
    for layer, i in tqdm(runs, desc="Zero cost per layer and level", unit="run", disable=not progress):
        act = found[layer]
        original = act.module
        setattr(act.owner, act.attribute, FATReLU(by_level[i][layer]))
        try:
            kl = sum(
                float((reference.exp() * (reference - logits.float().log_softmax(-1))).sum())
                for reference, logits in zip(dense, _window_logits(model, scored), strict=True)
            )
        finally:
            setattr(act.owner, act.attribute, original)
        costs[layer][i] = kl / scored.numel()
    picks = cheapest_levels(costs, levels, mean_target)
    return ZeroAllocation(
        targets=[levels[i] for i in picks],
        thresholds=[by_level[i][layer] for layer, i in enumerate(picks)],
        levels=levels,
        costs=costs,
    )


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
    device = model_device(model)
    try:
        with ZeroCounter(model) as counter:
            for window in _windows(ids, context_length, num_tokens):
                model(input_ids=window.unsqueeze(0).to(device), use_cache=False)
    finally:
        model.train(was_training)
    return counter.overall(), counter.fractions()
