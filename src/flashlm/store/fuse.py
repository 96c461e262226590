"""`fuse_adapter`: a store rewritten with LoRA adapters fused into its MLP weights (`W + s·BA`).

The DIP paper applies its recovery adapters before column selection (eq. 9), so a fused store is read
exactly as the unfused one is: the same kinds, layouts and sizes, so the same tokens/s. The adapter
is a peft LoRA adapter directory (`adapter_config.json`, `adapter_model.safetensors`) on the MLP
projections, as `flashlm train lora` saves it, with `flashlm_lora.json` naming the store it was
trained on. Fusing is one pass over the layers (`convert` from a source that reads the store and adds
each projection's delta), written under a temporary name and renamed into place.

The fused store keeps the checkpoint it came from as its identity for loading (a model loaded from
that checkpoint streams its MLPs from the fused store), while its own fingerprint chains the old one
with the adapter's hash and its content hash is that of the fused weights, so anything fitted to the
old weights (a calibration, predictors) no longer matches it. (`flashlm.workflows.fuse` carries the
ones the adapter was trained under over, re-keyed.)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from ..arch import MLPSpec, layer_index, mlp_weight_names, spec_for
from ..errors import (
    StoreCorruptError,
    StoreMismatchError,
    UnsupportedArchitectureError,
)
from .convert import convert, layer_weights
from .format import Store

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_RECORD = "flashlm_lora.json"
"""Beside peft's files: the flashlm version, the store the adapter was trained on and how it was trained."""


class AdapterCorruptError(StoreCorruptError):
    """An adapter directory is incomplete or damaged."""


class AdapterMismatchError(StoreMismatchError):
    """An adapter was trained on other weights than the store holds."""


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter of a store's MLP projections, read from a peft adapter directory and checked
    against the store: its factors `(B, A)` by `(layer, role)` (`role`: `gate`, `up`, `down`; projections
    it does not touch are absent) and its `scaling`."""

    path: Path
    sha256: str
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    scaling: float

    def delta(self, layer: int, role: str) -> torch.Tensor | None:
        """`scaling · B @ A` of one projection in float32, shaped as its weight; None if not adapted.
        Computed when asked: a whole model's deltas in float32 would take twice its bf16 weights."""
        if (layer, role) not in self.factors:
            return None
        b, a = self.factors[(layer, role)]
        return self.scaling * (b.float() @ a.float())

    @classmethod
    def load(cls, path: str | os.PathLike, store: Store) -> LoraAdapter:
        """Read the adapter at `path` for `store`.

        Raises `AdapterCorruptError` when a file is missing, unreadable or inconsistent, and
        `AdapterMismatchError` when the adapter was trained on another store's weights.
        """
        path = Path(path).expanduser()
        retrain = f"The adapter at {path} cannot be used: train it again with `flashlm train lora`."
        files = {name: path / name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_RECORD)}
        missing = [name for name, file in files.items() if not file.is_file()]
        if missing:
            raise AdapterCorruptError(
                f"{path} is not a flashlm LoRA adapter: it lacks {', '.join(missing)}. {retrain}"
            )
        try:
            config_bytes, weights = files[ADAPTER_CONFIG].read_bytes(), files[ADAPTER_WEIGHTS].read_bytes()
            config = json.loads(config_bytes)
            trained_on = str(json.loads(files[ADAPTER_RECORD].read_text())["store_content_sha256"])
            tensors = load_safetensors(weights)  # read once: the same bytes are hashed below
        except Exception as exc:  # safetensors raises its own SafetensorError (no public base class)
            raise AdapterCorruptError(
                f"{path} is unreadable ({type(exc).__name__}: {exc}). {retrain}"
            ) from exc
        if trained_on != store.content_sha256:
            raise AdapterMismatchError(
                f"The adapter at {path} was trained on other weights (store content sha256 "
                f"{trained_on[:12]}...) than the store {store.path} holds ({store.content_sha256[:12]}...). "
                "Fuse it into the store it was trained on, or train an adapter for this one."
            )
        factors, scaling = _factors(config, tensors, store, path, retrain)
        digest = hashlib.sha256(config_bytes)
        digest.update(weights)
        return cls(path=path, sha256=digest.hexdigest(), factors=factors, scaling=scaling)


def _factors(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], store: Store, path: Path, retrain: str
) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], float]:
    """The `(B, A)` factors of every adapted MLP projection, checked against the store's shapes, and the
    scaling."""
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("fan_in_fan_out"):
        raise AdapterCorruptError(
            f"{path} is not a plain LoRA adapter (peft_type {config.get('peft_type')!r}, use_dora "
            f"{config.get('use_dora')!r}, fan_in_fan_out {config.get('fan_in_fan_out')!r}): flashlm fuses "
            f"W + (alpha / r) B A only. {retrain}"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterCorruptError(
            f"{path} gives layers ranks of their own (rank_pattern); flashlm fuses one rank."
        )
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / (rank**0.5 if config.get("use_rslora") else rank)
    spec = spec_for(store.model_type)
    if spec.gate_up is not None:
        raise UnsupportedArchitectureError(
            f"Fusing adapters into a fused gate_up projection ({store.model_type}) is not supported."
        )
    roles = {spec.gate: "gate", spec.up: "up", spec.down: "down"}
    shapes = {
        "gate": (store.d_ff, store.d_model),
        "up": (store.d_ff, store.d_model),
        "down": (store.d_model, store.d_ff),
    }
    factors = {}
    for name in tensors:
        if not name.endswith(".lora_A.weight"):
            if not name.endswith(".lora_B.weight"):
                raise AdapterCorruptError(f"{path} holds {name!r}, which is not a LoRA matrix. {retrain}")
            continue
        module = name.removesuffix(".lora_A.weight")
        layer, role = layer_index(module), roles.get(module.rsplit(".", 1)[-1])
        b = tensors.get(f"{module}.lora_B.weight")
        if layer is None or role is None or not 0 <= layer < store.num_layers:
            raise AdapterCorruptError(
                f"{path} adapts {module!r}, which is not an MLP projection of the store's {store.num_layers} "
                f"layers ({', '.join(roles)}). {retrain}"
            )
        a = tensors[name]
        if (
            b is None
            or a.dim() != 2
            or b.dim() != 2
            or (b.shape[0], a.shape[1]) != shapes[role]
            or b.shape[1] != a.shape[0]
        ):
            raise AdapterCorruptError(
                f"{path}: the LoRA matrices of {module!r} (B {None if b is None else list(b.shape)}, "
                f"A {list(a.shape)}) do not make the {role} projection's {list(shapes[role])}. {retrain}"
            )
        factors[(layer, role)] = (b, a)
    if not factors:
        raise AdapterCorruptError(f"{path} holds no LoRA matrices. {retrain}")
    return factors, scaling


def roles_by_name(spec: MLPSpec, owners: list[str]) -> dict[str, tuple[int, str]]:
    """`(layer, role)` of each MLP tensor name of a checkpoint whose MLP owners are `owners` (by layer)."""
    return {
        name: (layer, role)
        for layer, owner in enumerate(owners)
        for role, name in mlp_weight_names(spec, owner).items()
    }


class _FusedSource:
    """A `TensorSource` over a store's MLP weights with an adapter's deltas added, layer by layer."""

    def __init__(self, store: Store, adapter: LoraAdapter) -> None:
        self.store, self.adapter = store, adapter
        self.model_type = store.model_type
        self.path = store.manifest["source"].get("path")
        spec = spec_for(store.model_type)
        owners = [f"layers.{layer}.{spec.owner}".rstrip(".") for layer in range(store.num_layers)]
        self._names = roles_by_name(spec, owners)
        self._layer: tuple[int, dict[str, torch.Tensor]] | None = None

    def names(self) -> list[str]:
        return list(self._names)

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str) -> torch.Tensor:
        layer, role = self._names[name]
        if self._layer is None or self._layer[0] != layer:
            self._layer = (layer, layer_weights(self.store, layer) | self.store.resident(layer))
        weight = self._layer[1][role]
        delta = self.adapter.delta(layer, role)
        return weight if delta is None else (weight.float() + delta).to(weight.dtype)

    def fingerprint(self) -> str:
        """The store's fingerprint (or content hash) chained with the adapter's hash."""
        previous = self.store.fingerprint or self.store.content_sha256
        return hashlib.sha256(f"{previous}+lora:{self.adapter.sha256}".encode()).hexdigest()


def fuse(
    store: Store,
    adapter: LoraAdapter,
    dest: Path | None = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> Store:
    """Write `store` with `adapter` fused into its MLP weights to `dest` (None: replace `store` itself;
    `overwrite`: replace a store at `dest`; either only once the fused one is complete) and return the
    fused store, opened. Its manifest records the
    checkpoint it derives from and every adapter fused in (`Store.fused_from`)."""
    fused_from = store.fused_from or {}
    provenance = {
        "fused_from": {
            "checkpoint_fingerprint": fused_from.get("checkpoint_fingerprint", store.fingerprint),
            "checkpoint_content_sha256": fused_from.get("checkpoint_content_sha256", store.content_sha256),
            "store_content_sha256": store.content_sha256,
            "adapters": [
                *fused_from.get("adapters", []),
                {"path": str(adapter.path), "sha256": adapter.sha256},
            ],
        }
    }
    return convert(
        _FusedSource(store, adapter),
        store.path if dest is None else dest,
        dtype=store.dtype,
        kinds=store.kinds,
        progress=progress,
        overwrite=overwrite or dest is None,
        provenance=provenance,
    )
