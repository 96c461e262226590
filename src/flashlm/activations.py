"""ReLU / FATReLU in place of a model's MLP activation, and how many of its outputs are exactly zero.

Relufication (Mirzadeh et al., "ReLU strikes back"; PowerInfer §2 and Song et al.'s FATReLU, cited by
LLM in a flash §1 and appendix) replaces the SiLU of a SwiGLU MLP's gate, `down(act(gate x) * up x)`,
by ReLU or by FATReLU(t) — zero below a threshold `t >= 0`, the identity above — so that most
intermediate neurons are *exactly* zero and their up row and down column need not be read at all.
The MLPs are found through `flashlm.arch` (`spec_for`, `find_mlps`; the activation is the MLP
owner's `spec.act` attribute), never through a hard-coded module path, so every supported family
works, including OPT and Falcon, whose plain MLPs have one activation after `fc1` / `dense_h_to_4h`.

- `FATReLU(threshold, replaces)`: the module; it remembers which activation it replaced (an
  `ACT2FN` name such as `"silu"`) so the dense model can be restored for distillation.
- `relufy(model, thresholds)`: install one FATReLU per MLP (threshold 0 is ReLU) and record the
  change in `model.config` (`hidden_act` = `"relu"` or `"fatrelu"`, plus a `relufication` dict).
- `restore_relufication(model)`: the thresholds a relufied checkpoint's config records, put back on a
  model built with plain ReLU (transformers cannot build FATReLU); the loader calls it before patching.

It sits at the bottom of the package, beside `arch`, because loading a relufied model needs it as
much as the relufication recipe does; the recipe's own tools (the dense teacher, threshold
calibration, zero counting) are in `flashlm.training.activations`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .arch import MLPSpec, find_mlps, model_type_of, spec_for
from .errors import ConfigError, RelufiedCheckpointError

RELU = "relu"
FATRELU = "fatrelu"
CONFIG_FIELD = "relufication"
"""The `config.json` field recording a relufication: activation, per-layer thresholds, replaced act."""


class FATReLU(nn.Module):
    """`x` where `x > threshold`, exactly `0` elsewhere (threshold >= 0; threshold 0 is ReLU).

    The zero is a true +0.0 (`torch.where`, not a product that could give -0.0), so "exactly zero"
    counts are unambiguous. `threshold` is not in the weights: the checkpoint records the thresholds
    in `config.json` (`relufication.thresholds`), keeping the weights file the architecture's
    ordinary tensors. `replaces` names the activation it took the place of in
    `transformers.activations.ACT2FN`, which `dense_activations` puts back.
    """

    def __init__(self, threshold: float = 0.0, replaces: str = "silu") -> None:
        super().__init__()
        threshold = float(threshold)
        if not threshold >= 0:
            raise ConfigError(f"A FATReLU threshold must be >= 0 (0 is ReLU), got {threshold}.")
        self.threshold = threshold
        """A number, not a buffer: transformers' loader replaces every non-persistent buffer with an
        uninitialized one after loading, and a relufied model's MLPs are swapped while it is on the meta
        device (`restore_relufication`)."""
        self.replaces = replaces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > self.threshold, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def extra_repr(self) -> str:
        return f"threshold={self.threshold:.6g}, replaces={self.replaces!r}"


def is_silu(module: nn.Module) -> bool:
    """Whether `module` computes exactly `torch.nn.functional.silu` (torch's module or transformers' own;
    a subclass, or a kernel swapped in for transformers', may compute something else)."""
    from transformers.activations import SiLUActivation

    return type(module) is nn.SiLU or (
        type(module) is SiLUActivation and type(module).forward is SiLUActivation.forward
    )


@dataclass(frozen=True)
class Activation:
    """One MLP's activation: its layer, the module that owns it and the attribute that holds it."""

    layer: int
    owner_name: str
    owner: nn.Module
    attribute: str

    @property
    def module(self) -> nn.Module:
        return getattr(self.owner, self.attribute)

    @property
    def name(self) -> str:
        return f"{self.owner_name}.{self.attribute}" if self.owner_name else self.attribute


def _config_of(model: nn.Module) -> Any:
    """The Hugging Face config of `model`, through DDP / Accelerate / PEFT wrappers."""
    inner = model
    while not hasattr(inner, "config") and hasattr(inner, "module"):
        inner = inner.module
    config = getattr(inner, "config", None)
    if config is None:
        raise ConfigError(f"{type(model).__name__} has no Hugging Face config: relufy a transformers model.")
    return config


def _spec(model: nn.Module) -> MLPSpec:
    return spec_for(model_type_of(_config_of(model)))


def activations(model: nn.Module) -> list[Activation]:
    """Every MLP activation of `model`, by layer (found with `flashlm.arch.find_mlps`)."""
    spec = _spec(model)
    found = [
        Activation(index, name, owner, spec.act)
        for index, name, owner in find_mlps(model, spec)
        if hasattr(owner, spec.act)
    ]
    if not found:
        raise ConfigError(
            f"No MLP of {type(model).__name__} has an activation attribute {spec.act!r}: was it patched "
            "by flashlm (whose modules hold the activation themselves)? Relufy the plain model."
        )
    modules = [id(a.module) for a in found]
    if len(set(modules)) != len(modules):
        raise ConfigError(
            "Several MLPs share one activation module, so per-layer thresholds and zero counts cannot "
            "be told apart. Build the model so that each MLP owns its activation."
        )
    return found


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _activation_name(model: nn.Module) -> str:
    """The config's name of the MLP activation (`"silu"`, `"gelu_pytorch_tanh"`, ...)."""
    spec = _spec(model)
    return getattr(_text_config(_config_of(model)), spec.act_config_key)


def _thresholds(thresholds: float | Sequence[float], layers: int) -> list[float]:
    if isinstance(thresholds, (int, float)) and not isinstance(thresholds, bool):
        values = [float(thresholds)] * layers
    else:
        values = [float(t) for t in thresholds]
    if len(values) != layers:
        raise ConfigError(f"Expected one threshold per MLP layer ({layers}), got {len(values)}.")
    bad = [t for t in values if not t >= 0]
    if bad:
        raise ConfigError(f"FATReLU thresholds must be >= 0 (0 is ReLU), got {bad[:3]}.")
    return values


def fatrelu_by_name() -> nn.Module:
    """What transformers' activation table (`ACT2FN["fatrelu"]`, registered on `import flashlm`) builds
    for a relufied checkpoint's `hidden_act`: nothing, loudly. The thresholds are per layer, in the
    config's `relufication` record, which an activation built from its name cannot see; building a
    plain ReLU would silently load another model, and without this entry transformers fails with a
    bare `KeyError: 'fatrelu'`."""
    raise RelufiedCheckpointError(
        "This checkpoint was relufied by flashlm (hidden_act='fatrelu', per-layer thresholds in its "
        "config's 'relufication' record), which transformers cannot build from the config alone. Load "
        "it with flashlm.training.checkpoints.load_checkpoint(path), or pass "
        "config=flashlm.training.checkpoints.buildable_config(path) to from_pretrained (with "
        "quantization_config=FlashConfig(...) to stream it)."
    )


def relufy(model: nn.Module, thresholds: float | Sequence[float] = 0.0) -> list[str]:
    """Replace every MLP activation of `model` by FATReLU (threshold 0: ReLU), in place.

    `thresholds` is one value for every layer or one per layer. Nothing else changes: no weight, no
    other module. `model.config` records the change (the family's activation key — `hidden_act` for
    Llama — becomes `"relu"` or `"fatrelu"`; `config.relufication` holds the activation, the
    thresholds and the replaced activation's name), so `save_pretrained` describes the new model.
    Relufying a relufied model only changes its thresholds. Returns the replaced modules' names.
    """
    from transformers.activations import ACT2FN

    found = activations(model)
    values = _thresholds(thresholds, len(found))
    config = _config_of(model)
    record = getattr(config, CONFIG_FIELD, None)
    replaces = record["replaces"] if isinstance(record, dict) else _activation_name(model)
    if replaces not in ACT2FN:
        raise ConfigError(
            f"The model's activation {replaces!r} is not one transformers knows (ACT2FN), so it could "
            "not be restored for distillation. Set the config's activation name correctly first."
        )
    for act, threshold in zip(found, values, strict=True):
        setattr(act.owner, act.attribute, FATReLU(threshold, replaces=replaces))
    activation = RELU if all(t == 0 for t in values) else FATRELU
    setattr(_text_config(config), _spec(model).act_config_key, activation)
    setattr(config, CONFIG_FIELD, {"activation": activation, "thresholds": values, "replaces": replaces})
    return [act.name for act in found]


def is_relufied(model: nn.Module) -> bool:
    """Whether every MLP activation of `model` is a FATReLU."""
    return all(isinstance(act.module, FATReLU) for act in activations(model))


def restore_relufication(model: nn.Module) -> bool:
    """Install the FATReLU thresholds `model.config` records (`relufication`) on a model built from a
    relufied checkpoint's `buildable_config` (plain ReLU in their place); False, and nothing done, for
    a config without that record. Works on the meta device: transformers' loader calls it (through
    `flashlm.patching.patch_for_loading`) before the MLPs are swapped, so they take the thresholds."""
    record = getattr(model.config, CONFIG_FIELD, None)
    if not isinstance(record, dict) or "thresholds" not in record:
        return False
    relufy(model, record["thresholds"])
    return True
