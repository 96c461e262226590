"""Per-token latency of decoding a model larger than memory, from a hardware profile and a workload.

One cost model for DIP's hardware simulator (appendix A) and LLM in a flash's (§3, appendix C):

* Static allocation (DIP app. A, after Xue et al.): what every token needs and no method prunes
  (attention, embeddings and output head, the KV cache of the context) stays resident; the rest of
  the resident memory (DRAM, or GPU memory on a discrete GPU) is split uniformly across the MLP
  layers as their neuron cache.
* With a discrete GPU the MLP cache has two tiers (M2Cache §5: HBM cache, DRAM cache, SSD). GPU
  memory holds the static allocation and the first tier; DRAM holds the second tier, all of
  `dram_bytes` (assumed to be what the OS and other programs leave, as without a GPU), split
  uniformly across the MLP layers too. The hierarchy is non-inclusive: what the GPU tier misses is
  looked up in DRAM, what DRAM misses is read from flash and written into DRAM.
* A token's MLP demand comes either from an analytic model (dense; a fixed density of units
  chosen independently of the cache; LLM in a flash's sliding window with its measured load
  fraction) or from a `Trace` recorded by a real flashlm run, replayed through the real
  `NeuronCache` by `flashlm.sim.replay` under LRU, LFU, sliding window, M2Cache's Adjacent Token
  Update (ATU) or Belady. With a GPU the DRAM tier replays the GPU tier's misses, step by step,
  under its own policy (`dram_policy`).
* Latency per token = flash I/O + memory management + compute, summed as LLM in a flash Table 3
  reports them:
  - flash I/O: missed bytes at the profile's flash throughput: sequential for a long contiguous
    read (what a dense layer's uncached remainder is), the chunk-size-dependent scattered rate for
    individual units (one unit, or one bundle of a unit's rows across the MLP matrices). For a
    trace, each step's misses of each (layer, kind) (of a kind the run read ahead whole: every unit
    not resident) are planned as flashlm's `StoreReader` reads them (`plan_trace_reads`: 4096-aligned
    extents, runs less than the merge gap apart merged, requests one per reader thread, of
    `DEFAULT_CHUNK_BYTES` up to `SPREAD_CHUNKS` chunks, with the run's reader settings); the bytes
    are the planned ones (over-read included) and each request takes
    `size / profile.flash_bandwidth(size)`. The profile's table is measured throughput at the
    reader's concurrency (its 4 default threads for "dev-vm" and "this-machine"), so it already
    carries the per-request cost amortized over the requests in flight; no separate latency term is
    added;
  - memory management: every byte read from flash written once into DRAM; with a GPU, every MLP
    byte the GPU tier misses (served from DRAM, or read from flash: the read's bytes) sent once
    over PCIe;
  - compute: decode GEMVs are memory-bound, so every weight the token uses and the KV cache are read
    once at the resident memory's bandwidth. DIP's simulator leaves compute out ("we do not simulate
    NPU inference times", §6): pass `include_compute=False` to match it.
* Analytic demand assumes units are needed independently of what the cache holds, so a cache
  holding a fraction f of the MLP serves a fraction f of each token's units (for dense demand the
  cache is a fixed subset: the steady state of LFU; LRU would thrash on a cyclic scan). Traces carry
  real reuse. With a GPU, under "lfu" the DRAM tier is a fixed subset disjoint from the GPU's (it
  keeps what the GPU misses): with fractions f_g and f_d of the MLP, DRAM serves min(f_d, 1 - f_g)
  of each token's units and flash the rest; under "window" DRAM serves f_d of the window's loads.
  ATU needs a trace: its hits are the units consecutive tokens share.

Published figures this model does not reproduce from the papers' stated inputs (not pinned, no
constant tuned to force them; `flashlm.sim.reproductions` holds the ones it does):
* DIP Table 2, Phi3Mini dense (2.4 GB model, 1.5 GB DRAM: 1.15 tok/s). Phi-3-Mini's dimensions at
  the 4.25 bits per weight that give DIP's sizes for the other three models make 2.03 GB, not
  2.4 GB, hence 1.85 tok/s. With DIP's stated 2.4 GB the dense formula would give 1.09 tok/s.
* LLM in a flash Table 2, predictor-only row (0.9 GB at 1.25 GB/s: 738 ms): the paper states the
  predicted density only as "about 10%"; 10% of OPT-6.7B's FFN gives 0.86 GB, 680 ms (-8%), and
  its 4.8 GB of DRAM cannot hold attention, embeddings and predictors as appendix C sizes them.
* LLM in a flash Table 2 lists 6.5 GB of DRAM for the windowed rows, less than the 52.1% of 13.4 GB
  (6.98 GB) appendix C itemizes; only the latter fits the 24% window, and the tests use it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.trace import ID_DTYPE, OFFSET_DTYPE, Trace
from ..errors import ConfigError, UnsupportedArchitectureError
from ..store.reader import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MERGE_GAP_BYTES,
    DEFAULT_THREADS,
    PLAN_SETTINGS,
    check_plan_settings,
    plan_reads,
    split_chunks,
    spread_request_bytes,
)
from ..store.rowfile import ALIGNMENT
from .hardware import HardwareProfile
from .replay import REPLAY_POLICIES, replay

ANALYTIC_POLICIES = ("lfu", "window", "none", "naive")
"""Policies for analytic demand: "lfu" (a fixed cached subset), "window" (LLM in a flash's sliding
window, from its measured load fraction), "none" (no MLP cache), "naive" (nothing resident: every
weight is read from flash every token, LLM in a flash's naive baseline)."""

TRACE_POLICIES = (*REPLAY_POLICIES, "naive")
"""Policies for trace demand: those `replay` implements, plus "naive"."""

GPTQ_INT4_BYTES_PER_WEIGHT = 4.25 / 8
"""4-bit GPTQ with group size 128 and a 16-bit scale and zero per group: 4 + 32/128 bits."""

KV_BYTES_PER_ELEMENT = 2
"""The KV cache is kept in 16 bits whatever the weights' quantization."""


@dataclass(frozen=True)
class ModelDims:
    """A decoder-only transformer's sizes, enough to count its bytes.

    Attributes:
        name: a label.
        num_layers, d_model, d_ff: layers, hidden size, MLP intermediate size.
        gated: SwiGLU-style MLP (gate, up, down: 3 matrices) rather than up, down (2).
        num_heads, num_kv_heads, head_dim: attention shape (GQA when num_kv_heads < num_heads).
        vocab_size: embedding rows.
        tied_embeddings: the output head reuses the input embedding matrix.
        bytes_per_weight: storage per weight, scales included (2 for fp16, 0.53125 for GPTQ int4).
    """

    name: str
    num_layers: int
    d_model: int
    d_ff: int
    gated: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    bytes_per_weight: float

    def __post_init__(self) -> None:
        for name in ("num_layers", "d_model", "d_ff", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"Model {self.name!r}: {name} must be a positive int, got {value!r}.")
        bpw = self.bytes_per_weight
        if isinstance(bpw, bool) or not isinstance(bpw, (int, float)) or not 0 < bpw <= 8:
            raise ConfigError(f"Model {self.name!r}: bytes_per_weight must be in (0, 8], got {bpw!r}.")

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def unit_bytes(self) -> float:
        """One unit of one MLP matrix: a row (or column) of d_model weights."""
        return self.d_model * self.bytes_per_weight

    @property
    def mlp_layer_bytes(self) -> float:
        return self.mlp_matrices * self.d_ff * self.unit_bytes

    @property
    def mlp_bytes(self) -> float:
        return self.num_layers * self.mlp_layer_bytes

    @property
    def attention_bytes(self) -> float:
        """q and o projections (d_model x heads*head_dim), k and v (d_model x kv_heads*head_dim)."""
        per_layer = 2 * self.d_model * self.head_dim * (self.num_heads + self.num_kv_heads)
        return self.num_layers * per_layer * self.bytes_per_weight

    @property
    def embedding_bytes(self) -> float:
        """Input embedding plus, when untied, the output head."""
        return (1 if self.tied_embeddings else 2) * self.vocab_size * self.d_model * self.bytes_per_weight

    @property
    def weight_bytes(self) -> float:
        """The whole model (norms and biases, a rounding error, left out)."""
        return self.mlp_bytes + self.attention_bytes + self.embedding_bytes

    @property
    def per_token_static_read_bytes(self) -> float:
        """Non-MLP weights a token reads: attention and the output head (one embedding row is nothing)."""
        head = self.vocab_size * self.d_model * self.bytes_per_weight
        return self.attention_bytes + head

    def kv_bytes(self, context_length: int) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * KV_BYTES_PER_ELEMENT * context_length

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike[str], *, bytes_per_weight: float = 2.0) -> ModelDims:
        """Dimensions from a Hugging Face `config.json` (or the folder holding one).

        Whether the MLP is gated comes from flashlm's architecture table (`flashlm.arch`).
        """
        from ..arch import spec_for

        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"No Hugging Face config at {path}.")
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path} is not a readable JSON config ({exc}).") from exc
        text = config.get("text_config") or config
        try:
            gated = spec_for(str(text["model_type"])).gated
            d_model = int(text["hidden_size"])
            num_heads = int(text["num_attention_heads"])
            d_ff = int(text.get("intermediate_size") or text["ffn_dim"])
            return cls(
                name=str(text.get("_name_or_path") or path.parent.name),
                num_layers=int(text["num_hidden_layers"]),
                d_model=d_model,
                d_ff=d_ff,
                gated=gated,
                num_heads=num_heads,
                num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
                head_dim=int(text.get("head_dim") or d_model // num_heads),
                vocab_size=int(text["vocab_size"]),
                tied_embeddings=bool(text.get("tie_word_embeddings", True)),
                bytes_per_weight=bytes_per_weight,
            )
        except (KeyError, TypeError, ValueError, UnsupportedArchitectureError) as exc:
            raise ConfigError(f"{path}: cannot read the model's dimensions ({exc!r}).") from exc


MODEL_PRESETS: dict[str, ModelDims] = {
    # OPT-6.7B in fp16, LLM in a flash's main model (HF facebook/opt-6.7b config): 13.3 GB here,
    # "13.4 GB" in its Table 2 (6.7B parameters x 2 bytes).
    "opt-6.7b": ModelDims("opt-6.7b", 32, 4096, 16384, False, 32, 32, 128, 50272, True, 2.0),
    # DIP's models, GPTQ int4 (DIP Table 2 gives their sizes: 7.4, 4.3 and 3.9 GB; these give
    # 7.42, 4.27 and 3.85 GB). Configs: microsoft/Phi-3-medium-4k-instruct,
    # meta-llama/Meta-Llama-3-8B, mistralai/Mistral-7B-v0.1.
    "phi-3-medium": ModelDims(
        "phi-3-medium", 40, 5120, 17920, True, 40, 10, 128, 32064, False, GPTQ_INT4_BYTES_PER_WEIGHT
    ),
    "llama-3-8b": ModelDims(
        "llama-3-8b", 32, 4096, 14336, True, 32, 8, 128, 128256, False, GPTQ_INT4_BYTES_PER_WEIGHT
    ),
    "mistral-7b": ModelDims(
        "mistral-7b", 32, 4096, 14336, True, 32, 8, 128, 32000, False, GPTQ_INT4_BYTES_PER_WEIGHT
    ),
}
"""Named model dimensions for `flashlm simulate --model`."""


@dataclass(frozen=True)
class AnalyticDemand:
    """What each token needs of the MLPs, without a trace.

    Attributes:
        density: fraction of each layer's MLP units a token uses (1.0: dense).
        bundled: a unit's rows of all MLP matrices are stored together and read as one chunk
            (LLM in a flash §3.2), instead of one chunk per matrix.
        load_fraction: for policy "window": the measured fraction of MLP units loaded from flash
            per token (LLM in a flash appendix C: 2.4% for OPT-6.7B with k = 4).
        window_fraction: for policy "window": the fraction of the MLP the window keeps resident
            (appendix C: 24%); it must fit in the MLP cache.
    """

    density: float = 1.0
    bundled: bool = False
    load_fraction: float | None = None
    window_fraction: float | None = None

    def __post_init__(self) -> None:
        for name in ("density", "load_fraction", "window_fraction"):
            value = getattr(self, name)
            if value is None and name != "density":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ConfigError(f"AnalyticDemand.{name} must be a fraction in [0, 1], got {value!r}.")
        if (self.load_fraction is None) != (self.window_fraction is None):
            raise ConfigError("AnalyticDemand needs load_fraction and window_fraction together (or neither).")


@dataclass(frozen=True)
class Workload:
    """A model and the MLP units its tokens need: `demand` is an `AnalyticDemand` or a `Trace`.

    `extra_static_bytes` are auxiliary modules every token reads, such as activation predictors,
    which DIP appendix A allocates statically with attention and embeddings.
    """

    model: ModelDims
    demand: AnalyticDemand | Trace = field(default_factory=AnalyticDemand)
    context_length: int = 0
    extra_static_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelDims):
            raise ConfigError(f"Workload.model must be a ModelDims, got {type(self.model).__name__}.")
        if not isinstance(self.demand, (AnalyticDemand, Trace)):
            raise ConfigError(
                f"Workload.demand must be an AnalyticDemand or a Trace, got {type(self.demand).__name__}."
            )
        if (
            isinstance(self.context_length, bool)
            or not isinstance(self.context_length, int)
            or self.context_length < 0
        ):
            raise ConfigError(f"Workload.context_length must be an int >= 0, got {self.context_length!r}.")
        extra = self.extra_static_bytes
        if isinstance(extra, bool) or not isinstance(extra, (int, float)) or not 0 <= extra < math.inf:
            raise ConfigError(f"Workload.extra_static_bytes must be a number >= 0, got {extra!r}.")
        if isinstance(self.demand, Trace) and self.demand.num_layers != self.model.num_layers:
            raise ConfigError(
                f"The trace has {self.demand.num_layers} layers but model {self.model.name!r} has "
                f"{self.model.num_layers}: record the trace from that model."
            )


@dataclass(frozen=True)
class Allocation:
    """DIP appendix A's static allocation of the resident memory.

    Attributes:
        resident_bytes: the memory that holds weights (DRAM, or GPU memory on a discrete GPU).
        static_bytes: attention, embeddings, head and auxiliary modules, resident for good (0 under
            "naive").
        kv_bytes: the KV cache of the context.
        mlp_cache_bytes: what is left, the MLP layers' neuron cache (all layers together); with a
            GPU, the first tier.
        mlp_bytes: the MLP weights the cache is carved out for.
        dram_cache_bytes: with a GPU, the second-tier MLP cache in DRAM (all layers together); 0
            without a GPU, where DRAM is the resident memory.
    """

    resident_bytes: float
    static_bytes: float
    kv_bytes: float
    mlp_cache_bytes: float
    mlp_bytes: float
    dram_cache_bytes: float = 0.0

    @property
    def cache_fraction(self) -> float:
        """The fraction of each MLP layer's units the uniform split lets it cache."""
        return self._fraction(self.mlp_cache_bytes)

    @property
    def dram_cache_fraction(self) -> float:
        """The fraction of each MLP layer's units the DRAM tier caches (0 without a GPU)."""
        return self._fraction(self.dram_cache_bytes)

    def _fraction(self, cache_bytes: float) -> float:
        return min(1.0, cache_bytes / self.mlp_bytes) if self.mlp_bytes else 0.0


def allocate(profile: HardwareProfile, workload: Workload, *, policy: str = "lfu") -> Allocation:
    """Split the resident memory as DIP appendix A does: static parts first, the rest to MLP caches.

    With a GPU, GPU memory is the resident memory and DRAM the second-tier MLP cache (all of
    `dram_bytes`, up to the MLP bytes). Under "naive" nothing is resident but the KV cache; under
    "none" the static parts are; under both the MLP cache is empty, in either tier. Raises
    `ConfigError` when memory holds not even what must be resident.
    """
    model = workload.model
    resident = profile.resident_bytes
    kv = model.kv_bytes(workload.context_length)
    static = 0.0 if policy == "naive" else _static_weight_bytes(workload)
    mlp_bytes = _mlp_bytes(workload)
    if static + kv > resident:
        raise ConfigError(
            f"{profile.name}: {resident / 1e9:.2f} GB of memory cannot hold what must stay resident for "
            f"{model.name}: {static / 1e9:.2f} GB of attention, embeddings and auxiliary modules and a "
            f"{kv / 1e9:.2f} GB KV cache ({workload.context_length} tokens). Give more memory "
            f"({'--gpu-memory' if profile.has_gpu else '--dram'}), a shorter context, or policy 'naive'."
        )
    if policy in ("none", "naive"):
        return Allocation(resident, static, kv, 0.0, mlp_bytes)
    dram_cache = min(float(profile.dram_bytes), mlp_bytes) if profile.has_gpu else 0.0
    return Allocation(resident, static, kv, min(resident - static - kv, mlp_bytes), mlp_bytes, dram_cache)


def _static_weight_bytes(workload: Workload) -> float:
    """Weights outside the MLPs: attention, embeddings and head, auxiliary modules."""
    return workload.model.attention_bytes + workload.model.embedding_bytes + workload.extra_static_bytes


def _mlp_bytes(workload: Workload) -> float:
    demand = workload.demand
    if isinstance(demand, Trace):
        return workload.model.num_layers * sum(n * demand.unit_bytes[k] for k, n in demand.num_units.items())
    return workload.model.mlp_bytes


@dataclass(frozen=True)
class SimulationResult:
    """Mean per-token costs of one simulated decode.

    Attributes:
        hardware, model, policy: what was simulated.
        io_s, memory_management_s, compute_s: latency per token, by component (seconds).
        flash_bytes_per_token: bytes read from flash per token.
        hit_rate: fraction of the MLP units (analytic: bytes) a token needed that were resident.
        chunk_bytes: size of one scattered flash read (0 when all reads were sequential); for a
            trace, the mean planned request size.
        allocation: the static allocation used.
        flash_requests_per_token: scattered flash requests per token (a trace: the reader's
            planned requests; analytic demand: one per missed unit or bundle); long sequential
            reads are not counted.
        dram_hit_rate: with a GPU, the fraction of the units (analytic: bytes) the GPU tier missed
            that the DRAM tier served; 0 without a GPU.
        pcie_bytes_per_token: with a GPU, bytes sent over PCIe per token (served from DRAM, or
            read from flash); their time is part of `memory_management_s`. 0 without a GPU.
    """

    hardware: str
    model: str
    policy: str
    io_s: float
    memory_management_s: float
    compute_s: float
    flash_bytes_per_token: float
    hit_rate: float
    chunk_bytes: float
    allocation: Allocation
    flash_requests_per_token: float = 0.0
    dram_hit_rate: float = 0.0
    pcie_bytes_per_token: float = 0.0

    @property
    def latency_s(self) -> float:
        return self.io_s + self.memory_management_s + self.compute_s

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.latency_s if self.latency_s > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (latencies in seconds, sizes in bytes)."""
        out = asdict(self)
        out["latency_s"] = self.latency_s
        out["tokens_per_s"] = self.tokens_per_s
        return out


def simulate(
    profile: HardwareProfile,
    workload: Workload,
    *,
    policy: str = "lfu",
    window: int = 5,
    warmup: int = 0,
    include_compute: bool = True,
    capacities: Mapping[tuple[int, str] | str, int] | None = None,
    dram_policy: str = "lru",
) -> SimulationResult:
    """Mean latency per token of `workload` on `profile` under `policy`.

    Args:
        profile: the hardware.
        workload: the model and its MLP demand (analytic or a trace).
        policy: `ANALYTIC_POLICIES` for analytic demand, `TRACE_POLICIES` for a trace; with a GPU,
            the GPU tier's policy.
        window: the sliding window in tokens, for policy "window" on a trace (either tier).
        warmup: for a trace, leading steps left out of the means (the caches filling up).
        include_compute: add the memory-bound compute term (DIP's simulator leaves it out).
        capacities: for a trace, the slots of every (layer, kind) cache, keyed `(layer, kind)` or
            `"layer/kind"` (a decode result's `capacities`), instead of the uniform split: the
            replay then reproduces that run's hits and misses. With a GPU they are the GPU tier's.
            Not for analytic demand.
        dram_policy: with a GPU and a trace, the DRAM tier's policy (one of `REPLAY_POLICIES`).
            Analytic demand models the DRAM tier as a fixed subset; without a GPU DRAM is the only
            tier and `policy` governs it.

    Raises `ConfigError` for an unknown policy, a policy that needs a trace on analytic demand, a
    window demand without its figures, memory too small for the static allocation, or a warmup
    that leaves no step.
    """
    if dram_policy not in REPLAY_POLICIES:
        raise ConfigError(
            f"Unknown DRAM-tier policy {dram_policy!r}. Available: {', '.join(REPLAY_POLICIES)}."
        )
    if isinstance(workload.demand, Trace):
        if policy not in TRACE_POLICIES:
            raise ConfigError(
                f"Unknown policy {policy!r} for a trace. Available: {', '.join(TRACE_POLICIES)}."
            )
        return _simulate_trace(
            profile,
            workload,
            workload.demand,
            policy,
            window,
            warmup,
            include_compute,
            capacities,
            dram_policy,
        )
    if capacities is not None:
        raise ConfigError("capacities apply to a trace workload only.")
    if policy not in ANALYTIC_POLICIES:
        if policy not in TRACE_POLICIES:
            raise ConfigError(
                f"Unknown policy {policy!r}. Analytic demand takes {', '.join(ANALYTIC_POLICIES)}; a "
                f"trace takes {', '.join(TRACE_POLICIES)}."
            )
        why = (
            " ATU's hits are the units consecutive tokens share, which only a trace records."
            if policy == "atu"
            else ""
        )
        raise ConfigError(
            f"Policy {policy!r} needs a recorded trace (--trace).{why} Analytic demand takes "
            f"{', '.join(ANALYTIC_POLICIES)}."
        )
    return _simulate_analytic(profile, workload, workload.demand, policy, include_compute)


def _chunk_bytes(model: ModelDims, bundled: bool) -> float:
    return model.unit_bytes * (model.mlp_matrices if bundled else 1)


def _finish(
    profile: HardwareProfile,
    workload: Workload,
    policy: str,
    allocation: Allocation,
    *,
    io_s: float,
    flash_bytes: float,
    mlp_read_bytes: float,
    hit_rate: float,
    chunk_bytes: float,
    include_compute: bool,
    flash_requests: float,
    dram_served_bytes: float,
    dram_hit_rate: float,
) -> SimulationResult:
    """Add memory management and compute to the I/O and package the result.

    `dram_served_bytes` are the MLP bytes per token the DRAM tier served (0 without a GPU).
    """
    mm_s = flash_bytes / profile.dram_bandwidth
    pcie_bytes = 0.0
    if profile.pcie_bandwidth is not None:
        pcie_bytes = dram_served_bytes + flash_bytes
        mm_s += pcie_bytes / profile.pcie_bandwidth
    compute_s = 0.0
    if include_compute:
        static = workload.model.per_token_static_read_bytes + workload.extra_static_bytes
        read = static + allocation.kv_bytes + mlp_read_bytes
        compute_s = read / profile.compute_bandwidth
    return SimulationResult(
        hardware=profile.name,
        model=workload.model.name,
        policy=policy,
        io_s=io_s,
        memory_management_s=mm_s,
        compute_s=compute_s,
        flash_bytes_per_token=flash_bytes,
        hit_rate=hit_rate,
        chunk_bytes=chunk_bytes,
        allocation=allocation,
        flash_requests_per_token=flash_requests,
        dram_hit_rate=dram_hit_rate,
        pcie_bytes_per_token=pcie_bytes,
    )


def _simulate_analytic(
    profile: HardwareProfile,
    workload: Workload,
    demand: AnalyticDemand,
    policy: str,
    include_compute: bool,
) -> SimulationResult:
    model = workload.model
    allocation = allocate(profile, workload, policy=policy)
    needed = demand.density * model.mlp_bytes
    chunk = _chunk_bytes(model, demand.bundled)
    sequential_bytes = 0.0
    dram_served = 0.0  # with a GPU: the DRAM tier's share of what the GPU tier misses
    if policy == "naive":
        # LLM in a flash's naive baseline: the whole model, one long read per token.
        sequential_bytes = model.weight_bytes + workload.extra_static_bytes
        scattered_bytes = 0.0
        hits = 0.0
    elif policy == "window":
        if demand.load_fraction is None or demand.window_fraction is None:
            raise ConfigError(
                "Policy 'window' on analytic demand needs AnalyticDemand.load_fraction and "
                "window_fraction (the measured sliding-window figures), or a trace."
            )
        window_bytes = demand.window_fraction * model.mlp_bytes
        if window_bytes > allocation.mlp_cache_bytes:
            raise ConfigError(
                f"The sliding window keeps {window_bytes / 1e9:.2f} GB of MLP rows resident but only "
                f"{allocation.mlp_cache_bytes / 1e9:.2f} GB is left for MLP caches."
            )
        loaded = demand.load_fraction * model.mlp_bytes
        hits = max(0.0, needed - loaded)
        dram_served = allocation.dram_cache_fraction * loaded
        scattered_bytes = loaded - dram_served
    else:
        # Fixed cached subsets; the DRAM tier's is disjoint from the GPU's (it keeps what the GPU misses).
        uncached = 1.0 - allocation.cache_fraction
        from_dram = min(allocation.dram_cache_fraction, uncached)
        hits = allocation.cache_fraction * needed
        dram_served = from_dram * needed
        missed = (uncached - from_dram) * needed
        if demand.density == 1.0:
            # Dense: each layer's uncached remainder is one contiguous region.
            sequential_bytes, scattered_bytes = missed, 0.0
        else:
            scattered_bytes = missed
    io_s = sequential_bytes / profile.flash_bandwidth(1, sequential=True)
    if scattered_bytes:
        io_s += scattered_bytes / profile.flash_bandwidth(chunk)
    gpu_missed = dram_served + sequential_bytes + scattered_bytes
    return _finish(
        profile,
        workload,
        policy,
        allocation,
        io_s=io_s,
        flash_bytes=sequential_bytes + scattered_bytes,
        mlp_read_bytes=needed,
        hit_rate=hits / needed if needed else 0.0,
        chunk_bytes=chunk if scattered_bytes else 0.0,
        include_compute=include_compute,
        flash_requests=scattered_bytes / chunk,
        dram_served_bytes=dram_served,
        dram_hit_rate=dram_served / gpu_missed if gpu_missed else 0.0,
    )


def plan_trace_reads(
    missed_ids: list[np.ndarray] | np.ndarray,
    row_bytes: int,
    num_units: int,
    *,
    merge_gap_bytes: int = DEFAULT_MERGE_GAP_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threads: int = DEFAULT_THREADS,
) -> np.ndarray:
    """The request sizes (bytes) flashlm's `StoreReader` issues to read `missed_ids` of one file in place.

    Follows the reader's plan (O_DIRECT mode): `plan_reads` widens each row to `ALIGNMENT`
    (4096-byte) extents and merges runs at most `merge_gap_bytes` apart, then `split_chunks` cuts
    each run into requests of `spread_request_bytes` (one per reader thread, `threads`, where that
    makes them larger than `chunk_bytes`, up to `SPREAD_CHUNKS` chunks). `missed_ids` are sorted
    unique ids, one call (an array) or several (a list: their requests concatenated). Store files
    start their rows at a multiple of `ALIGNMENT`, so offset 0 gives the same extents. The defaults are
    the reader's own; a trace records those of the run (`reader` in its metadata).
    """
    calls = [missed_ids] if isinstance(missed_ids, np.ndarray) else missed_ids
    sizes = []
    for ids in calls:
        if len(ids) == 0:
            continue
        plan = plan_reads(
            np.asarray(ids, dtype=np.int64),
            int(row_bytes),
            0,
            alignment=ALIGNMENT,
            merge_gap_bytes=merge_gap_bytes,
            max_run_bytes=num_units * int(row_bytes) + 2 * ALIGNMENT,
        )
        request = spread_request_bytes(len(ids) * int(row_bytes), threads, chunk_bytes)
        _, _, length = split_chunks(plan.run_starts, plan.run_ends, request)
        sizes.append(length)
    return np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)


def _reader_settings(trace: Trace) -> dict[str, int]:
    """The reader settings a trace's run read with (`StoreReader.plan_settings`; none in a trace from
    before they were recorded, whose misses are then planned with the reader's defaults)."""
    settings = trace.metadata.get("reader", {})
    try:
        if not isinstance(settings, dict) or any(
            key not in PLAN_SETTINGS or isinstance(value, bool) or not isinstance(value, int)
            for key, value in settings.items()
        ):
            raise ConfigError(f"they are not {{name: int}} for names in {PLAN_SETTINGS}")
        defaults = {
            "threads": DEFAULT_THREADS,
            "chunk_bytes": DEFAULT_CHUNK_BYTES,
            "merge_gap_bytes": DEFAULT_MERGE_GAP_BYTES,
        }
        check_plan_settings(**{**defaults, **settings})
    except ConfigError as exc:
        raise ConfigError(
            f"The trace's reader settings {settings!r} cannot plan reads ({exc}): record the trace again "
            "with this flashlm."
        ) from exc
    return settings


def _request_seconds(profile: HardwareProfile, sizes: np.ndarray) -> float:
    """Time of scattered requests of these sizes: each at the profile's throughput for its size."""
    unique, counts = np.unique(sizes, return_counts=True)
    return float(
        sum(
            count * size / profile.flash_bandwidth(float(size))
            for size, count in zip(unique, counts, strict=True)
        )
    )


def _normalize_capacities(capacities: Mapping[tuple[int, str] | str, int]) -> dict[tuple[int, str], int]:
    """`{(layer, kind): slots}` from keys given as tuples or as "layer/kind" strings (a decode result's)."""
    out: dict[tuple[int, str], int] = {}
    for key, slots in capacities.items():
        if isinstance(key, str):
            layer, sep, kind = key.partition("/")
            if not sep or not layer.isdigit():
                raise ConfigError(f"Capacity key {key!r} is not 'layer/kind'.")
            key = (int(layer), kind)
        out[key] = slots
    return out


def _miss_trace(trace: Trace, missed_ids: Mapping[tuple[int, str], list[np.ndarray]]) -> Trace:
    """The units each (layer, kind) of `trace` missed at each step, as a trace: what the next tier sees."""
    data = {}
    for key, steps in missed_ids.items():
        offsets = np.zeros(len(steps) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(ids) for ids in steps])
        ids = np.concatenate([np.zeros(0, dtype=np.int64), *steps])
        data[key] = (torch.from_numpy(ids).to(ID_DTYPE), torch.from_numpy(offsets).to(OFFSET_DTYPE))
    return Trace(
        num_layers=trace.num_layers,
        num_units=trace.num_units,
        unit_bytes=trace.unit_bytes,
        data=data,
        num_steps=trace.num_steps,
        metadata=trace.metadata,
    )


def _simulate_trace(
    profile: HardwareProfile,
    workload: Workload,
    trace: Trace,
    policy: str,
    window: int,
    warmup: int,
    include_compute: bool,
    capacities: Mapping[tuple[int, str] | str, int] | None,
    dram_policy: str,
) -> SimulationResult:
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < trace.num_steps:
        raise ConfigError(
            f"warmup must be an int in 0..{trace.num_steps - 1} (the trace has {trace.num_steps} steps), "
            f"got {warmup!r}."
        )
    allocation = allocate(profile, workload, policy=policy)
    replay_policy = "none" if policy == "naive" else policy
    if capacities is None:
        # The uniform split gives every (layer, kind) the same fraction of its units (DIP app. A).
        capacity: float | dict[tuple[int, str], int] = allocation.cache_fraction
    else:
        capacity = _normalize_capacities(capacities)
    # A kind the run read ahead whole pins a block of units and reads every unit not resident (the
    # trace's metadata names them; with a GPU tier, whose misses go to DRAM first, none).
    replayed = replay(
        trace,
        capacity=capacity,
        policy=replay_policy,
        window=window,
        record_misses=True,
        read_ahead=() if allocation.dram_cache_bytes else None,
    )
    if capacities is not None and replay_policy != "none":
        cache_bytes = sum(slots * trace.unit_bytes[kind] for (_, kind), slots in replayed.capacities.items())
        allocation = replace(allocation, mlp_cache_bytes=float(cache_bytes))
    steps = slice(warmup, None)
    num_steps = trace.num_steps - warmup
    hits, misses = int(replayed.hits[steps].sum()), int(replayed.misses[steps].sum())
    assert replayed.missed_ids is not None
    flash_reads = {key: replayed.uncached_ids.get(key, missed) for key, missed in replayed.missed_ids.items()}
    dram_served, dram_hit_rate = 0.0, 0.0
    if allocation.dram_cache_bytes:
        # The DRAM tier sees the GPU tier's misses, step by step; flash serves what it misses.
        dram = replay(
            _miss_trace(trace, replayed.missed_ids),
            capacity=allocation.dram_cache_fraction,
            policy=dram_policy,
            window=window,
            record_misses=True,
        )
        assert dram.missed_ids is not None
        flash_reads = dram.missed_ids
        dram_served = float((replayed.bytes_read[steps] - dram.bytes_read[steps]).sum()) / num_steps
        dram_hit_rate = int(dram.hits[steps].sum()) / misses if misses else 0.0
    # Each (layer, kind)'s misses of a step (a kind read ahead whole: its uncached units) are one reader
    # call: the reader's plan (aligned extents, merged runs, chunked requests), with the run's reader
    # settings where the trace has them, gives the bytes read, over-read included, and the requests;
    # each request takes its size over the profile's throughput at that size.
    reader = _reader_settings(trace)
    sizes = np.concatenate(
        [np.zeros(0, dtype=np.int64)]
        + [
            plan_trace_reads(read[steps], trace.unit_bytes[kind], trace.num_units[kind], **reader)
            for (_, kind), read in flash_reads.items()
        ]
    )
    flash_bytes = float(sizes.sum()) / num_steps
    requests = len(sizes) / num_steps
    io_s = _request_seconds(profile, sizes) / num_steps
    chunk = float(sizes.mean()) if len(sizes) else 0.0
    if policy == "naive":
        static = _static_weight_bytes(workload)
        io_s += static / profile.flash_bandwidth(1, sequential=True)
        flash_bytes += static
    requested = (
        sum(
            float(ids.numel()) * trace.unit_bytes[kind]
            for layer, kind in trace.layer_kinds()
            for ids in trace.requests(layer, kind)[steps]
        )
        / num_steps
    )
    return _finish(
        profile,
        workload,
        policy,
        allocation,
        io_s=io_s,
        flash_bytes=flash_bytes,
        mlp_read_bytes=requested,
        hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        chunk_bytes=chunk,
        include_compute=include_compute,
        flash_requests=requests,
        dram_served_bytes=dram_served,
        dram_hit_rate=dram_hit_rate,
    )
