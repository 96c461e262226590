"""`flashlm simulate`: latency per token of a model on a hardware profile, from the cost model.

Self-contained so that `flashlm.cli.build_parser` only has to call `add_simulate_parser(sub)`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .._utils import format_bytes, parse_bytes
from ..engine.trace import Trace
from ..errors import ConfigError
from ..sim.hardware import PRESETS, THIS_MACHINE, HardwareProfile, get_preset
from ..sim.replay import REPLAY_POLICIES
from ..sim.simulator import (
    ANALYTIC_POLICIES,
    MODEL_PRESETS,
    TRACE_POLICIES,
    AnalyticDemand,
    ModelDims,
    Workload,
    simulate,
)


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `simulate` subcommand (its handler is `cmd_simulate`, set as `func`)."""
    parser = subparsers.add_parser(
        "simulate",
        help="simulate latency per token on a hardware profile (DIP app. A, LLM in a flash cost model)",
        description=(
            "Latency per token (flash I/O + memory management + compute), hit rate and tokens/s of a "
            "model on a hardware profile, with attention, embeddings and KV cache resident and the rest "
            "of memory split across MLP layers as their neuron cache. With a GPU, GPU memory holds the "
            "resident parts and the first cache tier, and DRAM a second tier fed by the GPU's misses."
        ),
    )
    parser.add_argument(
        "--hardware",
        default="a18",
        help=f"hardware preset ({', '.join(PRESETS)}; default a18), {THIS_MACHINE} (measured here on first "
        "use, then remembered) or a profile .json (save_profile)",
    )
    parser.add_argument(
        "--reproduce",
        action="store_true",
        help="print every published figure the simulator reproduces beside its simulated value",
    )
    parser.add_argument(
        "--model",
        help=f"model: a preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face config.json or its folder",
    )
    parser.add_argument(
        "--bits", type=float, default=16.0, help="bits per weight for a config.json model (default 16)"
    )
    parser.add_argument(
        "--trace", default=None, help="a trace saved by a flashlm run (replayed through the cache)"
    )
    parser.add_argument(
        "--policy",
        default="lfu",
        help=f"analytic: {', '.join(ANALYTIC_POLICIES)}; trace: {', '.join(TRACE_POLICIES)} (default lfu; "
        "with a GPU, the GPU tier's)",
    )
    parser.add_argument(
        "--dram-policy",
        default="lru",
        help=f"trace with a GPU: the DRAM tier's policy, one of {', '.join(REPLAY_POLICIES)} (default lru)",
    )
    parser.add_argument(
        "--density", type=float, default=1.0, help="analytic: MLP units used per token (default 1)"
    )
    parser.add_argument(
        "--bundled", action="store_true", help="analytic: a unit's rows are read as one chunk"
    )
    parser.add_argument(
        "--load-fraction", type=float, default=None, help="analytic window: MLP fraction loaded per token"
    )
    parser.add_argument(
        "--window-fraction", type=float, default=None, help="analytic window: MLP fraction kept resident"
    )
    parser.add_argument("--window", type=int, default=5, help="trace window policy: window in tokens")
    parser.add_argument("--warmup", type=int, default=0, help="trace: leading steps left out of the means")
    parser.add_argument("--context", type=int, default=0, help="context length held in the KV cache")
    parser.add_argument(
        "--dram",
        default=None,
        help="override DRAM, e.g. 4GB (holds the weights; with a GPU, the second-tier MLP cache)",
    )
    parser.add_argument(
        "--gpu-memory", default=None, help="override GPU memory, e.g. 8GB (profiles with a GPU only)"
    )
    parser.add_argument(
        "--flash-bandwidth", default=None, help="override flash with one flat speed per second, e.g. 1GB"
    )
    parser.add_argument("--no-compute", action="store_true", help="leave compute out (as DIP's simulator)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--sweep-dram",
        default=None,
        help="comma-separated DRAM sizes (e.g. 2GB,4GB,6GB): simulate each, print a table, plot with "
        "--plot; with a GPU, sizes of the DRAM tier (GPU memory stays)",
    )
    parser.add_argument(
        "--policies",
        default=None,
        help="with --sweep-dram: comma-separated policies to compare (default --policy)",
    )
    parser.add_argument(
        "--plot", default=None, help="with --sweep-dram: PNG path for latency and hit rate vs DRAM"
    )
    parser.set_defaults(func=cmd_simulate)
    return parser


def _model(spec: str, bits: float) -> ModelDims:
    if spec in MODEL_PRESETS:
        return MODEL_PRESETS[spec]
    if Path(spec).exists():
        return ModelDims.from_hf_config(spec, bytes_per_weight=bits / 8)
    raise ConfigError(
        f"--model {spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a config.json path."
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run one simulation and print a table (or JSON with --json); or, with --reproduce, the table of
    published figures."""
    if args.reproduce:
        from ..sim.reproductions import markdown

        print(markdown())
        return 0
    if args.model is None:
        raise ConfigError("flashlm simulate needs --model (a preset or a config.json), or --reproduce.")
    profile = get_preset(args.hardware).with_overrides(
        dram_bytes=_size("--dram", args.dram),
        flash_bandwidth=_size("--flash-bandwidth", args.flash_bandwidth),
        gpu_bytes=_size("--gpu-memory", args.gpu_memory),
    )
    model = _model(args.model, args.bits)
    if args.trace is not None:
        demand: AnalyticDemand | Trace = Trace.load(args.trace)
    else:
        demand = AnalyticDemand(
            density=args.density,
            bundled=args.bundled,
            load_fraction=args.load_fraction,
            window_fraction=args.window_fraction,
        )
    workload = Workload(model, demand, context_length=args.context)
    if args.sweep_dram is not None:
        return _sweep(args, profile, workload)
    if args.plot is not None or args.policies is not None:
        raise ConfigError("--plot and --policies go with --sweep-dram.")
    result = simulate(
        profile,
        workload,
        policy=args.policy,
        window=args.window,
        warmup=args.warmup,
        include_compute=not args.no_compute,
        dram_policy=args.dram_policy,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    alloc = result.allocation
    gpu = profile.has_gpu
    policy = result.policy + (" (trace)" if args.trace else " (analytic)")
    if gpu and args.trace:
        policy += f", DRAM tier {args.dram_policy}"
    rows = [
        ("hardware", result.hardware),
        ("model", f"{result.model} ({format_bytes(model.weight_bytes)})"),
        ("policy", policy),
        ("GPU memory" if gpu else "resident memory", format_bytes(alloc.resident_bytes)),
        ("  static (attn, emb, aux)", format_bytes(alloc.static_bytes)),
        ("  KV cache", format_bytes(alloc.kv_bytes)),
        ("  MLP cache", f"{format_bytes(alloc.mlp_cache_bytes)} of {format_bytes(alloc.mlp_bytes)}"),
    ]
    if gpu:
        rows.append(
            ("DRAM MLP cache", f"{format_bytes(alloc.dram_cache_bytes)} of {format_bytes(alloc.mlp_bytes)}")
        )
    rows += [
        (
            "flash per token",
            f"{format_bytes(result.flash_bytes_per_token)} in {result.flash_requests_per_token:.0f} requests",
        ),
        ("GPU hit rate" if gpu else "hit rate", f"{result.hit_rate:.1%}"),
    ]
    if gpu:
        rows += [
            ("DRAM hit rate (of GPU misses)", f"{result.dram_hit_rate:.1%}"),
            ("PCIe per token", format_bytes(result.pcie_bytes_per_token)),
        ]
    rows += [
        ("flash I/O", f"{result.io_s * 1e3:.1f} ms"),
        ("memory management", f"{result.memory_management_s * 1e3:.1f} ms"),
        ("compute", f"{result.compute_s * 1e3:.1f} ms"),
        ("latency per token", f"{result.latency_s * 1e3:.1f} ms"),
        ("tokens/s", f"{result.tokens_per_s:.3f}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _size(option: str, value: str | None) -> float | None:
    """The byte size given to `option`, None when it was not given; `ConfigError` naming the option."""
    if value is None:
        return None
    try:
        return float(parse_bytes(value))
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None


def _sweep(args: argparse.Namespace, profile: HardwareProfile, workload: Workload) -> int:
    """`--sweep-dram`: every size x policy, a table of latency / I/O / hit rate, and the plot."""
    from ..sim.plots import plot_memory_sweep, sweep_memory

    sizes = [float(parse_bytes(size.strip())) for size in args.sweep_dram.split(",") if size.strip()]
    policies = [p.strip() for p in (args.policies or args.policy).split(",") if p.strip()]
    sweep = sweep_memory(
        profile,
        workload,
        sizes,
        policies,
        window=args.window,
        warmup=args.warmup,
        include_compute=not args.no_compute,
        dram_policy=args.dram_policy,
    )
    if args.json:
        print(
            json.dumps(
                {policy: [r.to_dict() for r in results] for policy, results in sweep.items()}, indent=2
            )
        )
    else:
        gpu = profile.has_gpu
        print(
            "| policy | DRAM | latency ms | flash I/O ms | flash per token | "
            + ("GPU hit rate | DRAM hit rate |" if gpu else "hit rate |")
            + " tokens/s |"
        )
        print("|---" * (8 if gpu else 7) + "|")
        for policy, results in sweep.items():
            for size, r in zip(sizes, results, strict=True):
                hit_rates = f"{r.hit_rate:.1%} |" + (f" {r.dram_hit_rate:.1%} |" if gpu else "")
                print(
                    f"| {policy} | {format_bytes(size)} | {1e3 * r.latency_s:.1f} | {1e3 * r.io_s:.1f} "
                    f"| {format_bytes(r.flash_bytes_per_token)} | {hit_rates} {r.tokens_per_s:.3f} |"
                )
    if args.plot is not None:
        print(f"wrote {plot_memory_sweep(sweep, sizes, args.plot)}")
    return 0
