"""What a product over freshly read rows costs, against the same rows once they are plain memory.

Dense streaming at a partial budget computes half of each projection on rows the reader has just put
in its staging matrix (O_DIRECT: the disk, or in a VM the host, wrote them). This times one token's
`F.linear` over the upper half of each layer's `up` rows in three states, each in DRAM and not in the
CPU's caches:

- `read in place`: straight after the runtime's reader filled them;
- `read, then flushed`: the same read, then every line evicted (clflush) before the product;
- `copy, flushed`: a copy of those rows in torch's own memory, evicted the same way;
- `copy, flushed, beside a read`: the same product while the reader streams the next layer's `down`
  rows into their staging matrix, as every product of a decode step at a partial budget runs beside
  the next layer's read;
- `read in place, beside a read`: straight after the read, beside the next one.

    python benchmarks/staged_rows.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import flashlm
from flashlm.data.models import model_path
from flashlm.methods.mlp import streaming_mlps
from flashlm.ops.columns import _flush


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = flashlm.FlashConfig(memory_budget="50%", read_ahead=False)
    model = AutoModelForCausalLM.from_pretrained(model_path(args.model), quantization_config=config)
    runtime = streaming_mlps(model)[0].runtime
    rows = runtime.store.row_file(0, "up").rows
    ids = torch.arange(rows // 2, rows)
    x = torch.randn(1, runtime.d_model, dtype=runtime.store.dtype)
    down_rows = torch.arange(runtime.store.row_file(0, "down").rows)
    states = (
        "read in place",
        "read, then flushed",
        "copy, flushed",
        "copy, flushed, beside a read",
        "read in place, beside a read",
    )
    seconds: dict[str, list[float]] = {state: [] for state in states}

    def timed(matrix: torch.Tensor) -> float:
        started = time.perf_counter()
        F.linear(x, matrix)
        return time.perf_counter() - started

    def timed_beside_read(matrix: torch.Tensor, layer: int) -> float:
        following = (layer + 1) % runtime.num_layers
        pending = runtime.reader.submit_in_place((following, "down"), down_rows, runtime.staging["down"][0])
        if pending is None:
            raise SystemExit("A read beside the product needs the reader's C pool: build flashlm's C reader.")
        elapsed = timed(matrix)
        pending.result()
        return elapsed

    with torch.inference_mode():
        for _ in range(args.repeats):
            for layer in range(runtime.num_layers):
                seconds["read in place"].append(timed(runtime.read(layer, "up", ids).matrix[ids[0] :]))
                matrix = runtime.read(layer, "up", ids).matrix[ids[0] :]
                _flush(matrix)
                seconds["read, then flushed"].append(timed(matrix))
                copy = matrix.clone()
                _flush(copy)
                seconds["copy, flushed"].append(timed(copy))
                _flush(copy)
                seconds["copy, flushed, beside a read"].append(timed_beside_read(copy, layer))
                matrix = runtime.read(layer, "up", ids).matrix[ids[0] :]
                seconds["read in place, beside a read"].append(timed_beside_read(matrix, layer))
    flashlm.unpatch(model)

    products = args.repeats * runtime.num_layers
    medians = {state: statistics.median(times) for state, times in seconds.items()}
    base = medians["copy, flushed"]
    print(f"{args.model}: one token's product over {len(ids)} up rows of each layer, {products} products")
    print("| rows | median us per product | x copy |")
    print("|---|---|---|")
    for state, median in medians.items():
        print(f"| {state} | {1e6 * median:.1f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
