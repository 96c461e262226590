"""Reader settings (threads x chunk size) measured where they matter: dense-streaming decode.

`reader_throughput.py` measures the disk alone; during decode the reader shares two cores with
the model's compute, and every request costs Python time under the GIL. This sweep decodes
SmolLM2 at the smallest budget (every unit read every token) for each setting and prints tok/s,
the time decode waited for reads, and how long the (overlapped) reads took.

    python benchmarks/decode_io_settings.py --steps 10
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import flashlm
from flashlm.data.models import default_model_path
from flashlm.engine.runtime import FlashRuntime
from flashlm.errors import BudgetTooSmallError

SETTINGS = [(8, 64 << 10), (4, 128 << 10), (4, 256 << 10), (3, 256 << 10), (2, 512 << 10), (2, 1 << 20)]


def decode(model, steps: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        for _ in range(3):  # warm-up: caches and the prefetch pipeline settle
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
        flashlm.stats(model, reset=True)
        started = time.perf_counter()
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
        return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_path = default_model_path()
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as work:
        store = Path(work) / "store.flash"
        flashlm.convert(model_path, store)
        try:
            FlashRuntime(flashlm.Store.open(store), flashlm.FlashConfig(memory_budget=1))
        except BudgetTooSmallError as exc:
            budget = exc.minimum_bytes
        print(
            "| threads | chunk KiB | decode tok/s | I/O wait ms/token | reads took ms/token | reads/token |"
        )
        print("|---|---|---|---|---|---|")
        for threads, chunk in SETTINGS:
            for _ in range(args.repeats):
                config = flashlm.FlashConfig(
                    store=str(store), memory_budget=budget, io_threads=threads, io_chunk_bytes=chunk
                )
                model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=config)
                tok_s = decode(model, args.steps)
                t = flashlm.stats(model).totals()
                print(
                    f"| {threads} | {chunk >> 10} | {tok_s:.2f} | {1e3 * t['io_s_per_step']:.1f} | "
                    f"{1e3 * t['io_busy_s_per_step']:.1f} | {t['reads_per_step']:.0f} |",
                    flush=True,
                )
                flashlm.unpatch(model)


if __name__ == "__main__":
    main()
