"""Endor codec speed: compression ratio, and decompression time by the torch gather and by the C kernel
(and by torch on CUDA where there is a GPU), on the linear shapes of SmolLM2 at 50% sparsity.

    python benchmarks/endor_codec.py --repeats 30

Prints a markdown table: per shape, the compressed share of the dense bytes, the median time of each
decompression path and its throughput in dense GB/s, and the C kernel's speedup over torch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest.mock import patch

import torch

from flashlm.endor import codec
from flashlm.endor.codec import Decompressor, compress
from flashlm.endor.kernel import decompression_path

SHAPES = {
    "q_proj / o_proj": (576, 576),
    "k_proj / v_proj": (192, 576),
    "gate / up": (1536, 576),
    "down": (576, 1536),
}


def half_sparse(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    weight = torch.randn(rows, cols).to(dtype)
    drop = torch.rand(rows, cols).argsort(1)[:, : cols // 2]
    return weight.scatter_(1, drop, 0)


def median_ms(function, *args, repeats: int) -> float:
    """Median wall time of `function(*args)` in ms, after one warm-up call."""
    function(*args)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    print(
        f"CPU decompression path: {decompression_path()}; {torch.get_num_threads()} torch threads; "
        f"CUDA: {cuda}\n"
    )
    header = "| shape | compressed / dense | torch CPU ms | C kernel ms | C speedup | dense GB/s (C) |"
    print(header + (" CUDA torch ms |" if cuda else ""))
    print("|---|---|---|---|---|---|" + ("---|" if cuda else ""))
    for name, shape in SHAPES.items():
        weight = half_sparse(*shape, torch.bfloat16)
        matrix = compress(weight)
        out = torch.empty(shape, dtype=torch.bfloat16)
        decompressor = Decompressor(weight.numel(), weight.dtype)
        kernel_ms = median_ms(decompressor, matrix, out, repeats=args.repeats)
        with patch.object(codec, "cpu_kernel", lambda: None):
            torch_decompressor = Decompressor(weight.numel(), weight.dtype)
            torch_ms = median_ms(torch_decompressor, matrix, out, repeats=args.repeats)
        row = (
            f"| {name} {shape[0]}x{shape[1]} | {matrix.ratio:.2%} | {torch_ms:.3f} | {kernel_ms:.3f} | "
            f"{torch_ms / kernel_ms:.2f}x | {matrix.dense_nbytes / kernel_ms / 1e6:.2f} |"
        )
        if cuda:
            on_gpu = matrix.to("cuda")
            gpu_out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
            gpu = Decompressor(weight.numel(), weight.dtype, "cuda")
            row += f" {median_ms(gpu, on_gpu, gpu_out, repeats=args.repeats):.3f} |"
        print(row)


if __name__ == "__main__":
    main()
