"""What DIP's input pruning can save on this disk: the read plan of SmolLM2's up/gate input columns.

The issue's speed target asks DIP-CA to decode twice as fast as dense streaming with half the MLP
bytes cached. That needs DIP to read far fewer bytes than the uncached half. This script measures,
without timing anything, how many bytes flashlm's reader would read for DIP's first stage, from
the real MLP inputs of SmolLM2 on the shakespeare test split:

- the input columns each token needs (top-k of |x|, k = ρ_in of 576) that are not cached, the
  cache holding the `--cached` share of the layer's columns, the hottest by mean |x| on the
  calibration split (what LFU converges to);
- planned as the reader plans them (`plan_reads`: 4 KiB alignment, runs closer than the merge gap
  read as one, because on this disk a request costs as much as ~40 KiB of transfer);
- in the store's order, and with the columns permuted hottest first (a layout that would put the
  unneeded columns together, if the selection were stable enough);
- against reading every uncached column (what read-ahead does) and against the needed bytes alone
  (a disk with free requests).

The modelled I/O time is requests x the measured request cost + bytes / the measured bandwidth
(the reader's constants), per token over the 30 layers.

    python benchmarks/dip_read_floor.py [--tokens 256] [--cached 0.11,0.3]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from flashlm.store.reader import (
    DEFAULT_MERGE_GAP_BYTES,
    MEASURED_BANDWIDTH,
    MEASURED_REQUEST_COST_S,
    plan_reads,
)
from flashlm.store.rowfile import ALIGNMENT

DENSITIES = (0.5, 0.6, 0.7, 0.8, 0.9)


def mlp_inputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """`[tokens, d_model]` input of every MLP, in layer order."""
    from flashlm.arch import find_mlps, model_type_of, spec_for

    mlps = [module for _, _, module in find_mlps(model, spec_for(model_type_of(model.config)))]
    inputs: list[torch.Tensor | None] = [None] * len(mlps)
    hooks = [
        mlp.register_forward_pre_hook(lambda _, args, i=i: inputs.__setitem__(i, args[0][0].float()))
        for i, mlp in enumerate(mlps)
    ]
    with torch.no_grad():
        model(ids[None])
    for hook in hooks:
        hook.remove()
    return inputs


def plan(ids: np.ndarray, row_bytes: int) -> tuple[int, int]:
    """(bytes, requests) the reader would issue for sorted unit ids."""
    if ids.size == 0:
        return 0, 0
    p = plan_reads(
        ids,
        row_bytes,
        0,
        alignment=ALIGNMENT,
        merge_gap_bytes=DEFAULT_MERGE_GAP_BYTES,
        max_run_bytes=1 << 40,
    )
    return p.nbytes, len(p.run_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=256, help="test tokens to replay")
    parser.add_argument("--cached", default="0.11,0.3", help="cached shares of each layer's input columns")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashlm.data.corpora import corpus_tokens
    from flashlm.data.models import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    hot = mlp_inputs(model, corpus_tokens("shakespeare", tokenizer, split="calibration")[:512])
    test = mlp_inputs(model, corpus_tokens("shakespeare", tokenizer, split="test")[: args.tokens])
    d_model, d_ff = model.config.hidden_size, model.config.intermediate_size
    row_bytes = 2 * d_ff * 2  # a bf16 up column | gate column
    layers = len(test)

    def seconds(nbytes: float, requests: float) -> float:
        return requests * MEASURED_REQUEST_COST_S + nbytes / MEASURED_BANDWIDTH

    print(
        f"SmolLM2 up/gate input columns: {row_bytes} bytes each, {d_model} per layer, {layers} layers; "
        f"merge gap {DEFAULT_MERGE_GAP_BYTES} bytes ({DEFAULT_MERGE_GAP_BYTES // row_bytes} columns). "
        "MB and ms per token, summed over the layers."
    )
    print(
        "| ρ_in | cached | needed uncached MB | read, store order MB (requests) "
        "| read, hottest-first MB (requests) | read-ahead of all uncached, store order MB (requests) "
        "| modelled I/O ms: store order / hottest first / read-ahead |"
    )
    print("|---|---|---|---|---|---|---|")
    for cached_share in (float(c) for c in args.cached.split(",")):
        cached_count = int(cached_share * d_model)
        for rho in DENSITIES:
            k = int(rho * d_model)
            totals = np.zeros(7)
            for layer in range(layers):
                order = hot[layer].abs().mean(0).argsort(descending=True)
                rank = torch.empty_like(order)
                rank[order] = torch.arange(d_model)
                cached = torch.zeros(d_model, dtype=torch.bool)
                cached[order[:cached_count]] = True
                uncached = plan(torch.nonzero(~cached).squeeze(1).numpy(), row_bytes)
                for needed in test[layer].abs().topk(k, dim=1).indices:
                    miss = needed[~cached[needed]]
                    store_order = plan(miss.sort().values.numpy(), row_bytes)
                    hottest_first = plan(rank[miss].sort().values.numpy(), row_bytes)
                    totals += (miss.numel() * row_bytes, *store_order, *hottest_first, *uncached)
            per_token = totals / len(test[0])
            times = [seconds(per_token[i], per_token[i + 1]) * 1e3 for i in (1, 3, 5)]
            print(
                f"| {rho:.1f} | {cached_share:.0%} | {per_token[0] / 1e6:.1f} | "
                f"{per_token[1] / 1e6:.1f} ({per_token[2]:.0f}) | "
                f"{per_token[3] / 1e6:.1f} ({per_token[4]:.0f}) | "
                f"{per_token[5] / 1e6:.1f} ({per_token[6]:.0f}) | "
                + " / ".join(f"{t:.0f}" for t in times)
                + " |"
            )


if __name__ == "__main__":
    main()
