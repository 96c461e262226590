"""What each read lever contributes to DIP-CA's decode, one lever at a time, beside dense streaming.

Every row runs in its own process (`flashlm.eval.decode`, as `flashlm bench` runs its rows) with the
same prompt and budget (default 50% of the MLP bytes): a prefill, then greedy decoding, timed per step.
The rows, cumulative:

- `dense`: dense streaming with every default (the baseline DIP-CA must beat).
- `dip-ca (4 readers, no read-ahead)`: DIP-CA at `--density` with the reader of before the disk
  profile (4 threads, the merge gap measured on the development disk) and no layer-ahead read.
- `+ disk profile`: the reader's threads and merge gap from the profile of the store's disk
  (`flashlm.store.disk.disk_profile`, measured under compute).
- `+ read-ahead`: DIP's default read-ahead: every uncached input column of the next layer where merged
  reads would cover nearly all of them anyway (small units: SmolLM2), else the layer-ahead guess (the
  columns the next layer would select for this layer's input: Qwen2.5-1.5B).
- `+ hot set S`: `hot_share=S` of the cache pinned to the units DIP needs most often, PowerInfer's hot
  set, placed from the store's unit profile of DIP at `--density` (`flashlm profile`; measured first
  when the store has none, on `--profile-tokens` of the Shakespeare calibration split:
  `flashlm.workflows.profile.load_or_profile`).
- `cache split by size`: the `+ read-ahead` row with the budget shared in proportion to each kind's
  size instead of by read cost (a lever that loses on a disk whose small reads are expensive).

Per row: decode tokens/s and its ratio to `dense`, MB read and requests per token, hit rate, and the
split of a token's time (selection / cache bookkeeping / I/O wait / compute, from `flashlm.stats`).

Below the rows, the bound the unit profile sets (with hot-set rows): the MB per token DIP needs of
each kind, and what the best static cache of this budget's capacities (each cache holding its most
needed units) would still read: what no placement of units can go below without exploiting which
units follow which.

    python benchmarks/sparsity_levers.py --model qwen2.5-1.5b --out bench-results/levers
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from flashlm import FlashConfig
from flashlm.cache.profile import UnitProfile
from flashlm.data.models import model_path
from flashlm.eval.decode import run_in_subprocess
from flashlm.methods.mlp import open_checkpoint_store
from flashlm.methods.sparse import DIPMLP
from flashlm.workflows.profile import load_or_profile


def rows(
    budget: str, density: float, gamma: float, hot_shares: list[float]
) -> list[tuple[str, dict[str, Any]]]:
    dip_ca = {"memory_budget": budget, "method": "dip", "density": density, "cache_aware": gamma}
    return [
        ("dense", {"memory_budget": budget}),
        ("dip-ca (4 readers, no read-ahead)", {**dip_ca, "io_threads": 4, "read_ahead": False}),
        ("+ disk profile", {**dip_ca, "read_ahead": False}),
        ("+ read-ahead", dip_ca),
        *((f"+ hot set {share:.0%}", {**dip_ca, "hot_share": share}) for share in hot_shares),
        ("cache split by size", {**dip_ca, "cache_split": "size"}),
    ]


def static_bound(
    path: Path, profile: UnitProfile, budget: str, density: float, dense_bytes: float
) -> list[str]:
    """Lines on what the profile allows: MB per token needed per kind, what remains to read with each
    cache holding its most needed units (the capacities DIP-CA's runtime plans for `budget`), and the
    cache a best static placement would need to read at most half of dense streaming's `dense_bytes`
    per token (2x dense streaming's speed, were both bound by the disk)."""
    config = FlashConfig(method="dip", density=density, memory_budget=budget)
    store = open_checkpoint_store(path, config)
    runtime = DIPMLP.make_runtime(store, config, DIPMLP.load_fitted(store))
    capacities = runtime.capacities
    runtime.close()
    lines = [
        "",
        f"Unit profile of DIP at density {density} ({profile.tokens} tokens of {profile.corpus}):",
        "",
    ]
    for kind in DIPMLP.KINDS:
        needed = left = 0.0
        for layer in range(store.num_layers):
            frequency = profile.frequencies[(layer, kind)].double()
            row_bytes = store.row_file(layer, kind).row_bytes
            needed += float(frequency.sum()) * row_bytes
            left += (
                float(frequency.sort(descending=True).values[capacities[(layer, kind)] :].sum()) * row_bytes
            )
        lines.append(
            f"- {kind}: {needed / 1e6:.0f} MB/token needed; {capacities[(0, kind)]} of "
            f"{store.row_file(0, kind).rows} units cached per layer; the best static cache of them leaves "
            f"{left / 1e6:.0f} MB/token to read"
        )
    # Every unit of the model, most needed bytes per cached byte first (units of one kind have one size).
    uses = torch.cat([f.double() for f in profile.frequencies.values()])
    sizes = torch.cat(
        [
            torch.full_like(f.double(), store.row_file(layer, kind).row_bytes)
            for (layer, kind), f in profile.frequencies.items()
        ]
    )
    order = torch.argsort(uses, descending=True, stable=True)
    still_read = float((uses * sizes).sum()) - torch.cumsum((uses * sizes)[order], 0)
    enough = int(torch.searchsorted(-still_read, torch.tensor(-dense_bytes / 2))) + 1  # units to cache
    cache = float(sizes[order][:enough].sum())
    held = sum(slots * store.row_file(*key).row_bytes for key, slots in capacities.items())
    lines.append(
        f"- reading at most half of dense streaming's {dense_bytes / 1e6:.0f} MB/token would take a static "
        f"cache of {cache / 1e9:.2f} GB, {cache / float(sizes.sum()):.0%} of the MLP's bytes (this budget's "
        f"caches hold {held / 1e9:.2f} GB; rows in the store's dtype)"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="bundled name or checkpoint directory")
    parser.add_argument("--memory-budget", default="50%")
    parser.add_argument("--density", type=float, default=0.6)
    parser.add_argument("--gamma", type=float, default=0.2, help="DIP-CA's γ")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument(
        "--hot-shares",
        default="0.25,0.5",
        help="hot_share of each hot-set row, comma-separated ('' for none)",
    )
    parser.add_argument("--profile-tokens", type=int, default=1024, help="tokens of a missing unit profile")
    parser.add_argument("--out", type=Path, default=Path("bench-results/levers"))
    args = parser.parse_args()

    path = Path(model_path(args.model))
    hot_shares = [float(share) for share in args.hot_shares.split(",") if share.strip()]
    profiled = FlashConfig(method="dip", density=args.density)
    profile = load_or_profile(path, profiled, num_tokens=args.profile_tokens) if hot_shares else None
    results = []
    with tempfile.TemporaryDirectory() as offload:
        for name, options in rows(args.memory_budget, args.density, args.gamma, hot_shares):
            print(f"running {name} ...", flush=True)
            spec = {"name": name, "kind": "flashlm", "options": options}
            results.append(
                run_in_subprocess(spec, path, new_tokens=args.new_tokens, offload_dir=Path(offload))
            )

    dense = results[0]["decode_tok_s"]
    lines = [
        f"## {args.model}, memory budget {args.memory_budget}, DIP-CA density {args.density}, γ {args.gamma}",
        "",
        "| configuration | decode tok/s | x dense | MB read/token | requests/token | hit rate "
        "| select / cache / I/O wait / compute ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['config']} | {r['decode_tok_s']:.2f} | {r['decode_tok_s'] / dense:.2f} "
            f"| {r['reader_bytes_per_token'] / 1e6:.0f} | {r['reads_per_token']:.0f} | {r['hit_rate']:.1%} "
            f"| {r['select_ms']:.1f} / {r['cache_ms']:.1f} / {r['io_ms']:.1f} / {r['compute_ms']:.1f} |"
        )
    if profile is not None:
        lines += static_bound(
            path, profile, args.memory_budget, args.density, results[0]["reader_bytes_per_token"]
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"levers-{path.name}"
    stem.with_suffix(".json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": results}, indent=1)
    )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
