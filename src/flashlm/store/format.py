"""The on-disk store: a directory of aligned safetensors row files plus `manifest.json`, and `Store`.

Layout of a store directory:

    manifest.json                      what the store holds (see `Store`), written last
    layers/{layer:03d}.{kind}.safetensors
                                       one 2-D tensor named "rows"; one row is one cache unit
    resident.safetensors               plain-MLP biases, `layers.{i}.up_bias` / `layers.{i}.down_bias`
                                       (only when the checkpoint has them)

Every safetensors header is padded with spaces so that tensor data starts at a multiple of
`ALIGNMENT`: the files stay loadable by `safetensors.safe_open`, and the reader can use O_DIRECT.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ..arch import ARCHITECTURES
from ..errors import StoreCorruptError, StoreMismatchError, StoreNotFoundError
from .rowfile import ALIGNMENT, RowFile
from .sources import TensorSource, load_mlp, mlp_owners, read_safetensors_header

FORMAT = "flashlm-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
RESIDENT = "resident.safetensors"
ROWS = "rows"

KINDS = ("gate", "up", "down", "bundle", "dip_in", "dip_down", "gate_down", "up_down")
"""Unit kinds, in the order a store lists them.

Dense streaming reads `gate`, `up` (a unit is a neuron: a row of the projection) and `down` (a unit
is an output feature: a row of the down projection): each is the checkpoint's own matrix, cut by
rows, so every product is a contiguous row block that `F.linear` computes with the dense model's
kernel (what keeps dense streaming exact and as fast as the dense model). `convert` writes these by
default. The others, derived on first use by `add_kinds` from whatever the store holds: `bundle`
(row-column bundling, LLM in a flash) and the layouts of the DIP paper's methods (DIP: `dip_in`,
`dip_down`; up pruning: `up`, `gate_down`; gate pruning and CATS: `gate`, `up_down`).
"""

GATED_ONLY_KINDS = ("gate", "dip_in", "dip_down", "gate_down", "up_down")

KIND_LAYOUTS = {
    ("up", True): "row j = up[j, :]",
    ("up", False): "row j = up[j, :]",
    ("down", True): "row i = down[i, :]",
    ("down", False): "row i = down[i, :]",
    ("bundle", True): "row j = gate[j, :] | up[j, :] | down[:, j]",
    ("bundle", False): "row j = up[j, :] | down[:, j]",
    ("dip_in", True): "row i = up[:, i] | gate[:, i]",
    ("dip_down", True): "row j = down[:, j]",
    ("gate", True): "row j = gate[j, :]",
    ("gate_down", True): "row j = gate[j, :] | down[:, j]",
    ("up_down", True): "row j = up[j, :] | down[:, j]",
}
"""What one row of each kind holds, for gated (True) and plain (False) MLPs; recorded in the manifest.

`gate`, `up`: [d_ff, d_model]; `down`: [d_model, d_ff]. `dip_in` and `down` have d_model rows, every
other kind d_ff.
"""


def unit_matrices(
    tensors: dict[str, torch.Tensor], kinds: tuple[str, ...]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(kind, [rows, width] contiguous matrix)` of one layer, built one kind at a time to bound memory.

    `tensors` holds `down` [d_model, d_ff] and `up` [d_ff, d_model], plus `gate` [d_ff, d_model] or
    the fused `gate_up` [2 * d_ff, d_model] for a gated MLP (as `load_mlp` returns them); the one home
    of the layouts `KIND_LAYOUTS` describes, for `convert` and `add_kinds` alike.
    """
    down = tensors["down"]
    if "gate_up" in tensors:
        gate, up = tensors["gate_up"].chunk(2)
    else:
        gate, up = tensors.get("gate"), tensors["up"]
    for kind in kinds:
        if kind == "down":
            yield kind, down.contiguous()
        elif kind == "bundle":
            parts = [up, down.T] if gate is None else [gate, up, down.T]
            yield kind, torch.cat(parts, dim=1)
        elif kind == "dip_in":
            yield kind, torch.cat([up.T, gate.T], dim=1)
        elif kind == "dip_down":
            yield kind, down.T.contiguous()
        elif kind == "gate":
            yield kind, gate.contiguous()
        elif kind == "up":
            yield kind, up.contiguous()
        elif kind == "gate_down":
            yield kind, torch.cat([gate, down.T], dim=1)
        elif kind == "up_down":
            yield kind, torch.cat([up, down.T], dim=1)
        else:
            raise ValueError(f"Unknown unit kind {kind!r}; known kinds: {', '.join(KINDS)}.")


def kind_shape(kind: str, d_model: int, d_ff: int, gated: bool) -> tuple[int, int]:
    """`[rows, width]` of a kind's matrix, from `unit_matrices` on meta tensors (nothing allocated)."""
    meta = {
        "down": torch.empty(d_model, d_ff, device="meta"),
        "up": torch.empty(d_ff, d_model, device="meta"),
    }
    if gated:
        meta["gate"] = torch.empty(d_ff, d_model, device="meta")
    ((_, matrix),) = unit_matrices(meta, (kind,))
    return tuple(matrix.shape)


def dense_kinds(gated: bool) -> tuple[str, ...]:
    """The kinds dense streaming reads: the intermediate projections by neuron, down by output row."""
    return ("gate", "up", "down") if gated else ("up", "down")


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
}


_CONVERT_HINT = "convert it with `flashlm convert SRC DST` (or `flashlm.store.convert(src, dst)`)"
_RECONVERT_HINT = "Delete the store and convert again."


def kinds_for(gated: bool) -> tuple[str, ...]:
    """Every unit kind a store of a gated (or plain) MLP can hold."""
    return KINDS if gated else tuple(k for k in KINDS if k not in GATED_ONLY_KINDS)


def row_file_name(layer: int, kind: str) -> str:
    """Path of one layer's matrix of one kind, relative to the store directory."""
    return f"layers/{layer:03d}.{kind}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `'bfloat16'`, the manifest's spelling."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """`'bfloat16'` (or `'torch.bfloat16'`) -> `torch.bfloat16`; ValueError naming the supported ones."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if dtype not in _SAFETENSORS_DTYPES:
        supported = ", ".join(dtype_name(d) for d in _SAFETENSORS_DTYPES)
        raise ValueError(f"A store cannot hold dtype {name!r}; supported: {supported}.")
    return dtype


def dtype_of_safetensors_name(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (`"BF16"`), among those flashlm writes."""
    for dtype, safetensors_name in _SAFETENSORS_DTYPES.items():
        if safetensors_name == name:
            return dtype
    raise ValueError(f"unsupported safetensors dtype {name!r}")


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_aligned_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Write `tensors` (contiguous, CPU) as a safetensors file whose data starts at a multiple of
    `ALIGNMENT`, fsync it, and return its manifest entry: `{"size", "data_offset"}`.

    Written by hand rather than with `safetensors.torch.save_file` to control the header padding
    (spaces after the JSON, which the safetensors format allows) and to write straight from each
    tensor's memory.
    """
    entries = {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"A store cannot hold dtype {tensor.dtype}; convert with another `dtype=`.")
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % ALIGNMENT)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for tensor in tensors.values():
            f.write(_raw_bytes(tensor))
        f.flush()
        os.fsync(f.fileno())
    return {"size": 8 + len(header) + offset, "data_offset": 8 + len(header)}


def update_content_hash(digest: hashlib._Hash, tensors: dict[str, torch.Tensor]) -> None:
    """Feed one MLP's tensors (from `load_mlp`, so in canonical role order and store dtype) to `digest`."""
    for tensor in tensors.values():
        digest.update(_raw_bytes(tensor))


def mlp_content_sha256(source: TensorSource, dtype: torch.dtype | None = None) -> str:
    """sha256 of a source's MLP weights as a store converted with `dtype` would hold them.

    Layer by layer, role by role in `mlp_weight_names` order, the contiguous bytes in `dtype`
    (`None`: the source's dtype). Equals the `content_sha256` that `convert` records, whatever
    the source kind, so an in-memory model can be checked against a store.
    """
    spec, owners = mlp_owners(source)
    digest = hashlib.sha256()
    for owner in owners:
        tensors = load_mlp(source, spec, owner, dtype)
        dtype = tensors["down"].dtype
        update_content_hash(digest, tensors)
    return digest.hexdigest()


class ConvertedFrom:
    """What every store's manifest says of the checkpoint it was converted from (`manifest["source"]`)."""

    manifest: dict

    @property
    def content_sha256(self) -> str:
        """sha256 of the weights the store holds (for the MLP store, `mlp_content_sha256`)."""
        return self.manifest["source"]["content_sha256"]

    @property
    def fingerprint(self) -> str | None:
        """The source checkpoint's fingerprint (`SafetensorsSource.fingerprint`), or None; for a store
        with adapters fused in, chained with each adapter's hash."""
        return self.manifest["source"].get("fingerprint")

    @property
    def fused_from(self) -> dict | None:
        """For a store with LoRA adapters fused in (`flashlm.store.fuse`): the checkpoint's fingerprint
        and content hash, the unfused store's content hash and the adapters; None otherwise."""
        return self.manifest["source"].get("fused_from")


class Store(ConvertedFrom):
    """An opened, validated store. Holds no open files: readers open `row_file(...)` paths themselves.

    Use `Store.open(path)`; it checks the manifest and every file's size and header, so a store
    that opens is complete.
    """

    def __init__(self, path: Path, manifest: dict) -> None:
        self.path = path
        self.manifest = manifest
        self.model_type: str = manifest["model_type"]
        self.family: str = manifest["family"]
        self.num_layers: int = manifest["num_layers"]
        self.d_model: int = manifest["d_model"]
        self.d_ff: int = manifest["d_ff"]
        self.gated: bool = manifest["gated"]
        self.has_bias: bool = manifest["has_bias"]
        self.dtype: torch.dtype = dtype_from_name(manifest["dtype"])
        self.kinds: tuple[str, ...] = tuple(manifest["kinds"])
        self._row_files = {
            (layer, kind): RowFile(
                path=path / row_file_name(layer, kind),
                data_offset=manifest["files"][row_file_name(layer, kind)]["data_offset"],
                rows=layout["rows"],
                width=layout["width"],
                dtype=self.dtype,
            )
            for kind, layout in manifest["kinds"].items()
            for layer in range(self.num_layers)
        }

    @classmethod
    def open(cls, path: str | os.PathLike) -> Store:
        """Open and validate the store at `path`.

        Raises `StoreNotFoundError` when `path` holds no store, and `StoreCorruptError` when its
        manifest or files are damaged, truncated or of another format version.
        """
        path = Path(path).expanduser()
        manifest_path = path / MANIFEST
        if not path.is_dir():
            raise StoreNotFoundError(f"No flashlm store at {path}: {_CONVERT_HINT}.")
        if not manifest_path.is_file():
            raise StoreNotFoundError(
                f"{path} is not a flashlm store (it has no {MANIFEST}): {_CONVERT_HINT}."
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, huge integer
            raise StoreCorruptError(
                f"The manifest of the store {path} is unreadable ({exc}). {_RECONVERT_HINT}"
            ) from exc
        _check_manifest(path, manifest)
        store = cls(path, manifest)
        store._check_files()
        return store

    def _check_files(self) -> None:
        files = self.manifest["files"]
        for relative, entry in files.items():
            _check_size(self.path, relative, entry)
        for (layer, kind), row_file in self._row_files.items():
            relative = row_file_name(layer, kind)
            expected = {
                "dtype": _SAFETENSORS_DTYPES[self.dtype],
                "shape": [row_file.rows, row_file.width],
                "data_offsets": [0, row_file.nbytes],
            }
            header_bytes, header = _read_header(self.path, relative)
            header.pop("__metadata__", None)
            if header != {ROWS: expected} or 8 + len(header_bytes) != row_file.data_offset:
                raise StoreCorruptError(
                    f"{self.path / relative} does not hold the [{row_file.rows}, {row_file.width}] "
                    f"{dtype_name(self.dtype)} matrix at byte {row_file.data_offset} that the manifest "
                    f"describes. {_RECONVERT_HINT}"
                )
            if files[relative]["size"] != row_file.data_offset + row_file.nbytes:
                raise StoreCorruptError(
                    f"The manifest of {self.path} gives {relative} a size that does not fit its matrix. "
                    f"{_RECONVERT_HINT}"
                )
        if RESIDENT in files:
            self._check_resident()

    def _check_resident(self) -> None:
        """The resident file is a safetensors file (as safetensors reads it, the way `resident` does)
        holding exactly each layer's `up_bias` [d_ff] and `down_bias` [d_model] in the store's dtype."""
        path = self.path / RESIDENT
        try:
            with safe_open(path, framework="pt") as f:
                slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
                held = {name: (piece.get_shape(), piece.get_dtype()) for name, piece in slices.items()}
        except Exception as exc:  # safetensors raises its own SafetensorError (no public base class)
            raise StoreCorruptError(
                f"{path} is not a valid safetensors file ({exc}). {_RECONVERT_HINT}"
            ) from exc
        dtype = _SAFETENSORS_DTYPES[self.dtype]
        expected = {
            f"layers.{layer}.{name}": ([length], dtype)
            for layer in range(self.num_layers)
            for name, length in (("up_bias", self.d_ff), ("down_bias", self.d_model))
        }
        if held != expected:
            raise StoreCorruptError(
                f"{path} does not hold exactly each layer's up_bias [{self.d_ff}] and down_bias "
                f"[{self.d_model}] in {dtype_name(self.dtype)}. {_RECONVERT_HINT}"
            )

    def row_file(self, layer: int, kind: str) -> RowFile:
        """Where layer `layer`'s matrix of `kind` lies on disk."""
        if kind not in self.kinds:
            raise ValueError(
                f"The store {self.path} holds no {kind!r} units; it holds {', '.join(self.kinds)}. "
                f"Add them with `flashlm.store.add_kinds(store, [{kind!r}])`, or convert again with "
                f"kinds including {kind!r}."
            )
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"Layer {layer} is out of range: the store has layers 0..{self.num_layers - 1}.")
        return self._row_files[(layer, kind)]

    def row_files(self, kind: str) -> dict[int, RowFile]:
        """Every layer's matrix of `kind`, by layer."""
        return {layer: self.row_file(layer, kind) for layer in range(self.num_layers)}

    def nbytes(self, kind: str | None = None) -> int:
        """Bytes of all layers' matrices of `kind`; None: of dense streaming's kinds, i.e. the MLP weights."""
        kinds = dense_kinds(self.gated) if kind is None else (kind,)
        return sum(f.nbytes for k in kinds for f in self.row_files(k).values())

    def resident(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s always-in-memory tensors (`up_bias`, `down_bias`), or an empty dict."""
        if RESIDENT not in self.manifest["files"]:
            return {}
        prefix = f"layers.{layer}."
        with safe_open(self.path / RESIDENT, framework="pt") as f:
            names = [name for name in f.keys() if name.startswith(prefix)]  # noqa: SIM118 (not a dict)
            return {name.removeprefix(prefix): f.get_tensor(name) for name in names}

    def check_matches(
        self,
        *,
        model_type: str | None = None,
        num_layers: int | None = None,
        d_model: int | None = None,
        d_ff: int | None = None,
        fingerprint: str | None = None,
        content_sha256: str | None = None,
    ) -> None:
        """Raise `StoreMismatchError` naming every given field that differs from the store's.

        Fields left None are not checked; `fingerprint` only when the store recorded one. A store with
        adapters fused in matches the checkpoint (fingerprint, MLP content) it was derived from.
        """
        checkpoint = self.fused_from or {}
        expected = {
            "model_type": model_type,
            "num_layers": num_layers,
            "d_model": d_model,
            "d_ff": d_ff,
            "fingerprint": fingerprint,
            "content_sha256": content_sha256,
        }
        actual = {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "d_model": self.d_model,
            "d_ff": self.d_ff,
            "fingerprint": checkpoint.get("checkpoint_fingerprint", self.fingerprint),
            "content_sha256": checkpoint.get("checkpoint_content_sha256", self.content_sha256),
        }
        differences = [
            f"{field}: store has {actual[field]!r}, expected {value!r}"
            for field, value in expected.items()
            if value is not None and actual[field] is not None and actual[field] != value
        ]
        if differences:
            raise StoreMismatchError(
                f"The store {self.path} does not match the model: {'; '.join(differences)}. "
                "It was converted from another checkpoint: delete it (it is converted again on the next "
                "load) or pass another `store=` path."
            )

    def __repr__(self) -> str:
        return (
            f"Store({str(self.path)!r}, {self.model_type}, {self.num_layers} layers, d_model={self.d_model}, "
            f"d_ff={self.d_ff}, {dtype_name(self.dtype)}, kinds={self.kinds})"
        )


_REQUIRED_KEYS = {
    "model_type": str,
    "family": str,
    "num_layers": int,
    "d_model": int,
    "d_ff": int,
    "gated": bool,
    "has_bias": bool,
    "dtype": str,
    "alignment": int,
    "kinds": dict,
    "files": dict,
    "source": dict,
}


def _check_manifest(path: Path, manifest: object) -> None:
    """StoreCorruptError unless `manifest` is a complete version-1 flashlm manifest."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreCorruptError(f"{path / MANIFEST} is not a flashlm store manifest. {_RECONVERT_HINT}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise StoreCorruptError(
            f"The store {path} has format version {manifest.get('format_version')!r} (written by "
            f"flashlm {manifest.get('flashlm_version')}); this flashlm reads version {FORMAT_VERSION}. "
            f"{_RECONVERT_HINT}"
        )
    for key, kind in _REQUIRED_KEYS.items():
        value = manifest.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):  # True is an int
            raise StoreCorruptError(f"The manifest of {path} lacks a valid {key!r}. {_RECONVERT_HINT}")
    try:
        dtype_from_name(manifest["dtype"])
    except ValueError as exc:
        raise StoreCorruptError(f"The manifest of {path}: {exc} {_RECONVERT_HINT}") from exc
    if manifest["alignment"] != ALIGNMENT or not isinstance(manifest["source"].get("content_sha256"), str):
        raise StoreCorruptError(f"The manifest of {path} is inconsistent. {_RECONVERT_HINT}")
    unknown = set(manifest["kinds"]) - set(kinds_for(manifest["gated"]))
    if unknown or not manifest["kinds"]:
        raise StoreCorruptError(
            f"The manifest of {path} lists invalid unit kinds {sorted(unknown)}. {_RECONVERT_HINT}"
        )
    spec = ARCHITECTURES.get(manifest["model_type"])
    if spec is not None and spec.family != manifest["family"]:
        raise StoreCorruptError(
            f"The manifest of {path} gives model_type {manifest['model_type']!r} the family "
            f"{manifest['family']!r}; it is {spec.family!r}. {_RECONVERT_HINT}"
        )
    if not all(0 < manifest[key] < 2**31 for key in ("num_layers", "d_model", "d_ff")):
        raise StoreCorruptError(
            f"The manifest of {path} gives dimensions no model has (num_layers {manifest['num_layers']}, "
            f"d_model {manifest['d_model']}, d_ff {manifest['d_ff']}). {_RECONVERT_HINT}"
        )
    for relative, entry in manifest["files"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or entry["size"] < 0:
            raise StoreCorruptError(
                f"The manifest of {path} has no valid size for {relative}. {_RECONVERT_HINT}"
            )
    if manifest["has_bias"] != (RESIDENT in manifest["files"]):
        raise StoreCorruptError(
            f"The manifest of {path} says has_bias={manifest['has_bias']} but "
            f"{'lists no' if manifest['has_bias'] else 'lists a'} {RESIDENT}. {_RECONVERT_HINT}"
        )
    for kind, layout in manifest["kinds"].items():
        if not isinstance(layout, dict) or not all(
            isinstance(layout.get(k), int) for k in ("rows", "width", "row_bytes")
        ):
            raise StoreCorruptError(f"The manifest of {path} lacks the layout of {kind!r}. {_RECONVERT_HINT}")
        shape = kind_shape(kind, manifest["d_model"], manifest["d_ff"], manifest["gated"])
        if (layout["rows"], layout["width"]) != shape:
            raise StoreCorruptError(
                f"The manifest of {path} gives {kind!r} a [{layout['rows']}, {layout['width']}] layout; "
                f"d_model={manifest['d_model']} and d_ff={manifest['d_ff']} make it {list(shape)}. "
                f"{_RECONVERT_HINT}"
            )
        for layer in range(manifest["num_layers"]):
            entry = manifest["files"].get(row_file_name(layer, kind))
            if not isinstance(entry, dict) or not all(
                isinstance(entry.get(k), int) for k in ("size", "data_offset")
            ):
                raise StoreCorruptError(
                    f"The manifest of {path} does not list {row_file_name(layer, kind)}. {_RECONVERT_HINT}"
                )


def _check_size(path: Path, relative: str, entry: dict) -> None:
    try:
        size = (path / relative).stat().st_size
    except OSError as exc:
        raise StoreCorruptError(
            f"The store {path} lacks {relative} ({exc.strerror}). {_RECONVERT_HINT}"
        ) from exc
    if size != entry["size"]:
        raise StoreCorruptError(
            f"{path / relative} has {size} bytes, the manifest says {entry['size']}: the store is truncated "
            f"or damaged. {_RECONVERT_HINT}"
        )


def _read_header(path: Path, relative: str) -> tuple[bytes, dict]:
    try:
        return read_safetensors_header(path / relative)
    except ValueError as exc:
        raise StoreCorruptError(f"{exc} {_RECONVERT_HINT}") from exc
