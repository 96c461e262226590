"""What moving a layer's read rows to the GPU costs: pageable against pinned staging, rows against the
whole staging matrix.

Reads land in a host staging matrix (`row_matrix`) and `Fetch.to` moves the rows read to the model's
device. This times that move for one kind's staging matrix of a model's shape, for a share of its
rows read either as one run (dense streaming's uncached tail) or scattered (a sparse method's
misses), in these ways:

- `rows alone`: only the rows read cross (`copy_rows` into a zeroed matrix), from an anonymous-memory
  staging matrix and from a pinned one (what the runtime allocates where CUDA is available);
- `whole, pinned`: the whole pinned staging matrix in one copy (pageable too, below the table);
- `Fetch.to, pinned`: what the library does, which picks one of the two (`crosses_whole`).

Each figure is the median of `--repeats` moves, each timed from a synchronized GPU to a synchronized
GPU. Needs CUDA.

    python benchmarks/gpu_staging.py --shapes 8960x1536,1536x576
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from flashlm.engine.runtime import Fetch, copy_rows, crosses_whole, run_bounds
from flashlm.store.reader import row_matrix

SHARES = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)


def rows_alone(ids: torch.Tensor, staging: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What `Fetch.to` does where only the rows read cross."""
    matrix = torch.zeros(staging.shape, dtype=staging.dtype, device=device)
    copy_rows(matrix, staging, ids, run_bounds(ids))
    return matrix


def library(ids: torch.Tensor, staging: torch.Tensor, device: torch.device) -> Fetch:
    return Fetch(ids, staging, 0, 0, 0.0).to(device)


def median_ms(move: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        move()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        move()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8960x1536,1536x576", help="ROWSxWIDTH of a kind's matrix")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_staging.py needs CUDA.")
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    for shape in args.shapes.split(","):
        rows, width = (int(n) for n in shape.split("x"))
        staging = {
            pinned: row_matrix(rows, width, torch.bfloat16, pinned=pinned).normal_(generator=generator)
            for pinned in (False, True)
        }
        whole_mb = rows * width * 2 / 1e6
        print(f"## [{rows}, {width}] bf16 ({whole_mb:.1f} MB)\n")
        whole = {p: median_ms(partial(m.to, device), args.repeats) for p, m in staging.items()}
        print(
            "| rows read | as | rows alone, pageable ms | rows alone, pinned ms | whole, pinned ms "
            "| Fetch.to, pinned ms | it sent |"
        )
        print("|---|---|---:|---:|---:|---:|---|")
        for share in SHARES:
            count = max(1, round(share * rows))
            layouts = {
                "run": torch.arange(rows - count, rows),
                "scattered": torch.randperm(rows, generator=generator)[:count].sort().values,
            }
            for layout, ids in layouts.items():
                if layout == "scattered" and count == rows:
                    continue
                alone = {
                    p: median_ms(partial(rows_alone, ids, m, device), args.repeats)
                    for p, m in staging.items()
                }
                chosen = median_ms(partial(library, ids, staging[True], device), args.repeats)
                moved = library(ids, staging[True], device)
                if not torch.equal(moved.matrix[ids.to(device)].cpu(), staging[True][ids]):
                    raise SystemExit("Fetch.to moved other rows than the ones read.")
                sent = "whole" if crosses_whole(staging[True], ids, run_bounds(ids)) else "rows"
                print(
                    f"| {share:.0%} ({count}) | {layout} | {alone[False]:.2f} | {alone[True]:.2f} "
                    f"| {whole[True]:.2f} | {chosen:.2f} | {sent} |"
                )
        print(f"\nwhole matrix in one copy: pageable {whole[False]:.2f} ms, pinned {whole[True]:.2f} ms\n")


if __name__ == "__main__":
    main()
