"""torch's intra-op thread count during streamed decode, alternated within one process.

While flashlm decodes from the store, torch's OpenMP workers and the reader's threads share the
cores. With as many torch threads as cores, every product occupies all of them, and the reads in
flight beside it wait for a time slice to take their completions and issue the next request.
`torch.set_num_threads(1)` leaves a core to the reader at the cost of slower products. Unlike
`OMP_WAIT_POLICY` (see the README), it can be changed at run time, after `import torch`.

Each configuration is loaded once; blocks of `--tokens` decode steps then alternate between the
thread counts (in the order A B B A, repeated), so that the host's drift falls on both alike.
Printed per block and summarized by the median: tokens/s, and for flashlm rows the I/O wait and the
compute per token from `flashlm.stats`.

    python benchmarks/torch_threads.py --model smollm2-135m --threads 2,1
    python benchmarks/torch_threads.py --model qwen2.5-1.5b --tokens 8 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashlm
from flashlm.data.models import model_path

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Explain why this mattered."
)
CONFIGURATIONS: dict[str, dict[str, Any] | None] = {
    "ram": None,
    "dense@50%": {"memory_budget": "50%"},
    "dip@0.6": {"memory_budget": "50%", "method": "dip", "density": 0.6},
    "dip-ca@0.6": {"memory_budget": "50%", "method": "dip", "density": 0.6, "cache_aware": 0.2},
}


def block_orders(counts: list[int], rounds: int) -> list[int]:
    """The thread counts in the order A B .. B A, `rounds` times over."""
    order: list[int] = []
    for round_index in range(rounds):
        order += counts if round_index % 2 == 0 else counts[::-1]
    return order


def decode_blocks(model, tokenizer, counts: list[int], rounds: int, tokens: int, streams: bool) -> list[dict]:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    blocks = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(3):  # warm-up: caches fill, the read-ahead settles
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values)
        for threads in block_orders(counts, rounds):
            torch.set_num_threads(threads)
            if streams:
                flashlm.stats(model, reset=True)
            started = time.perf_counter()
            for _ in range(tokens):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values)
            block = {"threads": threads, "tok_s": tokens / (time.perf_counter() - started)}
            if streams:
                totals = flashlm.stats(model).totals(decode_only=True)
                block["io_ms"] = 1e3 * totals["io_s_per_step"]
                block["compute_ms"] = 1e3 * totals["compute_s_per_step"]
            print(
                f"  {threads} threads: "
                + ", ".join(f"{k} {v:.2f}" for k, v in block.items() if k != "threads")
            )
            blocks.append(block)
    return blocks


def summary(name: str, blocks: list[dict], counts: list[int]) -> list[str]:
    def median(threads: int, key: str) -> float:
        return statistics.median(b[key] for b in blocks if b["threads"] == threads)

    base = median(counts[0], "tok_s")
    rows = []
    for threads in counts:
        tok_s = [f"{b['tok_s']:.2f}" for b in blocks if b["threads"] == threads]
        io = f"{median(threads, 'io_ms'):.1f}" if "io_ms" in blocks[0] else "—"
        compute = f"{median(threads, 'compute_ms'):.1f}" if "compute_ms" in blocks[0] else "—"
        rows.append(
            f"| {name} | {threads} | {' / '.join(tok_s)} | {median(threads, 'tok_s') / base:.2f} "
            f"| {io} | {compute} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2-135m", help="a bundled model's name or a checkpoint directory"
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGURATIONS),
        help="comma-separated, of: " + ", ".join(CONFIGURATIONS),
    )
    parser.add_argument(
        "--threads", default=f"{torch.get_num_threads()},1", help="thread counts to alternate"
    )
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per block")
    parser.add_argument("--rounds", type=int, default=3, help="times each thread count is measured")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    counts = [int(count) for count in args.threads.split(",")]
    names = args.configs.split(",")
    unknown = [name for name in names if name not in CONFIGURATIONS]
    if unknown or any(count < 1 for count in counts) or args.tokens < 1 or args.rounds < 1:
        parser.error(
            f"unknown configurations {unknown} (choose from {list(CONFIGURATIONS)})"
            if unknown
            else "thread counts, --tokens and --rounds must be positive"
        )
    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = []
    for name in names:
        options = CONFIGURATIONS[name]
        print(f"{name}:", flush=True)
        if options is None:
            model = AutoModelForCausalLM.from_pretrained(path)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, quantization_config=flashlm.FlashConfig(**options)
            )
        rows += summary(
            name,
            decode_blocks(model, tokenizer, counts, args.rounds, args.tokens, options is not None),
            counts,
        )
        del model
    print(
        f"\n{path.name}, {os.cpu_count()} CPUs, blocks of {args.tokens} tokens, in the order the blocks ran\n"
    )
    print(
        "| configuration | torch threads | tok/s per block | median tok/s vs the first count "
        "| I/O wait ms/token | compute ms/token |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
