"""Method specs: the short names the CLI, `flashlm eval` and the benchmarks use for a method and its
variant (`dip-ca:0.1`), as `FlashConfig` options. The plain names are the method registry's."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from .base import METHODS

DEFAULT_CACHE_AWARE = 0.2
"""γ of `dip-ca` without a value: the DIP paper's choice."""
DIP_VARIANTS = ("dip-ca", "dip-ca:<gamma>", "dip-layer", "dip-global")
PREDICTOR_VARIANTS = ("predictor-window:<k>",)
"""The predictor method with LLM in a flash's sliding window of the last k tokens as its cache."""


def method_specs() -> tuple[str, ...]:
    """The forms `parse_method_spec` accepts."""
    return (*METHODS.names(), *DIP_VARIANTS, *PREDICTOR_VARIANTS)


def parse_method_spec(spec: str) -> dict[str, Any]:
    """FlashConfig options of a method spec: `"dip"` -> `{"method": "dip"}`, `"dip-ca:0.1"` ->
    `{"method": "dip", "cache_aware": 0.1, "sequential_prefill": True}`, `"predictor-window:4"` ->
    `{"method": "predictor", "policy": "window", "window": 4}`, ...; an unknown spec raises
    `ConfigError`.

    Cache-aware masks depend on the cache as it evolves token by token, so DIP-CA is scored with
    `sequential_prefill`: each window's forward then equals decoding it one token at a time."""
    text = spec.strip().lower() if isinstance(spec, str) else spec
    if text in METHODS:
        return {"method": text}
    if text == "dip-ca":
        return {"method": "dip", "cache_aware": DEFAULT_CACHE_AWARE, "sequential_prefill": True}
    if isinstance(text, str) and text.startswith("dip-ca:"):
        try:
            gamma = float(text.removeprefix("dip-ca:"))
        except ValueError:
            gamma = math.nan
        if not 0 <= gamma <= 1:
            raise ConfigError(f"Method spec {spec!r}: γ after 'dip-ca:' must be a number in [0, 1].")
        return {"method": "dip", "cache_aware": gamma, "sequential_prefill": True}
    if text in ("dip-layer", "dip-global"):
        return {"method": "dip", "threshold": text.removeprefix("dip-")}
    if isinstance(text, str) and text.startswith("predictor-window:"):
        window = text.removeprefix("predictor-window:")
        if not window.isdigit() or int(window) < 1:
            raise ConfigError(
                f"Method spec {spec!r}: the window after 'predictor-window:' must be tokens >= 1."
            )
        return {"method": "predictor", "policy": "window", "window": int(window)}
    raise ConfigError(f"Unknown method spec {spec!r}. Valid forms: {', '.join(method_specs())}.")
