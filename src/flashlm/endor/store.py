"""The Endor store: every decoder layer's linear weights, Endor-compressed, one aligned file per layer.

Layout of an Endor store directory:

    manifest.json                   what the store holds (see `EndorStore`), written last
    layers/{layer:03d}.endor.safetensors
                                    for each linear of the layer (attention and MLP), `{name}.values`
                                    (its non-zeros, 1-D, the weight's dtype), then every `{name}.bitmap`
                                    (uint8 [rows, ceil(cols / 8)]); values first so that each values
                                    tensor starts at an offset its dtype can be viewed at

A layer file's data region (everything after the padded safetensors header, which starts at a
multiple of `ALIGNMENT`) is what an SSD-mapped layer reads per token: one O_DIRECT read of the
compressed bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from .._version import __version__
from ..arch import decoder_layers, layer_linears
from ..errors import StoreCorruptError, StoreMismatchError, StoreNotFoundError
from ..store.convert import fsync_dir, staged_directory, write_json_durably
from ..store.format import (
    ConvertedFrom,
    dtype_from_name,
    dtype_name,
    update_content_hash,
    write_aligned_safetensors,
)
from ..store.rowfile import ALIGNMENT, RowFile
from ..store.sources import TensorSource, as_source, read_safetensors_header
from .codec import EndorMatrix, bitmap_row_bytes, compress

FORMAT = "flashlm-endor-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_RECONVERT_HINT = "Delete the store and convert again (`flashlm convert --format endor`)."

EndorLayout = list[tuple[str, list[str]]]
"""Per decoder layer: its qualified name (`model.layers.3`) and its linears' names relative to it."""


def endor_layout(model: nn.Module) -> EndorLayout:
    """The decoder layers of `model` (meta device is fine) and the linears each holds."""
    return [(name, layer_linears(layer)) for _, name, layer in decoder_layers(model)]


def meta_model_layout(checkpoint_dir: str | os.PathLike) -> EndorLayout:
    """The `endor_layout` of a checkpoint's model, built on the meta device from its config alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint_dir))
    return endor_layout(model)


def layer_file_name(layer: int) -> str:
    return f"layers/{layer:03d}.endor.safetensors"


@dataclass(frozen=True)
class LinearEntry:
    """One compressed linear of a layer file; offsets are bytes from the start of the data region."""

    name: str
    shape: tuple[int, int]
    nnz: int
    values: tuple[int, int]
    bitmap: tuple[int, int]

    def matrix(self, data: torch.Tensor, dtype: torch.dtype) -> EndorMatrix:
        """The compressed matrix as views into `data`, a layer's data region (uint8, 1-D)."""
        rows, cols = self.shape
        return EndorMatrix(
            bitmap=data[self.bitmap[0] : self.bitmap[1]].view(rows, bitmap_row_bytes(cols)),
            values=data[self.values[0] : self.values[1]].view(dtype),
            shape=self.shape,
        )


@dataclass(frozen=True)
class LayerEntry:
    """One decoder layer's file: where its data region lies and the linears it holds."""

    index: int
    prefix: str
    path: Path
    data_offset: int
    data_bytes: int
    dense_bytes: int
    linears: dict[str, LinearEntry]

    @property
    def file(self) -> RowFile:
        """The whole data region as a one-row byte matrix: what one read of the layer fetches."""
        return RowFile(self.path, self.data_offset, rows=1, width=self.data_bytes, dtype=torch.uint8)


class EndorStore(ConvertedFrom):
    """An opened, validated Endor store (use `EndorStore.open`)."""

    def __init__(self, path: Path, manifest: dict) -> None:
        self.path = path
        self.manifest = manifest
        self.model_type: str = manifest["model_type"]
        self.dtype: torch.dtype = dtype_from_name(manifest["dtype"])
        self.layers: list[LayerEntry] = [
            LayerEntry(
                index=index,
                prefix=entry["prefix"],
                path=path / layer_file_name(index),
                data_offset=entry["data_offset"],
                data_bytes=entry["data_bytes"],
                dense_bytes=entry["dense_bytes"],
                linears={
                    name: LinearEntry(
                        name=name,
                        shape=tuple(linear["shape"]),
                        nnz=linear["nnz"],
                        values=tuple(linear["values"]),
                        bitmap=tuple(linear["bitmap"]),
                    )
                    for name, linear in entry["linears"].items()
                },
            )
            for index, entry in enumerate(manifest["layers"])
        ]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        """Compressed bytes of every layer (what reading the whole model from the store moves)."""
        return sum(layer.data_bytes for layer in self.layers)

    def dense_nbytes(self) -> int:
        """Bytes of the same weights stored dense."""
        return sum(layer.dense_bytes for layer in self.layers)

    @property
    def ratio(self) -> float:
        return self.nbytes() / self.dense_nbytes()

    @classmethod
    def open(cls, path: str | os.PathLike) -> EndorStore:
        """Open and validate the store at `path`; `StoreNotFoundError` or `StoreCorruptError` if it is
        not whole."""
        path = Path(path).expanduser()
        if not (path / MANIFEST).is_file():
            raise StoreNotFoundError(
                f"No Endor store at {path}: convert a pruned checkpoint with `flashlm convert --format endor "
                "CHECKPOINT STORE` (or load it with FlashConfig(method='endor'), which converts on first "
                "use)."
            )
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreCorruptError(
                f"The manifest of {path} is unreadable ({exc}). {_RECONVERT_HINT}"
            ) from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise StoreCorruptError(f"{path / MANIFEST} is not an Endor store manifest. {_RECONVERT_HINT}")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise StoreCorruptError(
                f"The Endor store {path} has format version {manifest.get('format_version')!r}; this flashlm "
                f"reads version {FORMAT_VERSION}. {_RECONVERT_HINT}"
            )
        try:
            store = cls(path, manifest)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreCorruptError(
                f"The manifest of {path} is incomplete ({exc!r}). {_RECONVERT_HINT}"
            ) from exc
        store._check_files()
        return store

    def _check_files(self) -> None:
        for layer in self.layers:
            try:
                size = layer.path.stat().st_size
                header_bytes, header = read_safetensors_header(layer.path)
            except (OSError, ValueError) as exc:
                raise StoreCorruptError(f"The Endor store {self.path}: {exc}. {_RECONVERT_HINT}") from exc
            if size != layer.data_offset + layer.data_bytes or 8 + len(header_bytes) != layer.data_offset:
                raise StoreCorruptError(
                    f"{layer.path} has {size} bytes, the manifest says "
                    f"{layer.data_offset + layer.data_bytes}: "
                    f"the store is truncated or damaged. {_RECONVERT_HINT}"
                )
            header.pop("__metadata__", None)
            for name, linear in layer.linears.items():
                if (
                    header.get(f"{name}.values", {}).get("data_offsets") != list(linear.values)
                    or header.get(f"{name}.bitmap", {}).get("data_offsets") != list(linear.bitmap)
                    or (linear.values[1] - linear.values[0]) != linear.nnz * self.dtype.itemsize
                ):
                    raise StoreCorruptError(
                        f"{layer.path} does not hold {name} where the manifest says. {_RECONVERT_HINT}"
                    )

    def load_layer(self, layer: int) -> dict[str, EndorMatrix]:
        """Layer `layer`'s compressed matrices, read through the page cache (for memory-resident layers)."""
        entry = self.layers[layer]
        with safe_open(entry.path, framework="pt") as f:
            return {
                name: EndorMatrix(
                    bitmap=f.get_tensor(f"{name}.bitmap"),
                    values=f.get_tensor(f"{name}.values"),
                    shape=linear.shape,
                )
                for name, linear in entry.linears.items()
            }

    def check_matches(self, *, model_type: str | None = None, fingerprint: str | None = None) -> None:
        """`StoreMismatchError` when the store was converted from another checkpoint."""
        differences = []
        if model_type is not None and model_type != self.model_type:
            differences.append(f"model_type: store has {self.model_type!r}, expected {model_type!r}")
        if fingerprint is not None and self.fingerprint is not None and fingerprint != self.fingerprint:
            differences.append("the checkpoint's files differ from those it was converted from")
        if differences:
            raise StoreMismatchError(
                f"The Endor store {self.path} does not match the model: {'; '.join(differences)}. Delete it "
                "(it is converted again on the next load) or pass another `store=` path."
            )

    def __repr__(self) -> str:
        return (
            f"EndorStore({str(self.path)!r}, {self.model_type}, {self.num_layers} layers, "
            f"{dtype_name(self.dtype)}, "
            f"{self.nbytes() / 1e6:.1f} MB = {self.ratio:.2%} of dense)"
        )


def convert_endor(
    source: str | os.PathLike | TensorSource | nn.Module,
    dest: str | os.PathLike,
    layout: EndorLayout,
    *,
    progress: bool = True,
    overwrite: bool = False,
) -> EndorStore:
    """Compress every linear weight of every decoder layer in `layout` into an Endor store at `dest`.

    One pass over the source, one layer in memory at a time; written to a temporary sibling and
    renamed into place when complete. `source` is a (pruned) safetensors checkpoint directory, a
    model in memory, or a `TensorSource`; `layout` comes from `endor_layout(model)`.
    """
    source = as_source(source)
    dest = Path(dest).expanduser()
    missing = [f"{prefix}.{name}.weight" for prefix, names in layout for name in names]
    missing = [key for key in missing if not source.has(key)]
    if missing:
        raise StoreMismatchError(
            f"The checkpoint lacks {len(missing)} weights of the model's decoder linears "
            f"(first: {missing[0]}). "
            "Is it the checkpoint of this model?"
        )
    with staged_directory(dest, overwrite=overwrite) as tmp:
        digest = hashlib.sha256()
        layers, dtype = [], None
        for index, (prefix, names) in enumerate(
            tqdm(layout, desc="Compressing to an Endor store", unit="layer", disable=not progress)
        ):
            matrices = {}
            for name in names:
                weight = source.get(f"{prefix}.{name}.weight").contiguous()
                dtype = weight.dtype
                update_content_hash(digest, {name: weight})
                matrices[name] = compress(weight)
            layers.append(_write_layer(tmp / layer_file_name(index), prefix, matrices))
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "flashlm_version": __version__,
            "model_type": source.model_type,
            "dtype": dtype_name(dtype),
            "alignment": ALIGNMENT,
            "layers": layers,
            "source": {
                "path": source.path,
                "fingerprint": source.fingerprint(),
                "content_sha256": digest.hexdigest(),
            },
        }
        write_json_durably(tmp / MANIFEST, manifest)
        fsync_dir(tmp / "layers")
        fsync_dir(tmp)
    return EndorStore.open(dest)


def _write_layer(path: Path, prefix: str, matrices: dict[str, EndorMatrix]) -> dict:
    """Write one layer file (values first, then bitmaps) and return its manifest entry."""
    tensors = {f"{name}.values": m.values for name, m in matrices.items()}
    tensors |= {f"{name}.bitmap": m.bitmap for name, m in matrices.items()}
    written = write_aligned_safetensors(path, tensors)
    offsets, start = {}, 0
    for key, tensor in tensors.items():
        end = start + tensor.numel() * tensor.element_size()
        offsets[key] = [start, end]
        start = end
    return {
        "prefix": prefix,
        "data_offset": written["data_offset"],
        "data_bytes": written["size"] - written["data_offset"],
        "dense_bytes": sum(m.dense_nbytes for m in matrices.values()),
        "linears": {
            name: {
                "shape": list(m.shape),
                "nnz": m.nnz,
                "values": offsets[f"{name}.values"],
                "bitmap": offsets[f"{name}.bitmap"],
            }
            for name, m in matrices.items()
        },
    }


def layer_placement(
    compressed_bytes: Sequence[int], dense_bytes: Sequence[int], *, budget: int, device_budget: int = 0
) -> list[str]:
    """Map layers in order, as Accelerate's device_map does: to `"device"` (dense, on the execution
    device) while their dense bytes fit `device_budget`, then to `"cpu"` (compressed, in memory) while
    their compressed bytes fit `budget`, then to `"disk"` (compressed, read from the store every use)."""
    placement, device_left, memory_left = [], device_budget, budget
    for compressed, dense in zip(compressed_bytes, dense_bytes, strict=True):
        if (not placement or placement[-1] == "device") and dense <= device_left:
            placement.append("device")
            device_left -= dense
        elif (not placement or placement[-1] != "disk") and compressed <= memory_left:
            placement.append("cpu")
            memory_left -= compressed
        else:
            placement.append("disk")
    return placement
