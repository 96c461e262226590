"""Architecture table: where each supported model keeps its MLP and how the MLP computes.

One `MLPSpec` per family; `spec_for(model_type)` looks it up, `find_mlps(model, spec)` finds the MLP
owners in a model with one walk over `named_modules()`, and `mlp_weight_names` names their tensors
in a checkpoint, so conversion and patching share one definition of every architecture.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from torch import nn

from .errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class MLPSpec:
    """How one architecture family lays out its MLP.

    `owner` is the attribute of a decoder layer that holds the projections (`"mlp"`), or `""` when
    the projections sit on the decoder layer itself (OPT). A gated MLP computes
    `down(act(gate(x)) * up(x))`, from separate `gate`/`up` linears or from one fused `gate_up`
    linear whose first half is the gate (Phi-3); a plain MLP computes `down(act(up(x) + b) ) + b`.
    """

    family: str
    owner: str
    up: str
    down: str
    act: str
    act_config_key: str
    gate: str | None = None
    gate_up: str | None = None

    @property
    def gated(self) -> bool:
        return self.gate is not None or self.gate_up is not None

    @property
    def input_projections(self) -> tuple[str, ...]:
        """Names of the linears that read the MLP input, in the order they are replaced."""
        if self.gate_up is not None:
            return (self.gate_up,)
        return (self.gate, self.up) if self.gate is not None else (self.up,)


_LLAMA_LIKE = MLPSpec(
    family="llama",
    owner="mlp",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    act="act_fn",
    act_config_key="hidden_act",
)
_GEMMA = MLPSpec(
    family="gemma",
    owner="mlp",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    act="act_fn",
    act_config_key="hidden_activation",
)
_PHI3 = MLPSpec(
    family="phi3",
    owner="mlp",
    gate_up="gate_up_proj",
    up="gate_up_proj",
    down="down_proj",
    act="activation_fn",
    act_config_key="hidden_act",
)
_OPT = MLPSpec(
    family="opt",
    owner="",
    up="fc1",
    down="fc2",
    act="activation_fn",
    act_config_key="activation_function",
)
_FALCON = MLPSpec(
    family="falcon",
    owner="mlp",
    up="dense_h_to_4h",
    down="dense_4h_to_h",
    act="act",
    act_config_key="activation",
)

ARCHITECTURES: dict[str, MLPSpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "phi3": _PHI3,
    "gemma": replace(_GEMMA, act_config_key="hidden_act"),  # Gemma 1 names it hidden_act; 2 and 3 do not
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
    "gemma3_text": _GEMMA,
    "opt": _OPT,
    "falcon": _FALCON,
}


def spec_for(model_type: str) -> MLPSpec:
    """The `MLPSpec` of `model_type`, or `UnsupportedArchitectureError` naming the supported ones."""
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"flashlm does not support model_type {model_type!r}. "
            f"Supported model types: {', '.join(sorted(ARCHITECTURES))}."
        ) from None


def model_type_of(config) -> str:
    """The model_type whose MLPs flashlm patches (the text model's, for multimodal configs)."""
    text_config = getattr(config, "text_config", None)
    if config.model_type not in ARCHITECTURES and text_config is not None:
        return text_config.model_type
    return config.model_type


def layer_index(name: str) -> int | None:
    """The layer a module or tensor name belongs to: its last dotted number (`layers.3.mlp` -> 3)."""
    numbers = [part for part in name.split(".") if part.isdigit()]
    return int(numbers[-1]) if numbers else None


def find_mlps(model: nn.Module, spec: MLPSpec) -> list[tuple[int, str, nn.Module]]:
    """`(layer_index, qualified_name, owner_module)` of every MLP owner in `model`, sorted by layer.

    An owner is a module, inside a numbered layer, whose children include all the spec's projection
    names. Raises `UnsupportedArchitectureError` when nothing matches, naming what was looked for.
    """
    wanted = {spec.down, *spec.input_projections}
    found = []
    for name, module in list(model.named_modules()):
        if spec.owner and name.rsplit(".", 1)[-1] != spec.owner:
            continue
        children = dict(module.named_children())
        if not wanted.issubset(children):
            continue
        index = layer_index(name)
        if index is not None:
            found.append((index, name, module))
    if not found:
        raise UnsupportedArchitectureError(
            f"No MLP of the {spec.family} family found in {type(model).__name__}: looked for modules "
            f"{'named ' + repr(spec.owner) + ' ' if spec.owner else ''}inside numbered layers with children "
            f"{sorted(wanted)}. Was the model already patched, or is its model_type mislabelled?"
        )
    found.sort(key=lambda item: item[0])
    indices = [index for index, _, _ in found]
    if indices != list(range(len(found))):
        raise UnsupportedArchitectureError(
            f"Expected MLPs in layers 0..{len(found) - 1} of {type(model).__name__}, found layers {indices}."
        )
    return found


def mlp_weight_names(spec: MLPSpec, owner_name: str) -> dict[str, str]:
    """Checkpoint tensor names of one MLP, keyed by role: gate, up, gate_up, down, up_bias, down_bias.

    Biases are listed for plain (non-gated) MLPs; a checkpoint may lack them (`bias=False`).
    """
    prefix = f"{owner_name}." if owner_name else ""
    names = {"down": f"{prefix}{spec.down}.weight"}
    if spec.gate_up is not None:
        names["gate_up"] = f"{prefix}{spec.gate_up}.weight"
    else:
        names["up"] = f"{prefix}{spec.up}.weight"
        if spec.gate is not None:
            names["gate"] = f"{prefix}{spec.gate}.weight"
        else:
            names["up_bias"] = f"{prefix}{spec.up}.bias"
            names["down_bias"] = f"{prefix}{spec.down}.bias"
    return names


def mlp_owner_names(spec: MLPSpec, tensor_names: Iterable[str]) -> list[str]:
    """Owner names (`model.layers.3.mlp`) of the MLPs in a checkpoint's tensor names, by layer."""
    suffix = re.escape(f"{spec.down}.weight")
    owner = re.escape(spec.owner)
    pattern = re.compile(rf"^(.*\.\d+\.{owner})\.{suffix}$" if spec.owner else rf"^(.*\.\d+)\.{suffix}$")
    owners = [match.group(1) for name in tensor_names if (match := pattern.match(name))]
    owners.sort(key=layer_index)
    if not owners:
        raise UnsupportedArchitectureError(
            f"No {spec.family}-family MLP weights (names ending in '{spec.down}.weight' inside numbered "
            "layers) found in the checkpoint."
        )
    return owners


def decoder_layers(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """`(layer_index, qualified_name, layer_module)` of every decoder layer, found through its MLP.

    A decoder layer is the module that holds the MLP owner (`model.layers.3` for `model.layers.3.mlp`),
    or the owner itself where the projections sit on the layer (OPT).
    """
    spec = spec_for(model_type_of(model.config))
    layers = []
    for index, owner_name, owner in find_mlps(model, spec):
        name = owner_name.rsplit(".", 1)[0] if spec.owner else owner_name
        layers.append((index, name, model.get_submodule(name) if spec.owner else owner))
    return layers


def layer_linears(layer: nn.Module) -> list[str]:
    """Names, relative to `layer`, of every `nn.Linear` inside it (attention and MLP), in module order."""
    return [name for name, module in layer.named_modules() if isinstance(module, nn.Linear)]
