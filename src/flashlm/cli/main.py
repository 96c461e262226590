"""`flashlm` command line: convert, info, generate, calibrate, profile, prune, bench, simulate, eval,
train."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .._utils import format_bytes
from ..cache.policies import NO_CACHE, POLICIES
from ..config import CACHE_SPLITS

METHOD_HELP = (
    "what each MLP does, a method spec: dense (default), dip, dip-ca (DIP-CA, γ 0.2), dip-ca:GAMMA, "
    "dip-layer, dip-global, glu, gate, up, cats, predictor, predictor-window:K (a sliding window of K "
    "tokens), predictor-gate (the predicted neurons' gate rows first, then up and down of those that "
    "fire), endor (a pruned model's decoder linears, Endor-compressed)"
)


def _add_method_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="dense", help=METHOD_HELP)
    parser.add_argument("--density", type=float, default=1.0, help="target MLP density in (0, 1]")
    parser.add_argument(
        "--input-density", type=float, default=None, help="dip: fraction of input columns kept for up/gate"
    )
    parser.add_argument(
        "--cache-aware",
        type=float,
        default=None,
        metavar="GAMMA",
        help="dip: γ of cache-aware masking in [0, 1] (1 = plain DIP; dip-ca sets 0.2)",
    )
    parser.add_argument(
        "--threshold", choices=("token", "layer", "global"), default=None, help="dip: how inputs are picked"
    )


def _add_runtime_options(parser: argparse.ArgumentParser, *, method: bool = True) -> None:
    if method:
        _add_method_options(parser)
    parser.add_argument(
        "--policy",
        default="lfu",
        choices=(*POLICIES.names(), NO_CACHE),
        help=f"cache policy: {', '.join((*POLICIES.names(), NO_CACHE))} (default lfu)",
    )
    parser.add_argument(
        "--memory-budget", default=None, help="cache budget: bytes, '512MB' or '50%%' of MLP bytes"
    )
    parser.add_argument("--store", default=None, help="store path (default: one in flashlm's cache)")
    parser.add_argument("--no-direct-io", action="store_true", help="read through the page cache")
    parser.add_argument("--io-threads", type=int, default=None, help="reader threads")
    parser.add_argument(
        "--cache-split",
        default=None,
        choices=CACHE_SPLITS,
        help="how the cache bytes are shared between unit kinds (default: the method's; read-cost: "
        "the kinds whose misses cost the disk most per byte first; size: in proportion to each "
        "kind's size; profile: by a unit profile's use of each unit; in-order: one kind whole after "
        "another, one layer's cache after another)",
    )
    parser.add_argument(
        "--hot-share",
        type=float,
        default=0.0,
        help="share of the cache pinned to the units the method needs most (its `flashlm profile`)",
    )


def _method_options(args: argparse.Namespace) -> dict:
    """FlashConfig options given by --cache-aware, --threshold, --input-density (those present)."""
    options = {
        "cache_aware": args.cache_aware,
        "threshold": args.threshold,
        "input_density": args.input_density,
    }
    return {name: value for name, value in options.items() if value is not None}


def _io_options(args: argparse.Namespace) -> dict:
    return {
        "policy": args.policy,
        "direct_io": False if args.no_direct_io else None,
        "io_threads": args.io_threads,
        "cache_split": args.cache_split,
        "hot_share": args.hot_share,
    }


def _config(args: argparse.Namespace):
    from ..config import FlashConfig
    from ..methods.specs import parse_method_spec

    options = {**parse_method_spec(args.method), **_method_options(args)}
    return FlashConfig(
        density=args.density,
        memory_budget=args.memory_budget,
        store=args.store,
        **options,
        **_io_options(args),
    )


def _model_dir(model: str | None) -> Path:
    """The checkpoint directory `--model` names: a bundled model's name (`flashlm.data.models.BUNDLED_MODELS`,
    converted on first use), a directory, or, when absent, the default model."""
    from ..data.models import model_path

    return model_path(model)


def cmd_convert(args: argparse.Namespace) -> int:
    if args.format == "endor":
        from ..endor.store import convert_endor, meta_model_layout
        from ..errors import ConfigError

        if args.kinds:
            raise ConfigError("--kinds applies to MLP stores; an Endor store holds every decoder linear.")
        if args.dtype:
            raise ConfigError("--dtype applies to MLP stores; an Endor store keeps the checkpoint's dtype.")

        store = convert_endor(
            args.source, args.dest, meta_model_layout(args.source), overwrite=args.overwrite
        )
        print(
            f"wrote {store.path}: {store.num_layers} layers, {format_bytes(store.nbytes())} compressed = "
            f"{store.ratio:.2%} of {format_bytes(store.dense_nbytes())} dense"
        )
        return 0
    from ..store import convert
    from ..store.format import dtype_name

    store = convert(args.source, args.dest, dtype=args.dtype, kinds=args.kinds, overwrite=args.overwrite)
    kinds = ", ".join(store.kinds)
    print(f"wrote {store.path}: {store.num_layers} layers, {dtype_name(store.dtype)}, kinds {kinds}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..methods.calibration import CALIBRATION_FILE, split_from_fit
    from ..workflows.calibrate import calibrate

    result = calibrate(
        _model_dir(args.model),
        corpus=args.corpus,
        store=args.store,
        num_tokens=args.tokens,
        context_length=args.context_length,
        split=args.split,
    )
    print(f"calibrated on {result.tokens} tokens of {result.corpus}; wrote {CALIBRATION_FILE} into the store")
    if result.split_fit is not None:
        fit = result.split_fit
        print(f"DIP split: logit(ρ_in) = {fit['intercept']:.3f} + {fit['slope']:.3f} logit(density)")
        for density in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
            rho_in, rho_down = split_from_fit(fit, density)
            print(f"  density {density:.0%}: input columns {rho_in:.1%}, down columns {rho_down:.1%}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from ..config import FlashConfig
    from ..methods.specs import parse_method_spec
    from ..workflows.profile import profile_units

    options = {**parse_method_spec(args.method), **_method_options(args)}
    options.pop("sequential_prefill", None)
    config = FlashConfig(density=args.density, store=args.store, **options)
    profile, path = profile_units(
        _model_dir(args.model),
        config,
        corpus=args.corpus,
        num_tokens=args.tokens,
        context_length=args.context_length,
    )
    print(f"profiled {profile.tokens} tokens of {profile.corpus}; wrote {path}")
    shown = (0, max(layer for layer, _ in profile.frequencies))  # the first and the last layer
    for (layer, kind), frequency in sorted(profile.frequencies.items()):
        if layer in shown:
            top = frequency.sort(descending=True).values
            tenth = max(1, frequency.numel() // 10)
            print(
                f"  layer {layer} {kind}: mean use {frequency.mean():.1%}, the hottest 10% of units take "
                f"{top[:tenth].sum() / max(float(top.sum()), 1e-12):.1%} of the uses"
            )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from ..store import Store

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
    for adapter in (store.fused_from or {}).get("adapters", []):
        print(f"fused adapter  {adapter['path']} (sha256 {adapter['sha256'][:16]}...)")
    for kind in store.kinds:
        layout = manifest["kinds"][kind]
        print(
            f"kind {kind:<9} {layout['rows']} rows x {layout['width']} ({layout['row_bytes']} B/row), "
            f"{format_bytes(store.nbytes(kind))} in all"
        )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..eval import bench

    model_path = _model_dir(args.model)
    out = Path(args.out)
    work = Path(args.work) if args.work else None
    plan = bench.prepare(
        model_path,
        memory_budget=args.memory_budget,
        methods=args.methods,
        pruned=Path(args.pruned) if args.pruned else None,
        new_tokens=args.new_tokens,
        cold=not args.warm,
        ppl_tokens=args.ppl_tokens,
        ppl_context=args.ppl_context,
        corpus=args.corpus,
        out=out,
        work=work,
    )
    print(f"memory budget {format_bytes(plan.memory_budget)} for every flashlm configuration")
    print(f"writing {out / 'bench.json'} and {out / 'bench.md'} as each configuration finishes")
    throughput = [] if args.no_disk else bench.disk_throughput(work or Path("/var/tmp"))
    report = bench.run_bench(
        model_path,
        plan.specs,
        new_tokens=args.new_tokens,
        out=out,
        work_dir=work,
        throughput=throughput,
        teacher_forced=args.teacher_forced,
    )
    measured = {result["config"] for result in report["results"]}
    if args.ppl_tokens and measured:
        # After the decode runs: each runs in a child process, which would inherit this process's
        # peak RSS (fork copies it) and report the perplexity models' memory as its own.
        perplexity = bench.perplexities(
            model_path,
            [spec for spec in plan.specs if spec["name"] in measured],
            num_tokens=args.ppl_tokens,
            context_length=args.ppl_context,
            corpus=args.corpus,
        )
        bench.add_perplexity(report, perplexity)
    written = bench.save(report, out)
    print(bench.markdown(report))
    print(f"\nwrote {', '.join(map(str, written))}")
    if report["failed"]:
        names = ", ".join(failure["config"] for failure in report["failed"])
        print(
            f"flashlm: error: {len(report['failed'])} configuration(s) failed: {names}; their errors "
            f"are in {out / 'bench.json'}",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    from ..patching import stats

    model_path = _model_dir(args.model)
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
    if args.steps and snapshot.placement:  # Endor: where time goes is read, decompress, compute
        print(
            f"{'step':>4} {'tokens':>6} {'read':>10} {'read wait ms':>12} {'decompress ms':>13} "
            f"{'compute ms':>10}"
        )
        for step in snapshot.per_step():
            print(
                f"{step['step']:>4} {step['tokens']:>6.0f} {format_bytes(step['bytes_read']):>10} "
                f"{1e3 * step['io_s']:>12.1f} {1e3 * step['decompress_s']:>13.1f} "
                f"{1e3 * step['compute_s']:>10.1f}"
            )
    elif args.steps:
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


_DTYPES = ("bfloat16", "float16", "float32")


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _densities(text: str) -> list[float]:
    try:
        return [float(item) for item in _list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _check_windows(args: argparse.Namespace) -> None:
    from ..errors import ConfigError

    if args.tokens < args.context_length:
        raise ConfigError(
            f"--tokens {args.tokens} is shorter than one window (--context-length {args.context_length})."
        )


def _finite(value):
    """JSON has no NaN: None instead."""
    return None if isinstance(value, float) and value != value else value


def _text_tokens(path: str, model_path: Path):
    """The token ids of the text file `path` under the tokenizer of the checkpoint at `model_path`."""
    from transformers import AutoTokenizer

    from ..data.corpora import encode_text, read_text_file

    text = read_text_file(path, role="Evaluation text")
    return encode_text(AutoTokenizer.from_pretrained(model_path), text)


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    import torch

    from ..eval.perplexity import evaluate
    from ..methods.specs import parse_method_spec

    parse_method_spec(args.method)
    _check_windows(args)
    model_path = _model_dir(args.model)
    scored = args.corpus if args.text is None else _text_tokens(args.text, model_path)
    result = evaluate(
        model_path,
        scored,
        method_spec=args.method,
        density=args.density,
        context_length=args.context_length,
        num_tokens=args.tokens,
        memory_budget=args.memory_budget,
        store=args.store,
        dtype=getattr(torch, args.dtype),
        progress=not args.json,
        **_method_options(args),
        **_io_options(args),
    )
    if args.json:
        record = {
            "model": str(model_path),
            **({"corpus": args.corpus} if args.text is None else {"text": args.text}),
            "method": args.method,
            "target_density": args.density,
            **result.to_dict(),
        }
        print(json.dumps({key: _finite(value) for key, value in record.items()}, indent=2))
        return 0
    print(f"model        {model_path.name}")
    print(f"corpus       {args.corpus} (test split)" if args.text is None else f"text         {args.text}")
    print(f"method       {args.method}, target density {args.density:g}")
    print(f"perplexity   {result.perplexity:.4f}")
    print(f"MLP density  {result.mlp_density:.1%}")
    print(f"tokens       {result.tokens} predicted in {result.windows} windows of {result.context_length}")
    print(f"tokens/s     {result.tokens_per_second:.1f} ({result.seconds:.1f} s)")
    print(
        f"I/O          {format_bytes(result.bytes_read_per_token)} read per token, "
        f"hit rate {result.hit_rate:.1%}"
    )
    return 0


def cmd_eval_sweep(args: argparse.Namespace) -> int:
    import torch

    from ..eval.sweep import CSV_NAME, PLOT_NAME, sweep
    from ..methods.specs import parse_method_spec

    for spec in args.methods:
        parse_method_spec(spec)
    _check_windows(args)
    model_path = _model_dir(args.model)
    rows = sweep(
        model_path,
        methods=args.methods,
        densities=args.densities,
        corpora=args.corpora,
        context_length=args.context_length,
        num_tokens=args.tokens,
        memory_budget=args.memory_budget,
        store=args.store,
        out_dir=args.out,
        dtype=getattr(torch, args.dtype),
        **_io_options(args),
    )
    print(
        f"{'corpus':<18} {'method':<12} {'target':>6} {'density':>8} {'perplexity':>11} {'tok/s':>8} "
        f"{'read/token':>11} {'hit rate':>8}"
    )
    for row in rows:
        print(
            f"{row['corpus']:<18} {row['method']:<12} {row['target_density']:>6.2f} "
            f"{row['mlp_density']:>8.1%} "
            f"{row['perplexity']:>11.4f} {row['tokens_per_second']:>8.1f} "
            f"{format_bytes(row['bytes_read_per_token']):>11} {row['hit_rate']:>8.1%}"
        )
    print(f"wrote {Path(args.out) / CSV_NAME}")
    print(f"wrote {Path(args.out) / PLOT_NAME}")
    return 0


def _add_eval_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--context-length", type=_int_at_least(2), default=512, help="tokens per window (default: 512)"
    )
    parser.add_argument(
        "--tokens",
        type=_int_at_least(2),
        default=4096,
        help="tokens of the test split to use (default: 4096)",
    )
    parser.add_argument(
        "--dtype", choices=_DTYPES, default="bfloat16", help="model dtype (default: bfloat16)"
    )


def _n_m(text: str) -> tuple[int, int]:
    """`"2:4"` -> `(2, 4)`: keep N of every M consecutive weights, 1 <= N < M."""
    parts = text.split(":")
    try:
        n, m = (int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N:M such as 2:4, got {text!r}") from None
    if not 1 <= n < m:
        raise argparse.ArgumentTypeError(f"N:M needs 1 <= N < M (keep N of every M), got {text!r}")
    return n, m


def cmd_prune(args: argparse.Namespace) -> int:
    from ..workflows.prune import prune_checkpoint

    model_path = _model_dir(args.model)
    report = prune_checkpoint(
        model_path,
        args.out,
        sparsity=args.sparsity,
        n_m=args.n_m,
        corpus=args.corpus,
        num_windows=args.windows,
        context_length=args.context_length,
        overwrite=args.overwrite,
    )
    pattern = f"{report.n_m[0]}:{report.n_m[1]}" if report.n_m else f"{report.sparsity:g} unstructured"
    print(
        f"pruned {len(report.linears)} decoder linears of {model_path.name} with Wanda ({pattern}), "
        f"calibrated on {report.tokens} tokens of {args.corpus}"
    )
    print(f"achieved sparsity {report.achieved_sparsity:.2%} ({report.zeros} of {report.numel} weights zero)")
    print(f"wrote {args.out}")
    return 0


def _add_prune_parser(sub) -> None:
    from ..workflows.prune import DEFAULT_CONTEXT_LENGTH, DEFAULT_CORPUS, DEFAULT_WINDOWS

    prune = sub.add_parser(
        "prune", help="Wanda-prune the decoder linears of a checkpoint and save the pruned checkpoint"
    )
    prune.add_argument(
        "model", nargs="?", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    prune.add_argument("out", help="directory of the pruned checkpoint to write")
    prune.add_argument(
        "--sparsity",
        type=float,
        default=None,
        help="fraction of each row's weights to prune, in [0, 1) (default: 0.5; with --n-m, 1 - N/M)",
    )
    prune.add_argument("--n-m", type=_n_m, default=None, metavar="N:M", help="N:M pattern instead, e.g. 2:4")
    prune.add_argument(
        "--corpus",
        default=DEFAULT_CORPUS,
        help=f"corpus whose calibration split calibrates (default: {DEFAULT_CORPUS})",
    )
    prune.add_argument(
        "--windows",
        type=_int_at_least(1),
        default=DEFAULT_WINDOWS,
        help=f"calibration windows (default: {DEFAULT_WINDOWS})",
    )
    prune.add_argument(
        "--context-length",
        type=_int_at_least(2),
        default=DEFAULT_CONTEXT_LENGTH,
        help=f"tokens per calibration window (default: {DEFAULT_CONTEXT_LENGTH})",
    )
    prune.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    prune.set_defaults(func=cmd_prune)


def cmd_train_relufy(args: argparse.Namespace) -> int:
    from ..training.relufy import format_report, options_from_args, run

    report = run(*options_from_args(args))
    if report.measurements or report.reload_exact is not None:  # the main process (others print nothing)
        print(json.dumps(report.to_dict(), indent=2, default=str) if args.json else format_report(report))
    return 0


def cmd_train_lora(args: argparse.Namespace) -> int:
    from ..training.lora import format_report, options_from_args, run

    report = run(*options_from_args(args))
    if report.measurements:  # the main process (others print nothing)
        print(json.dumps(report.to_dict(), indent=2, default=str) if args.json else format_report(report))
    return 0


def cmd_fuse(args: argparse.Namespace) -> int:
    from ..config import FlashConfig
    from ..errors import ConfigError
    from ..methods.mlp import open_checkpoint_store
    from ..workflows.fuse import fuse_adapter, fuse_pruned_checkpoint
    from ..workflows.prune import read_pruning_record

    if args.model and read_pruning_record(_model_dir(args.model)) is not None:
        if args.in_place:
            raise ConfigError(
                "A Wanda-pruned checkpoint is fused into a copy: give --out DIR, not --in-place."
            )
        fused_dir = fuse_pruned_checkpoint(_model_dir(args.model), args.adapter, args.out)
        print(f"fused {args.adapter} into {fused_dir}: load it with FlashConfig(method='endor')")
        return 0
    store = args.store or open_checkpoint_store(_model_dir(args.model), FlashConfig())
    fused = fuse_adapter(store, args.adapter, None if args.in_place else args.out)
    print(f"fused {args.adapter} into {fused.path} (content sha256 {fused.content_sha256[:16]}...)")
    print(f"stream it with: FlashConfig(store={str(fused.path)!r}, ...) or --store {fused.path}")
    return 0


def cmd_train_predictors(args: argparse.Namespace) -> int:
    from ..predictors import TrainOptions, format_reports
    from ..workflows.predictors import train_store_predictors

    options = TrainOptions(target_recall=args.target_recall, epochs=args.epochs, max_rank=args.max_rank)
    predictors = train_store_predictors(
        args.model,
        corpora=args.corpora,
        tokens=args.tokens,
        sequence_length=args.sequence_length,
        options=options,
        store=args.store,
        method=args.for_method,
    )
    print(format_reports(predictors.reports))
    params = sum(r.size_percent or 0.0 for r in predictors.reports) / len(predictors.reports)
    print(f"predictors: {params:.2f}% of the MLP parameters on average per layer")
    return 0


def _add_train_parser(sub) -> None:
    from ..data.corpora import DEFAULT_TRAIN_CORPORA
    from ..training.relufy import build_parser as relufy_parser
    from ..training.trainer import names

    train = sub.add_parser(
        "train", help="training recipes (run unchanged under `accelerate launch -m flashlm.cli ...`)"
    )
    train_sub = train.add_subparsers(dest="train_command", required=True)
    relufy = train_sub.add_parser(
        "relufy",
        parents=[relufy_parser()],
        add_help=False,
        help="ReLU / FATReLU in place of the MLP activation, fine-tuned by distillation; saves and measures",
        description=relufy_parser().description,
    )
    relufy.set_defaults(func=cmd_train_relufy)

    predictors = train_sub.add_parser(
        "predictors",
        help="low-rank activation predictors for method='predictor', trained on a corpus and saved beside "
        "the model's store",
    )
    predictors.add_argument("--model", default=None, help="checkpoint directory or bundled model name")
    predictors.add_argument("--store", default=None, help="the store to save beside (default: the model's)")
    predictors.add_argument(
        "--corpora",
        type=names,
        default=DEFAULT_TRAIN_CORPORA,
        help="labels come from their calibration splits, an equal share of --tokens each where a corpus "
        f"has it, the others making up what a smaller one lacks (default: {','.join(DEFAULT_TRAIN_CORPORA)})",
    )
    predictors.add_argument("--tokens", type=_int_at_least(2), default=32768, help="tokens to label, in all")
    predictors.add_argument("--sequence-length", type=_int_at_least(2), default=256)
    predictors.add_argument(
        "--target-recall", type=float, default=0.95, help="per layer: the rank grows until it is reached"
    )
    predictors.add_argument(
        "--max-rank",
        type=_int_at_least(1),
        default=None,
        help="largest rank tried per layer (default: min(d_model, d_ff)); smaller predictors leave more of "
        "the memory budget to the cache",
    )
    predictors.add_argument("--epochs", type=_int_at_least(1), default=4)
    predictors.add_argument(
        "--for-method",
        choices=("predictor", "predictor-gate"),
        default=None,
        help="size them for the method that will load them: rank growth also stops where a larger "
        "predictor no longer shrinks what a token touches (smaller, faster, less accurate predictors; "
        "default: grow by recall alone)",
    )
    predictors.set_defaults(func=cmd_train_predictors)

    from ..training.lora import build_parser as lora_parser

    lora = train_sub.add_parser(
        "lora",
        parents=[lora_parser()],
        add_help=False,
        help="LoRA adapters on a sparse method's MLPs, distilled from the dense model, fused into a store",
        description=lora_parser().description,
    )
    lora.set_defaults(func=cmd_train_lora)

    fuse = sub.add_parser(
        "fuse", help="rewrite a store with a LoRA adapter (from `flashlm train lora`) fused into its weights"
    )
    fuse.add_argument("--adapter", required=True, help="the adapter directory (OUT/adapter)")
    # a Wanda-pruned --model gets a fused copy of the checkpoint (Endor compresses it on loading)
    source = fuse.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="the model whose store to fuse into (default: smollm2)")
    source.add_argument("--store", default=None, help="the store to fuse into")
    dest = fuse.add_mutually_exclusive_group(required=True)
    dest.add_argument("--out", help="write the fused store here, keeping the original")
    dest.add_argument(
        "--in-place", action="store_true", help="replace the store (once the fused one is complete)"
    )
    fuse.set_defaults(func=cmd_fuse)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashlm", description="Run language models larger than memory.")
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert a Hugging Face safetensors checkpoint into a store")
    convert.add_argument("source", help="checkpoint directory (config.json + *.safetensors)")
    convert.add_argument("dest", help="store directory to create")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing store")
    convert.add_argument(
        "--format",
        choices=("mlp", "endor"),
        default="mlp",
        help="mlp (default): the MLP unit store of dense streaming and the sparse methods; endor: every "
        "decoder linear of a pruned checkpoint in Endor's bitmap format",
    )
    convert.add_argument(
        "--kinds",
        type=_list,
        default=None,
        help="unit layouts to write (default: dense streaming's gate,up,down; others derived on first use)",
    )
    convert.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="dtype of the stored weights (default: the checkpoint's); load the model in the same dtype",
    )
    convert.set_defaults(func=cmd_convert)

    calibrate = sub.add_parser(
        "calibrate",
        help="fit DIP's density split and the magnitude thresholds (CATS, per-layer/global) on text",
    )
    calibrate.add_argument(
        "--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    calibrate.add_argument("--corpus", default="shakespeare", help="corpus whose calibration split is used")
    calibrate.add_argument("--tokens", type=_int_at_least(2), default=1024, help="calibration tokens")
    calibrate.add_argument("--context-length", type=_int_at_least(2), default=512)
    calibrate.add_argument("--store", default=None, help="store path (default: one in flashlm's cache)")
    calibrate.add_argument(
        "--no-split", dest="split", action="store_false", help="only the thresholds, not the density split"
    )
    calibrate.set_defaults(func=cmd_calibrate)

    profile = sub.add_parser(
        "profile",
        help="count how often a sparse method needs each unit on text (the hot set's profile, --hot-share)",
    )
    profile.add_argument(
        "--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    _add_method_options(profile)
    profile.add_argument("--corpus", default="shakespeare", help="corpus whose calibration split is decoded")
    profile.add_argument("--tokens", type=_int_at_least(2), default=2048, help="tokens decoded")
    profile.add_argument("--context-length", type=_int_at_least(2), default=256)
    profile.add_argument("--store", default=None, help="store path (default: one in flashlm's cache)")
    profile.set_defaults(func=cmd_profile)

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

    bench_parser = sub.add_parser(
        "bench", help="decode speed of every configuration side by side: RAM, Accelerate, flashlm methods"
    )
    bench_parser.add_argument(
        "--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)"
    )
    bench_parser.add_argument(
        "--memory-budget",
        default="50%",
        help="flashlm's budget: bytes or '50%%' of the MLP bytes (the same bytes for every flashlm row)",
    )
    bench_parser.add_argument(
        "--methods",
        type=_list,
        # SmolLM2's operating points within +10% of dense perplexity (benchmarks/dip_results.py, Table 2).
        default=["dip@0.65", "dip-ca@0.7", "up@0.8"],
        help="flashlm operating points, SPEC@DENSITY[/INPUT_DENSITY] (dip: the fraction of up/gate "
        "input columns kept), comma-separated (default: dip@0.65,dip-ca@0.7,up@0.8)",
    )
    bench_parser.add_argument(
        "--pruned", default=None, help="a pruned checkpoint (flashlm prune) to add Endor"
    )
    bench_parser.add_argument("--new-tokens", type=_int_at_least(1), default=16)
    bench_parser.add_argument(
        "--warm", action="store_true", help="keep the page cache (no root needed; labelled)"
    )
    bench_parser.add_argument("--no-disk", action="store_true", help="skip the disk throughput measurement")
    bench_parser.add_argument(
        "--teacher-forced",
        action="store_true",
        help="feed every configuration ram's greedy tokens, so that all decode the same text",
    )
    bench_parser.add_argument(
        "--ppl-tokens",
        type=_int_at_least(0),
        default=1024,
        help="tokens of the corpus to score each configuration's perplexity on (0: skip; default 1024)",
    )
    bench_parser.add_argument("--ppl-context", type=_int_at_least(2), default=512, help="perplexity window")
    bench_parser.add_argument("--corpus", default="shakespeare", help="perplexity corpus (test split)")
    bench_parser.add_argument(
        "--work", default=None, help="directory for offload folders (default: /var/tmp)"
    )
    bench_parser.add_argument(
        "--out",
        default="bench-results/bench",
        help="where bench.json and bench.md go (rewritten as each configuration finishes)",
    )
    bench_parser.set_defaults(func=cmd_bench)

    from .sim import add_simulate_parser

    add_simulate_parser(sub)

    evaluation = sub.add_parser("eval", help="perplexity on offline corpora")
    eval_sub = evaluation.add_subparsers(dest="eval_command", required=True)
    ppl = eval_sub.add_parser(
        "ppl", help="perplexity of one configuration on a corpus's test split, with its MLP density"
    )
    scored = ppl.add_mutually_exclusive_group()
    scored.add_argument(
        "--corpus", default="shakespeare", help="shakespeare (default), jargon or debian-reference"
    )
    scored.add_argument(
        "--text",
        metavar="FILE",
        default=None,
        help="score a UTF-8 text file instead of a corpus, from its start (e.g. text unlike any training)",
    )
    _add_eval_options(ppl)
    ppl.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_runtime_options(ppl)
    ppl.set_defaults(func=cmd_eval_ppl)

    sweep = eval_sub.add_parser(
        "sweep", help="perplexity over corpora x methods x densities: a CSV and a perplexity-vs-density plot"
    )
    sweep.add_argument(
        "--methods", type=_list, default=["dense", "dip", "dip-ca"], help="comma-separated method specs"
    )
    sweep.add_argument(
        "--densities", type=_densities, default=[0.4, 0.5, 0.6], help="comma-separated target densities"
    )
    sweep.add_argument("--corpora", type=_list, default=["shakespeare"], help="comma-separated corpus names")
    sweep.add_argument("--out", default="eval-results", help="output directory (default: eval-results)")
    _add_eval_options(sweep)
    _add_runtime_options(sweep, method=False)
    sweep.set_defaults(func=cmd_eval_sweep)

    _add_prune_parser(sub)
    _add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    from ..errors import FlashLMError

    try:
        return args.func(args)
    except FlashLMError as exc:
        print(f"flashlm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
