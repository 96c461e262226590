"""`flashlm` command line: convert, info, generate."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ._utils import format_bytes


def _add_runtime_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="dense", help="what each MLP does (default: dense)")
    parser.add_argument("--density", type=float, default=1.0, help="target MLP density in (0, 1]")
    parser.add_argument("--policy", default="lru", help="cache policy: lru, lfu or window")
    parser.add_argument(
        "--memory-budget", default=None, help="cache budget: bytes, '512MB' or '50%%' of MLP bytes"
    )
    parser.add_argument("--store", default=None, help="store path (default: one in flashlm's cache)")
    parser.add_argument("--no-direct-io", action="store_true", help="read through the page cache")
    parser.add_argument("--io-threads", type=int, default=None, help="reader threads")


def _config(args: argparse.Namespace):
    from .config import FlashConfig

    return FlashConfig(
        method=args.method,
        density=args.density,
        policy=args.policy,
        memory_budget=args.memory_budget,
        store=args.store,
        direct_io=False if args.no_direct_io else None,
        io_threads=args.io_threads,
    )


def cmd_convert(args: argparse.Namespace) -> int:
    from .store import convert

    store = convert(args.source, args.dest, overwrite=args.overwrite)
    print(f"wrote {store.path}: {store.num_layers} layers, kinds {', '.join(store.kinds)}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from .store import Store

    store = Store.open(args.store)
    manifest = store.manifest
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    print(f"store          {store.path}")
    print(
        f"format         {manifest['format']} v{manifest['format_version']} "
        f"(flashlm {manifest['flashlm_version']})"
    )
    print(
        f"model          {store.model_type}: {store.num_layers} layers, "
        f"d_model {store.d_model}, d_ff {store.d_ff}"
    )
    print(f"MLP            {'gated' if store.gated else 'plain'}, {manifest['dtype']}")
    print(f"source         {manifest['source'].get('path')}")
    print(f"content sha256 {manifest['source'].get('content_sha256')}")
    for kind in store.kinds:
        layout = manifest["kinds"][kind]
        print(
            f"kind {kind:<9} {layout['rows']} rows x {layout['width']} ({layout['row_bytes']} B/row), "
            f"{format_bytes(store.nbytes(kind))} in all"
        )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    from .models import default_model_path
    from .patching import stats

    model_path = Path(args.model) if args.model else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=_config(args))
    print(f"loaded {model_path.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if args.chat and tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        prompt = args.prompt
    inputs = tokenizer(prompt, return_tensors="pt")
    stats(model, reset=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=streamer)
    elapsed = time.perf_counter() - started
    snapshot = stats(model)
    print()
    if args.steps:
        print(
            f"{'step':>4} {'tokens':>6} {'read':>10} {'reads':>6} {'hit rate':>8} {'I/O ms':>7} "
            f"{'cache ms':>8} {'compute ms':>10}"
        )
        for step in snapshot.per_step():
            lookups = step["hits"] + step["misses"]
            print(
                f"{step['step']:>4} {step['tokens']:>6.0f} {format_bytes(step['bytes_read']):>10} "
                f"{step['reads']:>6.0f} {step['hits'] / lookups if lookups else 0:>8.1%} "
                f"{1e3 * step['io_s']:>7.1f} {1e3 * step['cache_s']:>8.1f} {1e3 * step['compute_s']:>10.1f}"
            )
    decode_steps = max(snapshot.num_steps - 1, 1)
    print(f"{snapshot.num_steps} steps in {elapsed:.2f} s ({decode_steps / elapsed:.1f} tok/s incl. prefill)")
    print(snapshot.summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashlm", description="Run language models larger than memory.")
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert a Hugging Face safetensors checkpoint into a store")
    convert.add_argument("source", help="checkpoint directory (config.json + *.safetensors)")
    convert.add_argument("dest", help="store directory to create")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing store")
    convert.set_defaults(func=cmd_convert)

    info = sub.add_parser("info", help="show what a store holds")
    info.add_argument("store")
    info.add_argument("--json", action="store_true", help="print the manifest")
    info.set_defaults(func=cmd_info)

    generate = sub.add_parser("generate", help="generate text with a streaming model and print its stats")
    generate.add_argument(
        "--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    generate.add_argument("--prompt", default="What is the capital of France?")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument(
        "--no-chat", dest="chat", action="store_false", help="do not apply the chat template"
    )
    generate.add_argument(
        "--no-steps", dest="steps", action="store_false", help="omit the per-token stats lines"
    )
    _add_runtime_options(generate)
    generate.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    from .errors import FlashLMError

    try:
        return args.func(args)
    except FlashLMError as exc:
        print(f"flashlm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
