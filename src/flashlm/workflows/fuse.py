"""`fuse_adapter`: a LoRA adapter from `flashlm train lora` fused into the store it was trained on
(`flashlm.store.fuse`), with the calibration and predictors it was trained under carried over.

The adapter learned to recover the method under the masks that calibration (DIP's density split, the
thresholds) and those predictors gave, so they are the ones to stream the fused store with: they are
re-keyed to the fused weights, the calibration recording the weights it was measured on
(`Calibration.measured_on`). Anything else fitted to the unfused weights no longer matches.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..config import FlashConfig
from ..errors import ConfigError, PredictorsNotFoundError
from ..methods.calibration import Calibration
from ..methods.mlp import open_checkpoint_store
from ..predictors import Predictors
from ..store import Store
from ..store.convert import move_into_place
from ..store.fuse import LoraAdapter, fuse, roles_by_name
from ..store.sources import SafetensorsSource, mlp_owners
from .prune import PRUNING_FILE, read_pruning_record


def fuse_adapter(
    store: Store | str | os.PathLike,
    adapter: str | os.PathLike,
    dest: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> Store:
    """Write `store` with the LoRA adapter at `adapter` fused in to `dest` (None: replace `store`;
    `overwrite`: replace a store at `dest`; either once the fused one is complete); returns the fused
    store, opened.

    Raises `AdapterCorruptError` / `AdapterMismatchError` (see `flashlm.store.fuse.LoraAdapter.load`).
    """
    store = store if isinstance(store, Store) else Store.open(store)
    loaded = LoraAdapter.load(adapter, store)
    # Read what was fitted to the old weights before an in-place rewrite replaces them.
    calibration = Calibration.load(store.path, store.content_sha256)
    try:
        predictors = Predictors.load(store)
    except PredictorsNotFoundError:
        predictors = None
    dest = None if dest is None else Path(dest).expanduser()
    fused = fuse(store, loaded, dest, overwrite=overwrite, progress=progress)
    if calibration is not None:
        calibration.measured_on = calibration.measured_on or calibration.content_sha256
        calibration.content_sha256 = fused.content_sha256
        calibration.save(fused.path)
    if predictors is not None:
        predictors.save(fused)
    return fused


def fuse_pruned_checkpoint(
    checkpoint: str | os.PathLike,
    adapter: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> Path:
    """Write a copy of the Wanda-pruned `checkpoint` with the LoRA adapter at `adapter` (trained with
    `method="endor"`) fused into its MLP weights, each delta kept to the pruning pattern:
    `W + (s·BA) ⊙ (W ≠ 0)`, the weights the adapter was trained as. The copy's `pruning.json` lists the
    adapter; the Endor method compresses it when it loads it. Written under a temporary name, renamed
    when complete (replacing a directory there only with `overwrite`); returns `out_dir`.
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir).expanduser()
    record = read_pruning_record(checkpoint)
    if record is None:
        raise ConfigError(
            f"{checkpoint} is not a checkpoint `flashlm prune` wrote (it has no {PRUNING_FILE})."
        )
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists: choose a new directory for the fused checkpoint.")
    loaded = LoraAdapter.load(adapter, open_checkpoint_store(checkpoint, FlashConfig(), progress=False))
    names = roles_by_name(*mlp_owners(SafetensorsSource(checkpoint)))
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(checkpoint, tmp)
        for file in sorted(tmp.glob("*.safetensors")):
            tensors = load_file(file)
            for name, tensor in tensors.items():
                delta = loaded.delta(*names[name]) if name in names else None
                if delta is not None:
                    tensors[name] = (tensor.float() + delta * (tensor != 0)).to(tensor.dtype)
            save_file(tensors, file, metadata={"format": "pt"})
        adapters = [*record.get("fused_adapters", []), {"path": str(loaded.path), "sha256": loaded.sha256}]
        (tmp / PRUNING_FILE).write_text(json.dumps({**record, "fused_adapters": adapters}, indent=2) + "\n")
        move_into_place(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
