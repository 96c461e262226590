"""`convert`: write a store from a checkpoint or a model, in one streaming pass over its layers;
`add_kinds`: add unit kinds to an existing store, derived from the kinds it holds.

Each layer's MLP tensors are loaded, rearranged into the row matrices of the requested unit kinds
(by default dense streaming's, `dense_kinds`), written, hashed and dropped before the next layer is
read, so memory holds one layer at a time. Everything goes to a temporary sibling directory that is
renamed to the destination only when complete. The other kinds (the sparse methods' layouts) are
added on first use by `add_kinds`, which rebuilds each layer's weights from the kinds the store has
(`layer_weights`) and commits the new files by replacing `manifest.json`, so a store never has to
hold every layout of every model.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from .._version import __version__
from ..arch import MLPSpec, layer_index
from ..errors import StoreCorruptError, StoreMismatchError, UnsupportedArchitectureError
from .format import (
    FORMAT,
    FORMAT_VERSION,
    KIND_LAYOUTS,
    KINDS,
    MANIFEST,
    RESIDENT,
    ROWS,
    Store,
    dense_kinds,
    dtype_from_name,
    dtype_name,
    kinds_for,
    row_file_name,
    unit_matrices,
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
    provenance: dict | None = None,
) -> Store:
    """Convert a model's MLP weights into a store at `dest` and return it, opened.

    Args:
        source: a Hugging Face safetensors checkpoint directory, a model in memory, or a `TensorSource`.
        dest: the store directory to create. Nothing is ever left half-written there: on any error
            the temporary directory is removed and an existing store is kept.
        dtype: dtype of the stored weights (`torch.bfloat16` or `"bfloat16"`); None keeps the source's.
        kinds: unit kinds to write (see `KINDS`); None writes dense streaming's (`dense_kinds`),
            from which every other kind can be derived: `add_kinds` (which loading a model with a
            sparse method calls) adds the others when they are first needed.
        progress: show a progress bar over layers.
        overwrite: replace an existing store at `dest` (otherwise `FileExistsError`).
        provenance: more to record in the manifest's `source` (how derived weights were made).
    """
    source = as_source(source)
    spec, owners = mlp_owners(source)
    _check_layer_indices(owners)
    kinds = _resolve_kinds(kinds, spec.family, spec.gated)
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    dest = Path(dest).expanduser()
    with staged_directory(dest, overwrite=overwrite) as tmp:
        _write_store(source, spec, owners, kinds, dtype, tmp, progress, provenance or {})
    return Store.open(dest)


@contextmanager
def staged_directory(dest: Path, *, overwrite: bool) -> Iterator[Path]:
    """A temporary sibling of `dest` (with a `layers/` subdirectory) to write a store into.

    When the block completes, the directory is renamed to `dest` (an old store there is replaced only
    once the new one is in place); on any error it is removed and `dest` is left as it was.
    """
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
        yield tmp
        move_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def add_kinds(store: Store, kinds: Iterable[str], *, progress: bool = True) -> Store:
    """Make `store` hold every unit kind in `kinds`, deriving the missing ones from those it holds.

    Returns `store` itself when it already holds them all, else the store reopened (and revalidated).
    Each layer's weights are read back (`layer_weights`) and laid out as `convert` would (the files
    are byte-identical to those `convert(..., kinds=...)` writes). New row files are
    written under temporary names and renamed into place; the kinds become visible only when the
    updated manifest replaces `manifest.json`, so a failure or a crash leaves the store as it was.
    Concurrent callers on one store are serialized by an advisory lock on its directory (POSIX).

    Raises:
        ValueError: a kind the store's MLP cannot have (the sparse kinds need a gated MLP).
        StoreMismatchError: the store's kinds do not hold every weight of the MLP.
        StoreCorruptError: a matrix does not have the shape the manifest's MLP gives.
        OSError: the store's directory is not writable.
    """
    named = {kinds} if isinstance(kinds, str) else set(kinds)
    requested = _resolve_kinds(named, store.family, store.gated) if named else ()
    if all(kind in store.kinds for kind in requested):
        return store
    path = store.path
    with _directory_lock(path):
        store = Store.open(path)  # another process may have added kinds while this one waited
        missing = tuple(kind for kind in requested if kind not in store.kinds)
        if not missing:
            return store
        if _source_kinds(store) is None:
            wanted = ",".join(kind for kind in KINDS if kind in store.kinds or kind in missing)
            raise StoreMismatchError(
                f"The store {path} holds only {', '.join(store.kinds)}, which do not hold every weight of "
                f"the MLP, so flashlm cannot derive {', '.join(missing)} from it. Convert it again with "
                f"`flashlm convert --kinds {wanted} SRC DST` (or `flashlm.store.convert(src, dst, "
                f"kinds=[...])`) including every kind you need."
            )
        try:
            _add_kinds(store, missing, progress)
        except OSError as exc:
            if isinstance(exc, StoreCorruptError) or exc.errno is None:
                raise
            raise type(exc)(
                exc.errno,
                f"Cannot add unit kinds {', '.join(missing)} to the store {path}: {exc.strerror}. The store "
                "is unchanged; make room or make it writable, or convert a store that holds every kind you "
                "need (`flashlm.store.convert(src, dst, kinds=[...])`).",
            ) from exc
        return Store.open(path)


def _add_kinds(store: Store, missing: tuple[str, ...], progress: bool) -> None:
    """Write `missing` kinds' files next to `store`'s, then commit them by replacing the manifest."""
    path = store.path
    layers_dir = path / "layers"
    suffix = f".tmp-{os.getpid()}"
    pending: list[tuple[Path, Path]] = []  # (temporary, final) row files
    placed: list[Path] = []
    files: dict[str, dict[str, int]] = {}
    layouts: dict[str, dict] = {}
    manifest_tmp = path / f".{MANIFEST}{suffix}"
    committed = False
    try:
        for layer in tqdm(
            range(store.num_layers),
            desc=f"Adding {', '.join(missing)} to store",
            unit="layer",
            disable=not progress,
        ):
            tensors = layer_weights(store, layer)
            for kind, rows in unit_matrices(tensors, missing):
                relative = row_file_name(layer, kind)
                final = path / relative
                tmp = layers_dir / f".{final.name}{suffix}"
                pending.append((tmp, final))
                files[relative] = write_aligned_safetensors(tmp, {ROWS: rows})
                layouts[kind] = _layout(kind, store.gated, rows)
                del rows
            del tensors
        for tmp, final in pending:
            os.replace(tmp, final)
            placed.append(final)
        fsync_dir(layers_dir)
        manifest = dict(store.manifest)
        kinds = [kind for kind in KINDS if kind in store.kinds or kind in missing]
        manifest["kinds"] = {kind: store.manifest["kinds"].get(kind) or layouts[kind] for kind in kinds}
        manifest["files"] = _ordered_files(store.manifest["files"] | files, kinds, store.num_layers)
        write_json_durably(manifest_tmp, manifest)
        os.replace(manifest_tmp, path / MANIFEST)
        committed = True
        fsync_dir(path)
    except BaseException:
        if not committed:
            for stray in [manifest_tmp, *(tmp for tmp, _ in pending), *placed]:
                stray.unlink(missing_ok=True)
        raise


_SOURCE_KIND_SETS = (
    ("gate", "up", "down"),
    ("up", "down"),
    ("bundle",),
    ("dip_in", "dip_down"),
    ("up", "gate_down"),
    ("gate", "up_down"),
)
"""Sets of kinds that together hold a whole MLP, in the order `layer_weights` prefers them."""


def _source_kinds(store: Store) -> tuple[str, ...] | None:
    """The first set of `_SOURCE_KIND_SETS` the store holds whole, or None."""
    roles = {"gate", "up", "down"} if store.gated else {"up", "down"}
    for kinds in _SOURCE_KIND_SETS:
        if all(kind in store.kinds for kind in kinds):
            covered = {role for kind in kinds for role in _ROLES[kind]} & roles
            if covered == roles:
                return kinds
    return None


_ROLES = {
    "up": ("up",),
    "down": ("down",),
    "bundle": ("gate", "up", "down"),
    "dip_in": ("up", "gate"),
    "dip_down": ("down",),
    "gate": ("gate",),
    "gate_down": ("gate", "down"),
    "up_down": ("up", "down"),
}
"""The MLP weights each kind's rows hold (a plain MLP's bundle holds only up and down)."""


def layer_weights(store: Store, layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s MLP weights by role (`gate`, `up`: [d_ff, d_model]; `down`: [d_model, d_ff];
    views, possibly transposed), read back from kinds the store holds: the inverse of `unit_matrices`.

    Raises `StoreMismatchError` when the store's kinds do not hold the whole MLP, and
    `StoreCorruptError` when a matrix has another shape than the manifest's MLP gives.
    """
    kinds = _source_kinds(store)
    if kinds is None:
        raise StoreMismatchError(
            f"The store {store.path} ({', '.join(store.kinds)}) does not hold a whole MLP."
        )
    d_model, d_ff = store.d_model, store.d_ff
    weights: dict[str, torch.Tensor] = {}
    for kind in kinds:
        row_file = store.row_file(layer, kind)
        with safe_open(row_file.path, framework="pt") as f:
            rows = f.get_tensor(ROWS)
        if tuple(rows.shape) != (row_file.rows, row_file.width):
            raise StoreCorruptError(
                f"{row_file.path} holds a {list(rows.shape)} matrix where the manifest describes "
                f"[{row_file.rows}, {row_file.width}]. Delete the store and convert again."
            )
        weights.update(_split_rows(kind, rows, d_model, d_ff, store.gated))
    return weights


def _split_rows(
    kind: str, rows: torch.Tensor, d_model: int, d_ff: int, gated: bool
) -> dict[str, torch.Tensor]:
    """The MLP weights one kind's `[rows, width]` matrix holds, by role (see `KIND_LAYOUTS`)."""
    if kind == "bundle":
        *gate, up, down_t = rows.split(d_model, dim=1)
        return {"up": up, "down": down_t.T} | ({"gate": gate[0]} if gate else {})
    if kind == "dip_in":
        up_t, gate_t = rows.split(d_ff, dim=1)
        return {"up": up_t.T, "gate": gate_t.T}
    if kind in ("gate_down", "up_down"):
        projection, down_t = rows.split(d_model, dim=1)
        return {kind.removesuffix("_down"): projection, "down": down_t.T}
    if kind == "dip_down":
        return {"down": rows.T}
    return {kind: rows}  # gate, up, down: the checkpoint's own layout


def _ordered_files(files: dict[str, dict], kinds: list[str], num_layers: int) -> dict[str, dict]:
    """`files` in the order `convert` lists them: layer by layer, kinds in canonical order, then the rest."""
    ordered = {
        relative: files[relative]
        for layer in range(num_layers)
        for kind in kinds
        if (relative := row_file_name(layer, kind)) in files
    }
    return ordered | {relative: entry for relative, entry in files.items() if relative not in ordered}


@contextmanager
def _directory_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (`flock`) on the directory `path`; a no-op where locks are unavailable."""
    try:
        import fcntl
    except ImportError:  # Windows
        fcntl = None
    fd = None
    if fcntl is not None:
        with suppress(OSError):  # a file system without flock: go on unlocked
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _write_store(
    source: TensorSource,
    spec: MLPSpec,
    owners: list[str],
    kinds: tuple[str, ...],
    dtype: torch.dtype | None,
    tmp: Path,
    progress: bool,
    provenance: dict,
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
        for kind, rows in unit_matrices(tensors, kinds):
            relative = row_file_name(layer, kind)
            files[relative] = write_aligned_safetensors(tmp / relative, {ROWS: rows})
            layouts[kind] = _layout(kind, spec.gated, rows)
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
        "source": {
            "path": source.path,
            "fingerprint": fingerprint,
            "content_sha256": digest.hexdigest(),
            **provenance,
        },
    }
    write_json_durably(tmp / MANIFEST, manifest)
    fsync_dir(tmp / "layers")
    fsync_dir(tmp)


def _layout(kind: str, gated: bool, rows: torch.Tensor) -> dict:
    """The manifest's description of one kind, from one layer's matrix of it."""
    return {
        "rows": rows.shape[0],
        "width": rows.shape[1],
        "row_bytes": rows.shape[1] * rows.element_size(),
        "layout": KIND_LAYOUTS[(kind, gated)],
    }


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
    indices = [layer_index(owner) for owner in owners]
    if indices != list(range(len(owners))):
        raise UnsupportedArchitectureError(
            f"Expected MLPs in layers 0..{len(owners) - 1}, found layers {indices}."
        )


def _resolve_kinds(kinds: Iterable[str] | None, family: str, gated: bool) -> tuple[str, ...]:
    """The kinds to write, in canonical order (None: `dense_kinds`); ValueError for a kind the MLP cannot
    have."""
    valid = kinds_for(gated)
    if kinds is None:
        kinds = dense_kinds(gated)
    requested = {kinds} if isinstance(kinds, str) else set(kinds)
    invalid = sorted(requested - set(valid))
    if invalid or not requested:
        mlp = "gated" if gated else "plain"
        raise ValueError(
            f"Cannot write unit kinds {invalid or '(none)'} for a {family}-family ({mlp}) MLP; "
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


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`); False where the system or
    the file system cannot."""
    if sys.platform != "linux":
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # glibc before 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def move_into_place(tmp: Path, dest: Path) -> None:
    """Rename the finished directory `tmp` to `dest` (a store, an adapter), replacing an old one only once
    the new one is in place: in one atomic exchange where the system allows (a kill at any point leaves
    one whole directory at `dest`), else by moving the old one aside first."""
    if (dest.exists() or dest.is_symlink()) and _exchange(tmp, dest):
        _remove(tmp)  # now the old store
    elif dest.exists() or dest.is_symlink():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        os.replace(dest, old)
        try:
            os.replace(tmp, dest)
        except BaseException:
            os.replace(old, dest)
            raise
        _remove(old)
    else:
        os.replace(tmp, dest)
    fsync_dir(dest.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def write_json_durably(path: Path, data: object) -> None:
    """Write `data` as indented JSON to `path` and fsync it (a manifest must be on disk before its rename)."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable (POSIX only: Windows cannot open directories)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
