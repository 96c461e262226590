"""Variants of one configuration decoded in one process, in alternating blocks of tokens.

On a shared, noisy host two runs of the same code can differ by a third; blocks alternated within
one process (in the order A B .. B A, repeated) let the drift fall on every variant alike. Each
variant is a set of `FlashConfig` options (`key=value`, comma-separated) over `--base`, or `ram` for
plain transformers; `torch_threads=N` sets `torch.set_num_threads` for the variant's blocks. Each
variant loads its own model and keeps its own generation state. Printed per block and
summarized by the median: tokens/s (and against the first variant), and for flashlm variants the I/O
wait, selection, cache bookkeeping (lookup, read submission, admission; the submission also apart),
compute and MB read per token from `flashlm.stats`. Every variant's MLP modules are timed by forward
hooks (`per_token_path.MLPTimer`); where a `ram` variant runs, each flashlm variant's compute is also
given over the first `ram` variant's MLP time, beside its bookkeeping over its compute (issue 14's
targets, measured in one process). The rest of a step (its time outside the MLP modules: attention,
norms, the head, which flashlm leaves to transformers) is given too, and over the `ram` variant's: a
control for what the variant's reads and waits cost code that flashlm does not run. The last column
says whether the variant decoded the first variant's greedy tokens. With `--profile-ops N`, every
block runs under torch.profiler, and a second table gives each variant's self CPU time and calls per
token of the N costliest operators of any variant.

    python benchmarks/alternate.py --model smollm2-135m --base memory_budget=50% \\
        --variant cache_split=read-cost --variant cache_split=in-order
    python benchmarks/alternate.py --model smollm2-135m --base memory_budget=50% \\
        --variant ram,torch_threads=2 --variant ram,torch_threads=1 \\
        --variant torch_threads=2 --variant torch_threads=1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections import Counter
from typing import Any

import torch
from per_token_path import PROMPT, MLPTimer  # benchmarks/ is the script's directory, first on sys.path
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashlm
from flashlm.data.models import model_path

THREADS = "torch_threads"


def parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[lowered]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(text: str) -> dict[str, Any]:
    options = {}
    for item in filter(None, text.split(",")):
        if item == "ram":
            options["ram"] = True
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not key=value (or ram)")
        options[key] = parse_value(value)
    return options


class Variant:
    """One configuration's model, generation state, thread count and measured blocks."""

    def __init__(self, label: str, options: dict[str, Any]) -> None:
        self.label = label
        self.threads = options.pop(THREADS, None)
        self.ram = options.pop("ram", False)
        self.options = options
        self.model = self.out = None
        self.mlp_timer: MLPTimer | None = None
        self.tokens: list[int] = []
        self.blocks: list[dict[str, float]] = []
        self.op_ms: Counter[str] = Counter()
        """Self CPU milliseconds per operator over the profiled blocks (`--profile-ops`)."""
        self.op_calls: Counter[str] = Counter()
        self.profiled_tokens = 0

    def load(self, path, ids: torch.Tensor) -> None:
        if self.ram:
            self.model = AutoModelForCausalLM.from_pretrained(path)
        else:
            config = flashlm.FlashConfig(**self.options)
            self.model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
        self.mlp_timer = MLPTimer(self.model, "cpu")
        with torch.inference_mode():
            self.out = self.model(input_ids=ids, use_cache=True)
            for _ in range(3):  # warm-up: caches fill, the read-ahead settles
                self.step()

    def step(self) -> int:
        token = self.out.logits[:, -1:].argmax(-1)
        self.out = self.model(input_ids=token, past_key_values=self.out.past_key_values)
        return int(token)

    def decode_block(self, tokens: int, default_threads: int, profile: bool = False) -> dict[str, float]:
        torch.set_num_threads(self.threads or default_threads)
        if not self.ram:
            flashlm.stats(self.model, reset=True)
        self.mlp_timer.seconds = 0.0
        profiler = (
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
        )
        with torch.inference_mode(), profiler or contextlib.nullcontext():
            started = time.perf_counter()
            self.tokens += [self.step() for _ in range(tokens)]
            block = {"tok_s": tokens / (time.perf_counter() - started)}
        if profiler is not None:
            for event in profiler.key_averages():
                self.op_ms[event.key] += event.self_cpu_time_total / 1e3
                self.op_calls[event.key] += event.count
            self.profiled_tokens += tokens
        block["mlp_ms"] = 1e3 * self.mlp_timer.seconds / tokens
        block["rest_ms"] = 1e3 / block["tok_s"] - block["mlp_ms"]
        if not self.ram:
            totals = flashlm.stats(self.model).totals(decode_only=True)
            block["io_ms"] = 1e3 * totals["io_s_per_step"]
            block["select_ms"] = 1e3 * totals["select_s_per_step"]
            block["cache_ms"] = 1e3 * totals["cache_s_per_step"]
            block["submit_ms"] = 1e3 * totals["submit_s_per_step"]
            block["compute_ms"] = 1e3 * totals["compute_s_per_step"]
            block["mb"] = totals["bytes_read_per_step"] / 1e6
        self.blocks.append(block)
        return block

    def median(self, key: str) -> float | None:
        values = [block[key] for block in self.blocks if key in block]
        return statistics.median(values) if values else None


def block_order(count: int, rounds: int) -> list[int]:
    """Variant indices in the order A B .. B A, `rounds` times over."""
    order: list[int] = []
    for round_index in range(rounds):
        order += list(range(count)) if round_index % 2 == 0 else list(range(count))[::-1]
    return order


def table(variants: list[Variant]) -> str:
    def cell(value: float | None, fmt: str) -> str:
        return "—" if value is None else format(value, fmt)

    first = variants[0]
    ram = next((variant for variant in variants if variant.ram), None)
    lines = [
        "| variant | tok/s per block | median tok/s | x first | MLP ms (hooks) | I/O wait ms | select ms "
        "| cache ms | of which submission | compute ms | compute / ram MLP | cache / compute | MB read "
        "| rest of step ms | rest / ram rest | tokens = first |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in variants:
        blocks = " / ".join(f"{block['tok_s']:.2f}" for block in variant.blocks)
        tok_s = variant.median("tok_s")
        compute = variant.median("compute_ms")
        over_ram = None if ram is None or compute is None else compute / ram.median("mlp_ms")
        bookkeeping = None if compute is None else variant.median("cache_ms") / compute
        rest = variant.median("rest_ms")
        rest_over_ram = None if ram is None else rest / ram.median("rest_ms")
        lines.append(
            f"| {variant.label} | {blocks} | {tok_s:.2f} | {tok_s / first.median('tok_s'):.2f} "
            f"| {variant.median('mlp_ms'):.1f} "
            f"| {cell(variant.median('io_ms'), '.1f')} | {cell(variant.median('select_ms'), '.1f')} "
            f"| {cell(variant.median('cache_ms'), '.1f')} | {cell(variant.median('submit_ms'), '.1f')} "
            f"| {cell(compute, '.1f')} | {cell(over_ram, '.2f')} | {cell(bookkeeping, '.1%')} "
            f"| {cell(variant.median('mb'), '.1f')} | {rest:.1f} | {cell(rest_over_ram, '.2f')} "
            f"| {'yes' if variant.tokens == first.tokens else 'no'} |"
        )
    return "\n".join(lines)


def ops_table(variants: list[Variant], count: int) -> str:
    """Self CPU ms and calls per token of the `count` costliest operators of each variant, for all."""
    ops: list[str] = []
    for variant in variants:
        ops += [op for op, _ in variant.op_ms.most_common(count) if op not in ops]
    ops.sort(key=lambda op: -max(variant.op_ms[op] / variant.profiled_tokens for variant in variants))
    lines = [
        "| operator (self ms, calls per token) | " + " | ".join(variant.label for variant in variants) + " |",
        "|---" * (len(variants) + 1) + "|",
    ]
    for op in ops:
        cells = [
            f"{v.op_ms[op] / v.profiled_tokens:.2f} ({v.op_calls[op] / v.profiled_tokens:.0f})"
            for v in variants
        ]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    totals = [f"{sum(variant.op_ms.values()) / variant.profiled_tokens:.1f}" for variant in variants]
    lines.append("| all operators | " + " | ".join(totals) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2-135m", help="a bundled model's name or a checkpoint directory"
    )
    parser.add_argument("--base", default="", help="options every variant shares, key=value,...")
    parser.add_argument("--variant", action="append", required=True, help="options of one variant (repeat)")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per block")
    parser.add_argument("--rounds", type=int, default=4, help="blocks per variant")
    parser.add_argument(
        "--profile-ops",
        type=int,
        default=0,
        metavar="N",
        help="profile every block; tabulate the N costliest operators",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.tokens < 1 or args.rounds < 1 or args.profile_ops < 0 or len(args.variant) < 2:
        parser.error(
            "--tokens and --rounds must be positive, --profile-ops not negative, "
            "and --variant given at least twice"
        )
    try:
        base = parse_options(args.base)
        variants = [Variant(text, {**base, **parse_options(text)}) for text in args.variant]
    except ValueError as error:
        parser.error(str(error))
    default_threads = torch.get_num_threads()
    path = model_path(args.model)
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    for variant in variants:
        variant.load(path, ids)
    for index in block_order(len(variants), args.rounds):
        variant = variants[index]
        block = variant.decode_block(args.tokens, default_threads, profile=args.profile_ops > 0)
        print(f"{variant.label}: " + ", ".join(f"{k} {v:.2f}" for k, v in block.items()), flush=True)
    print(
        f"\n{path.name}, base {args.base or '(none)'}, {os.cpu_count()} CPUs, blocks of {args.tokens} tokens "
        f"(per block in the order they ran; ms and MB per token)\n"
    )
    print(table(variants))
    if args.profile_ops:
        print("\ntorch.profiler, every block (self CPU time; an operator's children not included)\n")
        print(ops_table(variants, args.profile_ops))


if __name__ == "__main__":
    main()
