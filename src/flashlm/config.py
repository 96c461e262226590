"""`FlashConfig`: what a patched model does (persisted in config.json) and where it runs (runtime).

Persisted options describe the model's computation and are saved by `save_pretrained`, with the
flashlm version, so a saved model re-patches itself on load. Runtime options (store path, memory
budget, I/O settings) belong to the machine and are never written to config.json; when a saved
model is loaded without them they take their defaults (`FLASHLM_STORE`, `FLASHLM_MEMORY_BUDGET`
environment variables, else the values below).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from ._utils import parse_bytes
from .errors import ConfigError

QUANT_METHOD = "flashlm"
METHODS = ("dense",)
POLICIES = ("lru", "lfu", "window")
PERSISTED_OPTIONS = ("method", "density", "policy", "window")
RUNTIME_OPTIONS = ("store", "memory_budget", "direct_io", "io_threads", "io_chunk_bytes")
DEFAULT_MEMORY_BUDGET = "50%"
_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


@dataclass(frozen=True)
class Budget:
    """A memory budget: absolute bytes, or a fraction of the model's streamed MLP bytes."""

    bytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, value: int | float | str) -> Budget:
        """`"512MB"`, `1_000_000` and `"50%"` are budgets; anything else raises `ConfigError`."""
        if isinstance(value, str) and (match := _PERCENT_RE.match(value)):
            fraction = float(match.group(1)) / 100
            if not fraction > 0:
                raise ConfigError(f"memory_budget {value!r} must be a positive percentage.")
            return cls(fraction=fraction)
        if isinstance(value, float):
            raise ConfigError(
                f"memory_budget {value!r} is ambiguous: give bytes as an int or a string ('512MB', '50%')."
            )
        return cls(bytes=parse_bytes(value))

    def resolve(self, mlp_bytes: int) -> int:
        """Bytes this budget grants for a model whose streamed MLP weights take `mlp_bytes`."""
        return self.bytes if self.bytes is not None else int(self.fraction * mlp_bytes)


class FlashConfig(QuantizationConfigMixin):
    """Configuration of a flashlm-patched model.

    Args:
        method: what each MLP does. `"dense"` streams every unit every token (exact; the baseline
            every sparse method is measured against).
        density: target fraction of MLP weights used per token, in (0, 1]. `"dense"` requires 1.0.
        policy: cache eviction policy: `"lru"`, `"lfu"` or `"window"` (units used in the last
            `window` tokens stay resident).
        window: the sliding window's length in tokens, for `policy="window"`.
        store: path of the SSD weight store. Default: a directory in flashlm's cache named after
            the checkpoint; a missing store is converted on first load.
        memory_budget: bytes for the neuron cache and its I/O buffers: an int, `"512MB"`, or a
            percentage of the model's MLP bytes (`"25%"`).
        direct_io: read with O_DIRECT (bypassing the page cache). `None` uses it where the OS and
            file system allow and falls back to buffered reads otherwise (stats say which); `True`
            requires it; `False` never uses it.
        io_threads: reader threads. `None` takes the measured default.
        io_chunk_bytes: longest single read (a multiple of 4096). `None` takes the measured default.
    """

    def __init__(
        self,
        method: str = "dense",
        density: float = 1.0,
        policy: str = "lru",
        window: int = 5,
        store: str | os.PathLike | None = None,
        memory_budget: int | str | None = None,
        direct_io: bool | None = None,
        io_threads: int | None = None,
        io_chunk_bytes: int | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("flashlm_version", None)
        kwargs.pop("quant_method", None)
        if kwargs:
            raise ConfigError(
                f"Unknown FlashConfig option(s): {sorted(kwargs)}. "
                f"Options: {', '.join(PERSISTED_OPTIONS + RUNTIME_OPTIONS)}."
            )
        self.quant_method = QUANT_METHOD
        self.method = method
        self.density = density
        self.policy = policy
        self.window = window
        self.store = store if store is not None else os.environ.get("FLASHLM_STORE")
        self.memory_budget = (
            memory_budget
            if memory_budget is not None
            else os.environ.get("FLASHLM_MEMORY_BUDGET", DEFAULT_MEMORY_BUDGET)
        )
        self.direct_io = direct_io
        self.io_threads = io_threads
        self.io_chunk_bytes = io_chunk_bytes
        self.post_init()

    def post_init(self) -> None:
        """Validate every option; raises `ConfigError` saying which one and what is allowed."""
        if self.method not in METHODS:
            raise ConfigError(f"Unknown method {self.method!r}. Available methods: {', '.join(METHODS)}.")
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)):
            raise ConfigError(f"density must be a number in (0, 1], got {self.density!r}.")
        if not 0 < self.density <= 1:
            raise ConfigError(f"density must be in (0, 1], got {self.density}.")
        if self.method == "dense" and self.density != 1:
            raise ConfigError(f"method='dense' streams every unit: density must be 1.0, got {self.density}.")
        if self.policy not in POLICIES:
            raise ConfigError(f"Unknown policy {self.policy!r}. Available policies: {', '.join(POLICIES)}.")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"window must be a positive number of tokens, got {self.window!r}.")
        if self.io_threads is not None and (not isinstance(self.io_threads, int) or self.io_threads < 1):
            raise ConfigError(f"io_threads must be a positive int or None, got {self.io_threads!r}.")
        if self.io_chunk_bytes is not None and (
            not isinstance(self.io_chunk_bytes, int) or self.io_chunk_bytes <= 0 or self.io_chunk_bytes % 4096
        ):
            raise ConfigError(
                f"io_chunk_bytes must be a positive multiple of 4096 or None, got {self.io_chunk_bytes!r}."
            )
        if self.direct_io not in (None, True, False):
            raise ConfigError(f"direct_io must be True, False or None, got {self.direct_io!r}.")
        self.budget = Budget.parse(self.memory_budget)

    def to_dict(self) -> dict[str, Any]:
        """The persisted options, stamped with the flashlm version (runtime options stay out)."""
        from . import __version__

        persisted = {name: getattr(self, name) for name in PERSISTED_OPTIONS}
        return {"quant_method": QUANT_METHOD, **persisted, "flashlm_version": __version__}

    def runtime_options(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in RUNTIME_OPTIONS}

    def __repr__(self) -> str:
        options = {**self.to_dict(), **self.runtime_options()}
        options.pop("quant_method")
        return f"FlashConfig({', '.join(f'{k}={v!r}' for k, v in options.items())})"
