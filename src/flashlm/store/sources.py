"""Where conversion reads a model's tensors from: a safetensors checkpoint on disk or a module in memory.

Both are `TensorSource`s: they name their tensors and hand them out one at a time, so conversion
and hashing walk the MLPs layer by layer and never need the whole model in memory at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol, runtime_checkable

import torch
from safetensors import safe_open
from torch import nn

from ..arch import MLPSpec, mlp_owner_names, mlp_weight_names, model_type_of, spec_for
from ..errors import UnsupportedArchitectureError

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


@runtime_checkable
class TensorSource(Protocol):
    """Named tensors of one model, handed out one at a time.

    `path` says where the tensors came from (recorded in a store's manifest; None when unknown).
    `fingerprint()` identifies the source cheaply, without reading weights, or is None when that
    is impossible (a module in memory: then only the content hash identifies it).
    """

    model_type: str
    path: str | None

    def names(self) -> list[str]: ...

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...

    def fingerprint(self) -> str | None: ...


def read_safetensors_header(path: str | os.PathLike) -> tuple[bytes, dict]:
    """The raw JSON header of a safetensors file and its parsed form (reads only the header).

    Raises `ValueError` when the file is too short or the header is not a JSON object.
    """
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file.")
        (length,) = struct.unpack("<Q", prefix)
        size = os.fstat(f.fileno()).st_size
        if length > size - 8:  # checked before reading: a damaged prefix can claim exabytes
            raise ValueError(f"{path} ends inside its safetensors header ({size - 8} of {length} bytes).")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, or an over-long integer
        raise ValueError(f"{path} has an unreadable safetensors header: {exc}.") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a safetensors header that is not a JSON object.")
    return raw, header


class SafetensorsSource:
    """A Hugging Face checkpoint directory: `config.json` plus one or several safetensors files.

    Tensor names come from the files' headers; each `get` maps one file and copies out one tensor,
    so memory holds at most the tensors the caller keeps.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory).expanduser()
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(
                f"{self.directory} is not a Hugging Face checkpoint directory (no config.json). "
                "Pass the directory that `save_pretrained` wrote."
            )
        config = json.loads(config_path.read_text())
        text_config = config.get("text_config")
        self.model_type: str = model_type_of(
            SimpleNamespace(
                model_type=config.get("model_type"),
                text_config=SimpleNamespace(**text_config) if isinstance(text_config, dict) else None,
            )
        )
        self.path: str | None = str(self.directory.resolve())
        self.files = self._weight_files()
        self._file_of: dict[str, Path] = {}
        self._headers: dict[Path, bytes] = {}
        for file in self.files:
            raw, header = read_safetensors_header(file)
            self._headers[file] = raw
            self._file_of.update((name, file) for name in header if name != "__metadata__")

    def _weight_files(self) -> list[Path]:
        index = self.directory / SHARD_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return sorted(self.directory / name for name in set(weight_map.values()))
        single = self.directory / SINGLE_FILE
        if single.is_file():
            return [single]
        raise FileNotFoundError(
            f"No {SINGLE_FILE} or {SHARD_INDEX} in {self.directory}. flashlm converts safetensors "
            "checkpoints: save the model with `save_pretrained(..., safe_serialization=True)`."
        )

    def names(self) -> list[str]:
        return list(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self._file_of[name], framework="pt") as f:
            return f.get_tensor(name)

    def fingerprint(self) -> str:
        """sha256 over each file's name, size, modification time and raw header: reads no weights, and
        changes with any re-save, even of other weights in the same shapes (a pruned or fused copy has
        the same headers and sizes). A copy that keeps modification times (`cp -p`) keeps it."""
        digest = hashlib.sha256()
        for file in sorted(self.files, key=lambda f: f.name):
            stat = file.stat()
            digest.update(file.name.encode())
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
            digest.update(self._headers[file])
        return digest.hexdigest()


class ModuleSource:
    """A model already in memory; tensors are its `state_dict()` entries (no copies)."""

    def __init__(self, model: nn.Module) -> None:
        config = getattr(model, "config", None)
        if config is None:
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} has no `config`, so flashlm cannot tell its architecture. "
                "Pass a transformers model."
            )
        self.model_type: str = model_type_of(config)
        self.path: str | None = getattr(config, "_name_or_path", None) or None
        self._tensors = model.state_dict(keep_vars=False)

    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        if tensor.is_meta:
            raise ValueError(f"{name} is on the meta device: load the model's weights before converting it.")
        return tensor

    def fingerprint(self) -> None:
        return None


def as_source(source: str | os.PathLike | TensorSource | nn.Module) -> TensorSource:
    """A `TensorSource` for a checkpoint path, a module, or a source passed through."""
    if isinstance(source, (str, os.PathLike)):
        return SafetensorsSource(source)
    if isinstance(source, nn.Module):
        return ModuleSource(source)
    if isinstance(source, TensorSource):
        return source
    raise TypeError(
        f"Cannot read tensors from a {type(source).__name__}: pass a checkpoint directory, a model, "
        "or a TensorSource."
    )


def mlp_owners(source: TensorSource) -> tuple[MLPSpec, list[str]]:
    """The source's architecture spec and its MLP owner names, one per layer in layer order."""
    spec = spec_for(source.model_type)
    return spec, mlp_owner_names(spec, source.names())


def load_mlp(
    source: TensorSource, spec: MLPSpec, owner: str, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """One MLP's tensors by role, in `mlp_weight_names` order, on the CPU, contiguous, in `dtype`.

    `dtype=None` keeps the down projection's dtype (and casts the others to it, so a layer has one
    dtype). Absent biases are left out; any other absent tensor is an error naming it.
    """
    tensors: dict[str, torch.Tensor] = {}
    for role, name in mlp_weight_names(spec, owner).items():
        if not source.has(name):
            if role.endswith("_bias"):
                continue
            raise UnsupportedArchitectureError(
                f"The checkpoint has no tensor {name!r}, which a {spec.family}-family MLP needs. "
                "Is its model_type mislabelled, or is it already converted or quantized?"
            )
        tensor = source.get(name)
        dtype = dtype or tensor.dtype
        tensors[role] = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
    return tensors
