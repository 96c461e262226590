"""Build a small C source once, with the system compiler, into a shared library in flashlm's cache.

flashlm's C kernels (Endor decompression, the sparse column products) are plain C loaded with
ctypes: no torch headers, a second to compile. Each library is keyed by its source, its flags and the
machine, written under a temporary name and renamed, so concurrent processes never load a half-written
file. Without a compiler, or with `FLASHLM_C_KERNEL=0`, `load_library` returns None and the caller runs
its torch path.

The instruction set follows torch's own CPU capability: `ATEN_CPU_CAPABILITY=avx2` (torch's AVX2
kernels) builds the C kernels for AVX2 too, so one variable selects what an AVX2-only machine runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from ._utils import cache_dir

logger = logging.getLogger(__name__)

ELEMENT_SUFFIXES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
"""Element types of the operators' rows (`ops/_elements.h`) and the suffix of each one's function."""

_X86_MARCH = {"AVX512": "native", "AVX2": "x86-64-v3"}
"""torch CPU capability -> gcc `-march`; anything else on x86 gets the SSE4.2 baseline `x86-64-v2`."""


def target_flags() -> tuple[str, ...]:
    """Code generation flags for the CPU torch runs on, at torch's capability (see module docstring)."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return (f"-march={_X86_MARCH.get(torch.backends.cpu.get_cpu_capability(), 'x86-64-v2')}",)
    return ("-mcpu=native",)


def build_flags(*, openmp: bool = False) -> tuple[str, ...]:
    """The compiler flags flashlm builds its C operators with (`-fopenmp` with `openmp`)."""
    return ("-O3", *target_flags(), "-shared", "-fPIC", *(("-fopenmp",) if openmp else ()))


def kernels_enabled() -> bool:
    """False when `FLASHLM_C_KERNEL=0` asks for the torch paths."""
    return os.environ.get("FLASHLM_C_KERNEL", "1") != "0"


@functools.cache
def load_library(
    source: Path, name: str, *, openmp: bool = False, hold_gil: bool = False
) -> ctypes.CDLL | None:
    """`source` compiled (once per source, flags and CPU) and loaded; None where that is impossible
    (logged once, naming the torch fallback).

    Calls release the GIL unless `hold_gil` (a `ctypes.PyDLL`: for functions of a few microseconds,
    where giving the GIL to another thread and waiting to get it back costs more than the call).

    `openmp` builds with `-fopenmp`: the library then needs `libgomp.so.1`, which the dynamic linker
    finds already loaded by torch (its wheel ships that soname), so the kernel's parallel regions run
    on torch's own thread team instead of a second one competing for the cores.
    """
    if not kernels_enabled():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("flashlm: no C compiler found; %s runs as torch ops (slower).", name)
        return None
    flags = build_flags(openmp=openmp)
    key = hashlib.sha256((source_digest(source) + " ".join(flags) + _cpu_signature()).encode())
    path = cache_dir() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    if not path.exists():
        try:
            _build(compiler, flags, source, path)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", None) or exc
            logger.warning("flashlm: could not build %s (%s); using torch ops (slower).", name, detail)
            return None
    return (ctypes.PyDLL if hold_gil else ctypes.CDLL)(str(path))


@functools.cache
def source_digest(source: Path) -> str:
    """A digest of `source` and the headers beside it: what a kernel built from them computes."""
    headers = b"".join(header.read_bytes() for header in sorted(source.parent.glob("*.h")))
    return hashlib.sha256(source.read_bytes() + headers).hexdigest()


def typed_functions(
    library: ctypes.CDLL, prefix: str, argtypes: list
) -> dict[torch.dtype, Callable[..., None]]:
    """`{dtype: library.<prefix>_<suffix>}` for the element types flashlm's operators take, typed."""
    functions = {}
    for dtype, suffix in ELEMENT_SUFFIXES.items():
        function = getattr(library, f"{prefix}_{suffix}")
        function.argtypes = argtypes
        function.restype = None
        functions[dtype] = function
    return functions


def _build(compiler: str, flags: tuple[str, ...], source: Path, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        subprocess.run(
            [compiler, *flags, "-o", str(tmp), str(source)], check=True, capture_output=True, text=True
        )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _cpu_signature() -> str:
    """The machine and its CPU flags: a library built for one CPU runs only where they match."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags}"
