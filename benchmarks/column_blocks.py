"""How wide a block of columns the native column kernel should stream per row (`_columns.c`, `BLOCK`).

The kernel splits each product's columns between the OpenMP threads and walks a thread's columns in
blocks: for each block, every kept row's piece of it. Narrow blocks keep the block of `out` in L1 but
read each row in short pieces, each a new stream for the CPU's prefetchers. This script builds the
kernel once per block width (the flags flashlm builds it with, `-DBLOCK=N`) and times `out += coef @ rows`
at density 0.6 over the sparse methods' matrices of SmolLM2-135M and Qwen2.5-1.5B (a DIP input matrix
`[d_model, 2 d_ff]`, a down matrix `[d_ff, d_model]`), cycling over enough copies that every call reads
its rows from memory, as a decode step does, for 1, 4 and 32 tokens; `F.linear` over the whole dense
matrix (the same bytes at density 1.0) for reference. Run it under the default capability and under
`ATEN_CPU_CAPABILITY=avx2` (the kernel is then built for AVX2). `--sources` times other versions of
the kernel's source beside it (another commit's `_columns.c`, saved to a file), at each block width.

    python benchmarks/column_blocks.py
    git show 78b4783:src/flashlm/ops/_columns.c > /tmp/old.c
    python benchmarks/column_blocks.py --blocks 65536 --sources /tmp/old.c,src/flashlm/ops/_columns.c
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flashlm._native import build_flags
from flashlm.ops.columns import SOURCE

SHAPES = {  # name: (units, row width)
    "smollm2 dip_in": (576, 2 * 1536),
    "smollm2 down": (1536, 576),
    "qwen2.5-1.5b dip_in": (1536, 2 * 8960),
    "qwen2.5-1.5b down": (8960, 1536),
}
COLD_BYTES = 256 << 20
"""Bytes of matrices each shape cycles over: far more than a CPU's last-level cache."""


def build(source: Path, block: int, directory: Path):
    library = directory / f"columns-{len(list(directory.iterdir()))}.so"
    # the copy beside the original finds its `#include "_elements.h"`
    flags = [*build_flags(openmp=True), f"-DBLOCK={block}", f"-I{SOURCE.parent}"]
    subprocess.run(["cc", *flags, "-o", str(library), str(source)], check=True)
    function = ctypes.CDLL(str(library)).flashlm_columns_bf16
    p, i = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [p, i, p, i, i, i, p, i, p, p, i, i]
    function.restype = i
    return function


def column_product(
    kernel, coef: torch.Tensor, matrices: list[torch.Tensor], out: torch.Tensor, copy: int
) -> None:
    """`out += coef @ matrices[copy]` with `kernel`."""
    rows = matrices[copy]
    tokens, units = coef.shape
    width = rows.shape[1]
    kernel(
        coef.data_ptr(),
        units,
        None,
        units,
        tokens,
        units,
        rows.data_ptr(),
        width,
        None,
        out.data_ptr(),
        width,
        width,
    )


def dense_product(x: torch.Tensor, weights: list[torch.Tensor], copy: int) -> None:
    F.linear(x, weights[copy])


def milliseconds(call, copies: int, repeats: int) -> float:
    for copy in range(copies):  # one warm-up pass
        call(copy)
    started = time.perf_counter()
    for step in range(repeats):
        call(step % copies)
    return 1e3 * (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="1024,4096,16384,65536")
    parser.add_argument("--tokens", default="1,4,32")
    parser.add_argument("--density", type=float, default=0.6)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--sources", default=str(SOURCE), help="comma-separated kernel sources to time")
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    sources = [Path(source) for source in args.sources.split(",")]
    names = [
        f"{source.name} block {b}" if len(sources) > 1 else f"block {b}" for source in sources for b in blocks
    ]
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability {capability}")
    print(f"ms per product at density {args.density}; F.linear: the whole matrix, dense\n")
    print("| matrix | tokens | " + " | ".join(names) + " | F.linear |")
    print("|---|---|" + "---|" * (len(names) + 1))
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        kernels = [build(source, block, Path(directory)) for source in sources for block in blocks]
        for name, (units, width) in SHAPES.items():
            copies = max(2, COLD_BYTES // (units * width * 2))
            matrices = [torch.randn(units, width, generator=generator).bfloat16() for _ in range(copies)]
            for tokens in (int(t) for t in args.tokens.split(",")):
                kept = torch.rand(1, units, generator=generator) < args.density
                coef = torch.randn(tokens, units, generator=generator) * kept
                out = torch.zeros(tokens, width)

                times = [
                    milliseconds(
                        functools.partial(column_product, kernel, coef, matrices, out), copies, args.repeats
                    )
                    for kernel in kernels
                ]
                x = torch.randn(tokens, units, generator=generator).bfloat16()
                weights = [m.t().contiguous() for m in matrices]
                times.append(milliseconds(functools.partial(dense_product, x, weights), copies, args.repeats))
                del weights
                print(f"| {name} | {tokens} | " + " | ".join(f"{t:.3f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
