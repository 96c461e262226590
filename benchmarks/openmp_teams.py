"""What a second OpenMP team costs the decode thread's parallel products.

flashlm runs its reads and cache updates on one background thread (`engine.io_thread.IOThread`);
the cache updates are torch operators, and the first parallel one gives that thread an OpenMP team
of its own. libgomp then manages more threads than there are cores, and from then on every worker
spins only briefly before sleeping, so each parallel region of the decode thread (torch's products,
flashlm's column kernel) waits for its workers to wake. The same throttling keeps spinning workers
from holding a core while the decode thread waits for a read.

This script times, in one process, the decode-shaped products before any background team exists,
then after a background thread ran one parallel torch operator with one OpenMP thread (no team),
then after one with the default count (a second team): the column kernel over a SmolLM2 `dip_in`
matrix (576 x 3072, density 0.6) and `F.linear` over the same bytes.

    python benchmarks/openmp_teams.py
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import torch
import torch.nn.functional as F

from flashlm.ops import columns

REPEATS = 2000
OPENMP: ctypes.CDLL | None = None
"""torch's libgomp, once `main` found it loaded."""


def products_us() -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(576, 3072, generator=generator).bfloat16()
    coef = torch.randn(1, 576, generator=generator) * (torch.rand(1, 576, generator=generator) < 0.6)
    out = torch.zeros(1, 3072)
    weight, x = rows.t().contiguous(), torch.randn(1, 576, generator=generator).bfloat16()
    times = {}
    for name, run in (
        ("column kernel", lambda: columns.native(out, coef, rows)),
        ("F.linear", lambda: F.linear(x, weight)),
    ):
        for _ in range(50):
            run()
        started = time.perf_counter()
        for _ in range(REPEATS):
            run()
        times[name] = 1e6 * (time.perf_counter() - started) / REPEATS
    return times


def on_background_thread(openmp_threads: int | None) -> None:
    """One parallel torch operator on a new, lasting thread (as the I/O thread's cache updates are)."""
    done = threading.Event()

    def work() -> None:
        torch.get_num_threads()  # torch's per-thread set-up, which would reset the count below
        if openmp_threads is not None:
            OPENMP.omp_set_num_threads(openmp_threads)
        torch.zeros(1 << 22).add_(1)
        done.set()
        threading.Event().wait()  # the thread lives on, as the I/O thread does

    threading.Thread(target=work, daemon=True).start()
    done.wait()


def main() -> None:
    global OPENMP
    if columns._native_functions() is None:
        raise SystemExit("The native column kernel is unavailable here (no C compiler).")
    try:
        OPENMP = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        raise SystemExit("torch has not loaded libgomp here: this measures libgomp's teams.") from None
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability {capability}")
    rows = [("no background team", products_us())]
    on_background_thread(1)
    rows.append(("background thread, 1 OpenMP thread", products_us()))
    on_background_thread(None)
    rows.append(("background thread with a team", products_us()))
    print("| decode thread's product (us) | column kernel | F.linear |\n|---|---|---|")
    for label, times in rows:
        print(f"| {label} | {times['column kernel']:.0f} | {times['F.linear']:.0f} |")


if __name__ == "__main__":
    main()
