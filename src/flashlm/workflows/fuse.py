"""`fuse_adapter`: a LoRA adapter from `flashlm train lora` fused into the store it was trained on
(`flashlm.store.fuse`), with the calibration and predictors it was trained under carried over.

The adapter learned to recover the method under the masks that calibration (DIP's density split, the
thresholds) and those predictors gave, so they are the ones to stream the fused store with: they are
re-keyed to the fused weights, the calibration recording the weights it was measured on
(`Calibration.measured_on`). Anything else fitted to the unfused weights no longer matches.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import PredictorsNotFoundError
from ..methods.calibration import Calibration
from ..predictors import Predictors
from ..store import Store
from ..store.fuse import LoraAdapter, fuse


def fuse_adapter(
    store: Store | str | os.PathLike,
    adapter: str | os.PathLike,
    dest: str | os.PathLike | None = None,
    *,
    progress: bool = True,
) -> Store:
    """Write `store` with the LoRA adapter at `adapter` fused in to `dest` (None: replace `store` once the
    fused one is complete); returns the fused store, opened.

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
    fused = fuse(store, loaded, None if dest is None else Path(dest).expanduser(), progress=progress)
    if calibration is not None:
        calibration.measured_on = calibration.measured_on or calibration.content_sha256
        calibration.content_sha256 = fused.content_sha256
        calibration.save(fused.path)
    if predictors is not None:
        predictors.save(fused)
    return fused
