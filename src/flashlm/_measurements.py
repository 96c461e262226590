"""Measurements of the machine at hand, remembered in flashlm's cache (`<cache>/measurements/*.json`).

Choices made by timing (which column product is fastest, how many requests the disk wants in flight)
are measured once per machine and reused by later loads: re-measuring at every load would cost time
and could choose differently from one run to the next. Each file maps a key (what the measurement
depends on) to a JSON object. A missing, damaged or unwritable file only means measuring again.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from ._utils import cache_dir
from .errors import CacheDirError

T = TypeVar("T")


def _path(name: str) -> Path | None:
    try:
        return cache_dir() / "measurements" / name
    except CacheDirError:
        return None  # an unwritable cache: measure at every load


def recall(name: str, key: str, kind: Callable[..., T]) -> T | None:
    """The entry remembered under `key` in measurements file `name`, as `kind(**entry)`; None where there
    is none, or one `kind` refuses (a file of an older flashlm, or damaged): measure again, and rewrite
    it."""
    path = _path(name)
    try:
        entry = json.loads(path.read_text())[key] if path is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged
    if not isinstance(entry, dict):
        return None
    try:
        return kind(**entry)
    except (TypeError, ValueError, KeyError):  # fields or values `kind` refuses
        return None


def remember(name: str, key: str, entry: dict[str, Any]) -> None:
    """Store `entry` under `key` in measurements file `name` (written to a temporary name, renamed)."""
    path = _path(name)
    if path is None:
        return
    try:
        known = json.loads(path.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    known[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, path)  # another process's concurrent write may win: both hold valid measurements


def machine_key() -> str:
    """What every measurement depends on: torch and the CPU kernels it may use, and the CPU."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    isa = (os.environ.get(name, "") for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"))
    return "|".join([torch.__version__, torch.backends.cpu.get_cpu_capability(), *isa, cpu])


def median_seconds(
    run: Callable[[], object], repeats: int = 7, before: Callable[[], None] | None = None
) -> float:
    """Median seconds of `run` after one warm-up call; `before` runs untimed before each timed call."""
    run()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return sorted(samples)[len(samples) // 2]
