"""Where a store lives, and the one policy every method follows to open it: the path the config names,
or a default one in flashlm's cache keyed by the weights; converted first where nothing is there."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .._utils import cache_dir

logger = logging.getLogger(__name__)
S = TypeVar("S")


def default_store_path(name: str, key: str, suffix: str = ".flash") -> Path:
    """Where a store lives when the config names none: `<cache>/stores/<name>-<key[:16]><suffix>`
    (`.flash` for MLP stores, `.endor` for Endor stores)."""
    safe_name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name or "model")
    return cache_dir() / "stores" / f"{safe_name}-{key[:16]}{suffix}"


def store_path(path: str | Path | None, name: str, key: str, suffix: str = ".flash") -> Path:
    """The store `path` a config names, or the default one for `name` and `key`."""
    return Path(path).expanduser() if path else default_store_path(name, key, suffix)


def open_or_convert(
    path: str | Path | None,
    name: str,
    key: str,
    suffix: str,
    convert_to: Callable[[Path], object],
    open_at: Callable[[Path], S],
) -> S:
    """The store at `path`, or at the default path for `name` and `key` (a fingerprint or content hash);
    converted first (`convert_to(path)`, which writes to a temporary name and renames) if nothing is
    there. The caller checks that it matches the model."""
    path = store_path(path, name, key, suffix)
    if not path.exists():
        logger.warning("flashlm: no store at %s; converting %s (one pass over the weights).", path, name)
        convert_to(path)
    return open_at(path)
