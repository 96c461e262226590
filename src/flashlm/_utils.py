"""Small helpers shared across flashlm: byte sizes, the process's peak and available memory, the cache
directory, a model's device."""

from __future__ import annotations

import os
import re
import resource
import sys
from pathlib import Path

import torch

from .errors import CacheDirError, ConfigError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bytes(size: int | str) -> int:
    """Turn `512MB`, `1.5GiB` or `1048576` into a number of bytes (decimal units as in Accelerate)."""
    if isinstance(size, bool):
        raise ConfigError(f"Expected a byte size, got {size!r}.")
    if isinstance(size, int):
        if size < 0:
            raise ConfigError(f"A byte size must be non-negative, got {size}.")
        return size
    match = _SIZE_RE.match(str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"Cannot read {size!r} as a byte size: use an integer or a string such as '512MB' or '1.5GiB'."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """`format_bytes(1536000)` -> '1.54 MB'."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def peak_rss_bytes() -> int:
    """The most memory this process has held resident, in bytes.

    Linux's `VmHWM` where there is one: `ru_maxrss` also counts the parent's resident pages at the
    fork that started this process, so a small measured child of a large parent would report the
    parent's size.
    """
    if (peak := _proc_bytes("/proc/self/status", "VmHWM")) is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere


def available_memory_bytes() -> int | None:
    """Memory the kernel can still give without swapping (Linux's `MemAvailable`), or None where it
    does not say."""
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def _proc_bytes(path: str, field: str) -> int | None:
    """The `field:` line of a Linux /proc file (a size in kB) in bytes; None where there is none."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cache_dir() -> Path:
    """flashlm's cache directory: `$FLASHLM_CACHE`, else `$XDG_CACHE_HOME/flashlm`, else `~/.cache/flashlm`.

    Created if missing; raises `CacheDirError` if it cannot be created or written.
    """
    if env := os.environ.get("FLASHLM_CACHE"):
        path = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(xdg).expanduser() / "flashlm"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheDirError(
            f"Cannot create flashlm's cache directory {path}: {exc.strerror}. "
            "Set FLASHLM_CACHE to a writable directory."
        ) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheDirError(
            f"flashlm's cache directory {path} is not writable. Set FLASHLM_CACHE to a writable directory."
        )
    return path


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: its `device` (a transformers model's), else its first parameter's, else the
    CPU (a model without parameters)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
