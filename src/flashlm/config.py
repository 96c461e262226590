"""`FlashConfig`: what a patched model does (persisted in config.json) and where it runs (runtime).

Persisted options describe the model's computation and are saved by `save_pretrained`, with the
flashlm version, so a saved model re-patches itself on load. Runtime options (store path, memory
budget, I/O settings) belong to the machine and are never written to config.json; when a saved
model is loaded without them they take their defaults (`FLASHLM_STORE`, `FLASHLM_MEMORY_BUDGET`
environment variables, else the values below).
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from ._utils import parse_bytes
from .cache.policies import NO_CACHE, POLICIES
from .errors import ConfigError
from .methods import METHODS

QUANT_METHOD = "flashlm"
THRESHOLDS = ("token", "layer", "global")
CACHE_SPLITS = ("read-cost", "size", "profile", "in-order")
PERSISTED_OPTIONS = (
    "method",
    "density",
    "input_density",
    "cache_aware",
    "threshold",
    "policy",
    "window",
)
RUNTIME_OPTIONS = (
    "store",
    "memory_budget",
    "device_budget",
    "direct_io",
    "io_threads",
    "io_chunk_bytes",
    "cache_split",
    "hot_share",
    "read_ahead",
    "sequential_prefill",
    "record_trace",
)
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
            every sparse method is measured against). The DIP paper's methods, for gated MLPs:
            `"dip"` (Dynamic Input Pruning: top-k of |x| picks up/gate input columns, top-k of the
            pruned GLU picks down columns), and its baselines `"glu"` (oracle: full GLU, top-k down
            columns), `"gate"` / `"up"` (full gate or up projection, top-k of it picks the rest)
            and `"cats"` (gate pruning with a per-layer threshold calibrated on text). `"endor"`
            offloads every linear of the decoder layers of a pruned model (attention and MLP), held
            in the Endor bitmap format in memory or on the SSD store and decompressed just before
            use (`flashlm.endor`); it computes exactly what the pruned model computes.
        density: target fraction of MLP weights used per token, in (0, 1]. `"dense"` and `"endor"`
            require 1.0.
            For `"glu"` it is the density of the GLU activation (as in the paper's tables): the
            oracle always reads all of up and gate, so its MLP density is 2/3 + density/3 (reported
            by `flashlm.stats`). `"gate"`, `"up"` and `"cats"` read one full projection, so they
            need density > 1/3.
        input_density: `"dip"` only: fraction of input columns kept for up/gate. The down
            density follows, `3 * density - 2 * input_density`. None takes the Pareto-optimal split
            calibrated for the model (`flashlm.methods.calibration`), or an equal split without one.
        cache_aware: `"dip"` only: γ of cache-aware masking (DIP-CA, the paper's eq. 10): scores
            `|x| (c + γ (1 - c)) / max|x|` with c the cache residency, for both selections but one
            of a kind read ahead whole (`read_ahead`), which reads every unit not resident whatever the
            mask. 1.0 (default) is plain DIP; the paper uses 0.2.
        threshold: `"dip"` only: how input columns are picked: `"token"` (top-k per token, the
            paper's DIP), `"layer"` or `"global"` (a magnitude threshold per layer or for all
            layers, calibrated to keep the same fraction on average; the paper's Fig. 4).
        policy: cache eviction policy: `"lfu"` (default), `"lru"`, `"window"` (units used in the
            last `window` tokens stay resident), `"none"` (no cache: every unit is read every time)
            or `"atu"` (M2Cache's Adjacent Token Update: the units the previous token used stay
            resident).
        window: the sliding window's length in tokens, for `policy="window"`.
        store: path of the SSD weight store. Default: a directory in flashlm's cache named after
            the checkpoint; a missing store is converted on first load.
        memory_budget: bytes for the neuron cache and its I/O buffers: an int, `"512MB"`, or a
            percentage of the model's MLP bytes (`"25%"`). For `"endor"`: bytes for the layers held
            compressed in memory, the staging buffers and the decompression workspace (a percentage is
            of the decoder linears' dense bytes); layers are mapped to memory in order while they fit.
        device_budget: `"endor"` only: bytes of the first layers kept dense on the execution device
            (never compressed), before the memory-mapped ones; default 0.
        direct_io: read with O_DIRECT (bypassing the page cache). `None` uses it where the OS and
            file system allow and falls back to buffered reads otherwise (stats say which); `True`
            requires it; `False` never uses it.
        io_threads: reader threads (requests in flight). `None` measures the store's disk the first
            time a store on it is read (about a second; remembered in flashlm's cache) and takes the
            fewest threads near its best throughput, and the merge gap its request cost and bandwidth
            give (`flashlm.store.disk.disk_profile`); without O_DIRECT, the reader's defaults.
        io_chunk_bytes: request size of a read (a multiple of 4096); a long in-place read takes up to
            `SPREAD_CHUNKS` (16) times this, one request per reader thread
            (`StoreReader.request_bytes`). `None` takes the measured default.
        cache_split: how the budget's cache bytes are shared between unit kinds: `"read-cost"`
            fills first the caches whose misses cost the disk most bytes per unit byte (small units
            under-fill a 4 KiB page), `"size"` shares in proportion to each cache's full size,
            `"profile"` gives the slots to the units a unit profile (`flashlm profile`) says save the
            most disk bytes, across kinds and layers, `"in-order"` fills one kind's caches whole
            before the next kind's, in the method's kind order, and a kind's caches one layer after
            another, in an order that spreads the layers it reaches over the model (so at most one
            cache of the model is partly filled). `None` (default): the method's
            choice, `"in-order"` for dense streaming (see `StreamingMLP`), `"profile"` for
            `predictor-gate` (whose gate rows are used several times as often as its up_down rows),
            `"read-cost"` for the others.
        hot_share: share of the cache's bytes pinned to the units the method needs most often,
            PowerInfer's hot set (its §6): read at load and never evicted, while the rest of each cache
            follows `policy`. The placement solver (`flashlm.cache.placement`) picks them across layers
            and kinds from the store's unit profile of the method (`flashlm profile`), by disk bytes
            saved per token, within each cache's slots (a cache that holds every unit of its layer
            pins nothing, and one of a kind read ahead whole its block). 0 (default): none. Sparse
            methods only.
        read_ahead: read the next layer's uncached units while this layer computes (dense streaming:
            every kind; sparse methods: the first stage's, e.g. DIP's up/gate input columns, needed
            or not). `None` (default) decides: always for dense streaming and for methods whose first
            stage reads every unit; for DIP when a read of only the needed ones would cost its disk
            most of that time anyway, across the gaps its reader merges and with a request per run
            (`flashlm.methods.reads_ahead`: small units, high input density); otherwise DIP-CA reads,
            a layer ahead, the input columns the next layer would select for this layer's input (the
            residual stream changes little between layers), and only the rest when that layer runs, and
            plain DIP reads each layer's when it runs (it would read every wrong guess). `False` makes
            each layer read what it needs when it needs it: slower, but its compute then runs
            without reads beside it (for measuring what overlapped I/O costs the compute). The
            output is unchanged, but for DIP-CA's with the guess (guessed columns count as resident).
            The predictor methods read a layer ahead only with `True`: the first-round units (bundles,
            or gate rows) the next layer's predictor names for this layer's input. It costs a second
            predictor evaluation per layer and reads some units the next layer does not name: measured
            in the decode harness at a 50% budget it made relufied SmolLM2 8-28% faster and relufied
            Qwen2.5-1.5B about 9% slower, so it is not the default. A sparse method's kind whose caches
            hold every unit (a budget that fits it whole) is never read ahead whole: each unit is read
            when first selected and kept, where reading ahead would read the never-selected ones again
            at every token. A cache of a kind read ahead whole with room for some of its units holds a
            fixed block of them, read at load (`flashlm.cache.read_ahead_block`), whatever `policy`.
        sequential_prefill: compute a multi-token forward exactly as that many one-token decode
            steps would (cache-aware masks see the cache evolve token by token) instead of masking
            every token against the cache as it was when the forward began. Slower; the perplexity
            harness uses it so that DIP-CA is scored as it decodes.
        record_trace: record which units each layer used each step since the model was loaded
            (`flashlm.trace(model)`).
    """

    def __init__(
        self,
        method: str = "dense",
        density: float = 1.0,
        input_density: float | None = None,
        cache_aware: float = 1.0,
        threshold: str = "token",
        policy: str = "lfu",
        window: int = 5,
        store: str | os.PathLike | None = None,
        memory_budget: int | str | None = None,
        device_budget: int | str = 0,
        direct_io: bool | None = None,
        io_threads: int | None = None,
        io_chunk_bytes: int | None = None,
        cache_split: str | None = None,
        hot_share: float = 0.0,
        read_ahead: bool | None = None,
        sequential_prefill: bool = False,
        record_trace: bool = False,
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
        self.input_density = input_density
        self.cache_aware = cache_aware
        self.threshold = threshold
        self.policy = policy
        self.window = window
        self.store = store if store is not None else os.environ.get("FLASHLM_STORE")
        self.memory_budget = (
            memory_budget
            if memory_budget is not None
            else os.environ.get("FLASHLM_MEMORY_BUDGET", DEFAULT_MEMORY_BUDGET)
        )
        self.device_budget = device_budget
        self.direct_io = direct_io
        self.io_threads = io_threads
        self.io_chunk_bytes = io_chunk_bytes
        self.cache_split = cache_split
        self.hot_share = hot_share
        self.read_ahead = read_ahead
        self.sequential_prefill = sequential_prefill
        self.record_trace = record_trace
        self.post_init()

    def post_init(self) -> None:
        """Validate every option; raises `ConfigError` saying which one and what is allowed."""
        if self.method not in METHODS:
            raise ConfigError(
                f"Unknown method {self.method!r}. Available methods: {', '.join(METHODS.names())}."
            )
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)):
            raise ConfigError(f"density must be a number in (0, 1], got {self.density!r}.")
        if not 0 < self.density <= 1:
            raise ConfigError(f"density must be in (0, 1], got {self.density}.")
        METHODS[self.method].check_density(self.density)
        self._check_dip_options()
        if self.policy != NO_CACHE and self.policy not in POLICIES:
            choices = ", ".join((*POLICIES.names(), NO_CACHE))
            raise ConfigError(f"Unknown policy {self.policy!r}. Available policies: {choices}.")
        if self.policy != NO_CACHE and POLICIES[self.policy].OFFLINE:
            raise ConfigError(
                f"policy={self.policy!r} needs the future requests of a recorded trace: it runs only in the "
                "offline replay (`flashlm.sim.replay`, `flashlm simulate --policy`). Pick another policy."
            )
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
        if self.cache_split is not None and self.cache_split not in CACHE_SPLITS:
            raise ConfigError(
                f"Unknown cache_split {self.cache_split!r}. Available: {', '.join(CACHE_SPLITS)}."
            )
        share = self.hot_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ConfigError(f"hot_share must be a number in [0, 1], got {share!r}.")
        if share and self.method == "dense":
            raise ConfigError(
                "hot_share pins a sparse method's most-needed units; dense streaming needs every unit "
                "every token, so there is no hot set to pin. Use hot_share=0 or a sparse method."
            )
        if self.read_ahead not in (None, True, False):
            raise ConfigError(f"read_ahead must be True, False or None, got {self.read_ahead!r}.")
        if self.direct_io not in (None, True, False):
            raise ConfigError(f"direct_io must be True, False or None, got {self.direct_io!r}.")
        for name in ("sequential_prefill", "record_trace"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        self.budget = Budget.parse(self.memory_budget)
        self._device_budget = Budget.parse(self.device_budget)
        # An option some method declares (`OPTIONS`) must keep its default under every other method.
        for name, parameter in inspect.signature(FlashConfig.__init__).parameters.items():
            owners = [method for method in METHODS if name in METHODS[method].OPTIONS]
            if owners and self.method not in owners and getattr(self, name) != parameter.default:
                raise ConfigError(
                    f"{name} applies to method={' or '.join(map(repr, owners))} only (method is "
                    f"{self.method!r})."
                )

    def device_budget_bytes(self, dense_bytes: int) -> int:
        """Bytes of `device_budget`; a percentage is of `dense_bytes`."""
        return self._device_budget.resolve(dense_bytes)

    def _check_dip_options(self) -> None:
        gamma = self.cache_aware
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
            raise ConfigError(f"cache_aware (γ) must be a number in [0, 1], got {gamma!r}.")
        if self.threshold not in THRESHOLDS:
            raise ConfigError(f"Unknown threshold {self.threshold!r}. Available: {', '.join(THRESHOLDS)}.")
        if self.threshold != "token" and gamma != 1:
            raise ConfigError("cache_aware re-weights top-k scores: it needs threshold='token'.")
        if self.input_density is None:
            return
        rho = self.input_density
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0 < rho <= 1:
            raise ConfigError(f"input_density must be a number in (0, 1], got {rho!r}.")
        down = 3 * self.density - 2 * rho
        if not 0 < down <= 1 + 1e-9:
            raise ConfigError(
                f"density {self.density} with input_density {rho} leaves a down density of {down:.3f}; "
                f"it must be in (0, 1], so input_density must lie in "
                f"[{max(0.0, (3 * self.density - 1) / 2):.3f}, {min(1.0, 1.5 * self.density):.3f})."
            )

    def to_dict(self) -> dict[str, Any]:
        """The persisted options, stamped with the flashlm version (runtime options stay out)."""
        from ._version import __version__

        persisted = {name: getattr(self, name) for name in PERSISTED_OPTIONS}
        return {"quant_method": QUANT_METHOD, **persisted, "flashlm_version": __version__}

    def runtime_options(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in RUNTIME_OPTIONS}

    def __repr__(self) -> str:
        options = {**self.to_dict(), **self.runtime_options()}
        options.pop("quant_method")
        return f"FlashConfig({', '.join(f'{k}={v!r}' for k, v in options.items())})"
