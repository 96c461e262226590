"""`convert`: write a store from a checkpoint or a model, in one streaming pass over its layers.

Each layer's MLP tensors are loaded, rearranged into the row matrices of every unit kind, written,
hashed and dropped before the next layer is read, so memory holds one layer at a time. Everything
goes to a temporary sibling directory that is renamed to the destination only when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import __version__
from ..arch import MLPSpec, _layer_index
from ..errors import UnsupportedArchitectureError
from .format import (
    FORMAT,
    FORMAT_VERSION,
    KIND_LAYOUTS,
    KINDS,
    MANIFEST,
    RESIDENT,
    ROWS,
    Store,
    dtype_from_name,
    dtype_name,
    kinds_for,
    row_file_name,
    update_content_hash,
    write_aligned_safetensors,
)
from .rowfile import ALIGNMENT
from .sources import TensorSource, as_source, load_mlp, mlp_owners


def convert(
    source: str | os.PathLike | TensorSource | nn.Module,
    dest: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    kinds: Iterable[str] | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Store:
    """Convert a model's MLP weights into a store at `dest` and return it, opened.

    Args:
        source: a Hugging Face safetensors checkpoint directory, a model in memory, or a `TensorSource`.
        dest: the store directory to create. Nothing is ever left half-written there: on any error
            the temporary directory is removed and an existing store is kept.
        dtype: dtype of the stored weights (`torch.bfloat16` or `"bfloat16"`); None keeps the source's.
        kinds: unit kinds to write; None writes every kind the architecture supports
            (`bundle`, plus `dip_in` and `dip_down` for gated MLPs).
        progress: show a progress bar over layers.
        overwrite: replace an existing store at `dest` (otherwise `FileExistsError`).
    """
    source = as_source(source)
    spec, owners = mlp_owners(source)
    _check_layer_indices(owners)
    kinds = _resolve_kinds(kinds, spec)
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    dest = Path(dest).expanduser()
    _check_destination(dest, overwrite)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "layers").mkdir(parents=True)
    except OSError as exc:
        raise type(exc)(
            exc.errno,
            f"Cannot write a store under {dest.parent}: {exc.strerror}. Choose a writable destination.",
        ) from exc
    try:
        _write_store(source, spec, owners, kinds, dtype, tmp, progress)
        _move_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Store.open(dest)


def _write_store(
    source: TensorSource,
    spec: MLPSpec,
    owners: list[str],
    kinds: tuple[str, ...],
    dtype: torch.dtype | None,
    tmp: Path,
    progress: bool,
) -> None:
    """The single pass: every layer's row files, then the resident biases, then the manifest."""
    fingerprint = source.fingerprint()
    digest = hashlib.sha256()
    files: dict[str, dict[str, int]] = {}
    layouts: dict[str, dict] = {}
    biases: dict[str, torch.Tensor] = {}
    dims: tuple[int, int] | None = None
    for layer, owner in enumerate(
        tqdm(owners, desc="Converting to flashlm store", unit="layer", disable=not progress)
    ):
        tensors = load_mlp(source, spec, owner, dtype)
        dtype = tensors["down"].dtype
        dims = _check_shapes(spec, owner, tensors, dims)
        update_content_hash(digest, tensors)
        for kind, rows in _unit_matrices(spec, tensors, kinds):
            relative = row_file_name(layer, kind)
            files[relative] = write_aligned_safetensors(tmp / relative, {ROWS: rows})
            layouts[kind] = {
                "rows": rows.shape[0],
                "width": rows.shape[1],
                "row_bytes": rows.shape[1] * rows.element_size(),
                "layout": KIND_LAYOUTS[(kind, spec.gated)],
            }
        biases.update(
            (f"layers.{layer}.{role}", tensors[role]) for role in ("up_bias", "down_bias") if role in tensors
        )
        del tensors
    if biases:
        files[RESIDENT] = write_aligned_safetensors(tmp / RESIDENT, biases)
    d_model, d_ff = dims
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "flashlm_version": __version__,
        "model_type": source.model_type,
        "family": spec.family,
        "num_layers": len(owners),
        "d_model": d_model,
        "d_ff": d_ff,
        "gated": spec.gated,
        "dtype": dtype_name(dtype),
        "alignment": ALIGNMENT,
        "has_bias": bool(biases),
        "kinds": {kind: layouts[kind] for kind in kinds},
        "files": files,
        "source": {"path": source.path, "fingerprint": fingerprint, "content_sha256": digest.hexdigest()},
    }
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp / "layers")
    _fsync_dir(tmp)


def _unit_matrices(
    spec: MLPSpec, tensors: dict[str, torch.Tensor], kinds: tuple[str, ...]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(kind, [rows, width] matrix)` of one layer, built one kind at a time to bound memory."""
    down = tensors["down"]
    if "gate_up" in tensors:
        gate, up = tensors["gate_up"].chunk(2)
    else:
        gate, up = tensors.get("gate"), tensors["up"]
    for kind in kinds:
        if kind == "bundle":
            parts = [up, down.T] if gate is None else [gate, up, down.T]
            yield kind, torch.cat(parts, dim=1)
        elif kind == "dip_in":
            yield kind, torch.cat([up.T, gate.T], dim=1)
        else:
            yield kind, down.T.contiguous()


def _check_shapes(
    spec: MLPSpec, owner: str, tensors: dict[str, torch.Tensor], dims: tuple[int, int] | None
) -> tuple[int, int]:
    """`(d_model, d_ff)` of one MLP, checked against its own tensors and against earlier layers'."""
    if tensors["down"].dim() != 2:
        raise UnsupportedArchitectureError(f"{owner}: the down projection is not a matrix.")
    d_model, d_ff = tensors["down"].shape
    expected = {
        "down": (d_model, d_ff),
        "up": (d_ff, d_model),
        "gate": (d_ff, d_model),
        "gate_up": (2 * d_ff, d_model),
        "up_bias": (d_ff,),
        "down_bias": (d_model,),
    }
    wrong = [
        f"{role} {tuple(tensor.shape)} (expected {expected[role]})"
        for role, tensor in tensors.items()
        if tuple(tensor.shape) != expected[role]
    ]
    if wrong:
        raise UnsupportedArchitectureError(
            f"{owner}: MLP tensors of unexpected shape for the {spec.family} family: {', '.join(wrong)}."
        )
    if dims is not None and (d_model, d_ff) != dims:
        raise UnsupportedArchitectureError(
            f"{owner} has d_model {d_model}, d_ff {d_ff}; layer 0 has d_model {dims[0]}, d_ff {dims[1]}. "
            "flashlm needs the same MLP shape in every layer."
        )
    return d_model, d_ff


def _check_layer_indices(owners: list[str]) -> None:
    indices = [_layer_index(owner) for owner in owners]
    if indices != list(range(len(owners))):
        raise UnsupportedArchitectureError(
            f"Expected MLPs in layers 0..{len(owners) - 1}, found layers {indices}."
        )


def _resolve_kinds(kinds: Iterable[str] | None, spec: MLPSpec) -> tuple[str, ...]:
    """The kinds to write, in canonical order; ValueError for a kind the architecture cannot have."""
    valid = kinds_for(spec.gated)
    if kinds is None:
        return valid
    requested = {kinds} if isinstance(kinds, str) else set(kinds)
    invalid = sorted(requested - set(valid))
    if invalid or not requested:
        mlp = "gated" if spec.gated else "plain"
        raise ValueError(
            f"Cannot write unit kinds {invalid or '(none)'} for a {spec.family}-family ({mlp}) MLP; "
            f"valid kinds: {', '.join(valid)}."
        )
    return tuple(kind for kind in KINDS if kind in requested)


def _check_destination(dest: Path, overwrite: bool) -> None:
    if not (dest.exists() or dest.is_symlink()):
        return
    if not overwrite:
        raise FileExistsError(
            f"{dest} already exists. Pass overwrite=True (`flashlm convert --overwrite`) to replace it, "
            "or choose another destination."
        )
    if not (dest.is_dir() and ((dest / MANIFEST).is_file() or not any(dest.iterdir()))):
        raise FileExistsError(f"{dest} exists and is not a flashlm store; refusing to replace it.")


def _move_into_place(tmp: Path, dest: Path) -> None:
    """Rename the finished `tmp` to `dest`, replacing an old store only once the new one is in place."""
    if dest.exists() or dest.is_symlink():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        os.replace(dest, old)
        try:
            os.replace(tmp, dest)
        except BaseException:
            os.replace(old, dest)
            raise
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        os.replace(tmp, dest)
    _fsync_dir(dest.parent)


def _fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable (POSIX only: Windows cannot open directories)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
