"""What a product over freshly read rows costs, against the same rows once they are plain memory.

Dense streaming at a partial budget computes half of each projection on rows the reader has just put
in its staging matrix (O_DIRECT: the disk, or in a VM the host, wrote them). This times one token's
`F.linear` over the upper half of each layer's `up` rows in three states, each in DRAM and not in the
CPU's caches:

- `read in place`: straight after the runtime's reader filled them;
- `read, then flushed`: the same read, then every line evicted (clflush) before the product;
- `copy, flushed`: a copy of those rows in torch's own memory, evicted the same way.

    python benchmarks/staged_rows.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
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
    seconds = {"read in place": 0.0, "read, then flushed": 0.0, "copy, flushed": 0.0}

    def timed(matrix: torch.Tensor) -> float:
        started = time.perf_counter()
        F.linear(x, matrix)
        return time.perf_counter() - started

    with torch.inference_mode():
        for _ in range(args.repeats):
            for layer in range(runtime.num_layers):
                seconds["read in place"] += timed(runtime.read(layer, "up", ids).matrix[ids[0] :])
                matrix = runtime.read(layer, "up", ids).matrix[ids[0] :]
                _flush(matrix)
                seconds["read, then flushed"] += timed(matrix)
                copy = matrix.clone()
                _flush(copy)
                seconds["copy, flushed"] += timed(copy)
    flashlm.unpatch(model)

    products = args.repeats * runtime.num_layers
    base = seconds["copy, flushed"]
    print(f"{args.model}: one token's product over {len(ids)} up rows of each layer, {products} products")
    print("| rows | us per product | x copy |")
    print("|---|---|---|")
    for name, total in seconds.items():
        print(f"| {name} | {1e6 * total / products:.1f} | {total / base:.2f} |")


if __name__ == "__main__":
    main()
