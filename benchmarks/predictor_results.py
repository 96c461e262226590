"""Predictor-based loading on a relufied model (issue 17, item 5): predictor quality, perplexity, the
sliding window, and decode speed against dense streaming and DIP-CA at equal memory.

One command, four parts, written to `<out>/report.md` (and `results.json`):

1. **Predictors**: `flashlm.workflows.predictors.train_store_predictors` on the relufied checkpoint
   (`flashlm train relufy` wrote it), labelled on `--train-corpora`, saved beside its store; per
   layer the rank PowerInfer's rank growth chose, held-out recall and precision, predicted against
   true density, size as % of the MLP. The same on the plain SwiGLU checkpoint with "active" = the
   top `--swiglu-top` of |act(gate)·up| (the DIP paper's claim: SwiGLU magnitudes are hard to predict).
2. **Perplexity** on each corpus: the relufied model in RAM (equal to the oracle mask: a FATReLU
   neuron outside the true active set contributes exactly zero) and with `method="predictor"`;
   the plain SwiGLU model for reference.
3. **Window**: decoding with `predictor-window:K` for several K, the new neurons read per token as a
   share of all neurons (LLM in a flash §3.1: 10% -> 2.4% at k = 5 on OPT 6.7B).
4. **Decode** at `--memory-budget` (default 50% of the MLP bytes), each row in its own process, the
   relufied model loaded with its thresholds and patched: dense streaming, DIP-CA, the predictor,
   the predictor with a window, `predictor-gate` (gate rows first, its budget split by its unit
   profile), and the predictor with PowerInfer's hot set pinned (`hot_share` of `--hot-shares`,
   placed from the store's unit profile of the predictor; each profile measured after training:
   `flashlm profile`); tokens/s, MB and requests per token, hit rate, and the share of the profiled
   neuron uses the hot set covers. The predictors' weights are paid from the same budget.
5. **Equal perplexity**: DIP-CA on the plain SwiGLU model (no relufication, no training), its
   perplexity swept over `--dip-densities` (token by token, as it decodes); the lowest density whose
   perplexity is at most the predictor's on every corpus is decoded at the same budget, alternating
   with each predictor row `--verdict-runs` times, and the report says which is faster in every run,
   or that their runs overlap. With `--teacher-forced` every decode row is fed the dense row's greedy
   tokens (`flashlm.eval.decode`'s `forced_tokens`), so that rows whose own choices differ still
   decode the same text; the table then gives each row's agreement with the dense row's choices.

    python benchmarks/predictor_results.py --relufied bench-results/relufy/smollm2-fatrelu/model \\
        --out bench-results/predictors
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from flashlm.data.corpora import DEFAULT_TRAIN_CORPORA
from flashlm.eval.decode import run_in_subprocess

DECODE_ROWS = {
    "dense": {},
    "dip-ca@0.6": {"method": "dip", "density": 0.6, "cache_aware": 0.2},
    "predictor": {"method": "predictor", "density": 0.5},
    "predictor-window:5": {"method": "predictor", "density": 0.5, "policy": "window", "window": 5},
    "predictor-gate": {"method": "predictor-gate", "density": 0.5},
}
PREDICTOR_ROWS = ("predictor", "predictor-gate")
"""The rows the verdict compares with the equal-perplexity rival (the same predictor, read two ways)."""


PPL_CONTEXT = 512
"""Context length of every perplexity measured here."""


def load_patched(path: Path, options: dict[str, Any]):
    """The checkpoint (relufied or not) in memory, its MLPs swapped by flashlm with `options`."""
    import torch

    import flashlm
    from flashlm.training.checkpoints import load_checkpoint

    model = load_checkpoint(path, dtype=torch.bfloat16)
    return flashlm.patch(model, flashlm.FlashConfig(**options), progress=False)


def mean(items, attribute: str) -> float:
    return sum(getattr(item, attribute) for item in items) / len(items)


def predictor_table(reports) -> list[str]:
    lines = [
        "| layer | rank | recall | precision | predicted density | true density | % of MLP |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        lines.append(
            f"| {r.layer} | {r.rank} | {r.recall:.3f} | {r.precision:.3f} | {r.density:.3f} "
            f"| {r.label_density:.3f} | {r.size_percent:.1f}% |"
        )
    lines.append(f"| mean | | {mean(reports, 'recall'):.3f} | {mean(reports, 'precision'):.3f} | | | |")
    return lines


def hot_set_cell(hot: dict[str, float] | None) -> str:
    if not hot:
        return "—"
    return f"{hot['units']:.0f}, {hot['bytes'] / 1e6:.1f}, {hot['profiled_uses']:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--relufied", type=Path, help="checkpoint written by flashlm train relufy")
    parser.add_argument("--swiglu", default=None, help="the plain checkpoint (default: the embedded SmolLM2)")
    parser.add_argument("--swiglu-top", type=float, default=0.15, help="SwiGLU 'active' = this top share")
    parser.add_argument(
        "--no-swiglu-predictors",
        dest="swiglu_predictors",
        action="store_false",
        help="skip the predictors of the plain SwiGLU model (its perplexity is still measured)",
    )
    parser.add_argument(
        "--train-tokens",
        type=int,
        default=61440,
        help="tokens labelled for the predictors (default: 61440, about all the calibration text of "
        "debian-reference, the smallest corpus, times three; held in memory, ~2.5 GB for SmolLM2 and ~7.2 GB "
        "for Qwen2.5-1.5B)",
    )
    parser.add_argument(
        "--train-corpora",
        default=",".join(DEFAULT_TRAIN_CORPORA),
        help="corpora whose calibration splits the predictors learn from, an equal share of the tokens "
        "each where a corpus has it",
    )
    parser.add_argument(
        "--reuse-predictors",
        action="store_true",
        help="use the predictors already saved beside the relufied store in --out instead of training",
    )
    parser.add_argument("--target-recall", type=float, default=0.95)
    parser.add_argument(
        "--max-rank",
        type=int,
        default=None,
        help="largest predictor rank tried (default: min(d_model, d_ff))",
    )
    parser.add_argument("--corpora", default="shakespeare,jargon")
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--windows", default="1,2,5,8")
    parser.add_argument("--hot-shares", default="0.25,0.5,1.0", help="hot_share of each hot-set row")
    parser.add_argument("--profile-tokens", type=int, default=1024, help="tokens of the unit profile")
    parser.add_argument("--memory-budget", default="50%")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--dip-densities",
        default="0.3,0.5,0.7",
        help="densities of DIP-CA on the plain model searched for the predictor's perplexity (each one "
        "decodes --ppl-tokens tokens of every corpus, reading its misses: minutes apiece)",
    )
    parser.add_argument(
        "--verdict-runs",
        type=int,
        default=3,
        help="decodes of the predictor and of the equal-perplexity DIP-CA row, alternating, for the verdict",
    )
    parser.add_argument(
        "--teacher-forced",
        action="store_true",
        help="feed every decode row the dense row's greedy tokens (all rows decode the same text)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/predictors"))
    args = parser.parse_args()
    if args.relufied is None:
        parser.error("--relufied is required")
    if args.ppl_tokens < PPL_CONTEXT:  # checked before minutes of training, not after
        parser.error(
            f"--ppl-tokens must be at least one window of context {PPL_CONTEXT}, got {args.ppl_tokens}"
        )
    if args.verdict_runs < 1:
        parser.error(f"--verdict-runs must be at least 1, got {args.verdict_runs}")

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from flashlm import FlashConfig
    from flashlm.data.corpora import corpus_tokens
    from flashlm.data.models import model_path
    from flashlm.eval.perplexity import perplexity
    from flashlm.eval.sweep import sweep
    from flashlm.predictors import (
        PREDICTORS_FILE,
        LabelRule,
        Predictors,
        TrainOptions,
        collect_activations,
        evaluate_predictors,
    )
    from flashlm.training.checkpoints import load_checkpoint
    from flashlm.workflows.calibrate import load_or_calibrate
    from flashlm.workflows.predictors import train_store_predictors
    from flashlm.workflows.profile import load_or_profile

    args.out.mkdir(parents=True, exist_ok=True)
    swiglu = Path(model_path(args.swiglu))
    train_corpora = args.train_corpora.split(",")
    options = TrainOptions(target_recall=args.target_recall, max_rank=args.max_rank)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    report = [f"# Predictor-based loading: {args.relufied}", ""]

    # 1. predictors
    started = time.perf_counter()
    store = args.out / "relufied.flash"  # the relufied store beside the results, for training and loading
    if args.reuse_predictors and (store / PREDICTORS_FILE).is_file():
        relu_predictors, relu_s = Predictors.load(store), None  # checked against the store's weights
    else:
        relu_predictors = train_store_predictors(
            args.relufied, corpora=train_corpora, tokens=args.train_tokens, options=options, store=store
        )
        relu_s = time.perf_counter() - started
    trained = [("relufied (active = exactly nonzero)", relu_predictors, relu_s)]
    if args.swiglu_predictors:
        started = time.perf_counter()
        swiglu_predictors = train_store_predictors(
            swiglu,
            corpora=train_corpora,
            tokens=args.train_tokens,
            rule=LabelRule.top(args.swiglu_top),
            options=options,
        )
        trained.append(
            (
                f"plain SwiGLU (active = top {args.swiglu_top:.0%} of |act(gate)·up|)",
                swiglu_predictors,
                time.perf_counter() - started,
            )
        )
    for name, predictors, seconds in trained:
        report += [
            f"## Predictors, {name}: "
            + (
                "saved beside the store, reused (--reuse-predictors)"
                if seconds is None
                else f"{args.train_tokens} calibration tokens of {', '.join(train_corpora)}, "
                f"target recall {args.target_recall}, trained in {seconds:.0f} s"
            ),
            "",
            *predictor_table(predictors.reports),
            "",
        ]
    results["predictors"] = {name: [vars(r) for r in predictors.reports] for name, predictors, _ in trained}

    # 1 (continued). the relufied predictors on each test split: text the held-out rows did not cover
    tokenizer = AutoTokenizer.from_pretrained(args.relufied)
    corpora = args.corpora.split(",")
    relufied = load_checkpoint(args.relufied, dtype=torch.float32)
    quality, tokens = {}, args.ppl_tokens - args.ppl_tokens % PPL_CONTEXT
    for corpus in corpora:
        ids = corpus_tokens(corpus, tokenizer)[:tokens]
        samples = collect_activations(
            relufied, list(ids.view(-1, 1, PPL_CONTEXT)), max_rows=ids.numel(), progress=False
        )
        quality[corpus] = evaluate_predictors(relu_predictors, samples)
    del relufied
    results["predictor_quality"] = {c: [vars(q) for q in layers] for c, layers in quality.items()}
    report += [
        f"## Relufied predictors on the first {tokens} tokens of each test split (mean over layers)",
        "",
        "| corpus | recall | min recall | precision | predicted density | true density |",
        "|---|---|---|---|---|---|",
        *(
            f"| {c} | {mean(q, 'recall'):.3f} | {min(x.recall for x in q):.3f} | {mean(q, 'precision'):.3f} "
            f"| {mean(q, 'density'):.3f} | {mean(q, 'label_density'):.3f} |"
            for c, q in quality.items()
        ),
        "",
    ]

    # 2. perplexity
    rows = {
        "SwiGLU dense (in RAM)": lambda: load_checkpoint(swiglu, dtype=torch.bfloat16),
        "relufied dense (in RAM) = oracle mask": lambda: load_checkpoint(args.relufied, dtype=torch.bfloat16),
        "relufied + predictor": lambda: load_patched(
            args.relufied,
            {"method": "predictor", "density": 0.5, "memory_budget": args.memory_budget, "store": str(store)},
        ),
    }
    ppl: dict[str, dict[str, float]] = {}
    for name, load in rows.items():
        model = load()
        ppl[name] = {
            corpus: perplexity(
                model,
                corpus_tokens(corpus, tokenizer),
                context_length=PPL_CONTEXT,
                num_tokens=args.ppl_tokens,
                progress=False,
            ).perplexity
            for corpus in corpora
        }
        del model
    results["perplexity"] = ppl
    report += [
        f"## Perplexity ({args.ppl_tokens} tokens of each test split, context {PPL_CONTEXT})",
        "",
        "| model | " + " | ".join(corpora) + " |",
        "|---|" + "---|" * len(corpora),
        *(f"| {name} | " + " | ".join(f"{v[c]:.2f}" for c in corpora) + " |" for name, v in ppl.items()),
        "",
    ]

    # 5 (perplexity half). DIP-CA on the plain model: the lowest density within the predictor's perplexity
    predictor_ppl = ppl["relufied + predictor"]
    load_or_calibrate(swiglu, corpus=corpora[0], num_tokens=1024, progress=False)
    dip_rows = sweep(
        swiglu,
        methods=["dip-ca"],
        densities=[float(d) for d in args.dip_densities.split(",")],
        corpora=corpora,
        context_length=PPL_CONTEXT,
        num_tokens=args.ppl_tokens,
        memory_budget=args.memory_budget,
        out_dir=args.out / "dip-ca-sweep",
        progress=False,
    )
    dip_ppl: dict[float, dict[str, float]] = {}
    for row in dip_rows:
        dip_ppl.setdefault(float(row["target_density"]), {})[row["corpus"]] = float(row["perplexity"])
    qualifying = [d for d in sorted(dip_ppl) if all(dip_ppl[d][c] <= predictor_ppl[c] for c in corpora)]
    equal_density = qualifying[0] if qualifying else None
    results["dip_ca_perplexity"] = {str(d): v for d, v in dip_ppl.items()}
    report += [
        "## DIP-CA on the plain SwiGLU model: perplexity by density (token by token, as it decodes)",
        "",
        "| density | " + " | ".join(corpora) + " |",
        "|---|" + "---|" * len(corpora),
        *(f"| {d:g} | " + " | ".join(f"{v[c]:.2f}" for c in corpora) + " |" for d, v in dip_ppl.items()),
        "",
        (
            f"Lowest density with perplexity at most the predictor's on every corpus: {equal_density:g}."
            if equal_density is not None
            else "No swept density reaches the predictor's perplexity on every corpus: no equal-perplexity "
            "row."
        ),
        "",
    ]

    # 3 and 4. decode rows, each in its own process
    budget = {"memory_budget": args.memory_budget, "store": str(store.resolve())}
    specs = {name: {**budget, **options} for name, options in DECODE_ROWS.items()}
    for k in (int(k) for k in args.windows.split(",")):
        specs[f"predictor-window:{k}"] = {**budget, **DECODE_ROWS["predictor-window:5"], "window": k}
    load_or_profile(args.relufied, FlashConfig(**specs["predictor-gate"]), num_tokens=args.profile_tokens)
    hot_shares = [float(share) for share in args.hot_shares.split(",") if share.strip()]
    if hot_shares:
        predictor = {**budget, **DECODE_ROWS["predictor"]}
        load_or_profile(args.relufied, FlashConfig(**predictor), num_tokens=args.profile_tokens)
        for share in hot_shares:
            specs[f"predictor + hot set {share:.0%}"] = {**predictor, "hot_share": share}
    models = dict.fromkeys(specs, args.relufied)
    equal_row = None
    if equal_density is not None:
        equal_row = f"plain SwiGLU DIP-CA@{equal_density:g} (perplexity <= predictor's)"
        specs[equal_row] = {
            "memory_budget": args.memory_budget,
            **DECODE_ROWS["dip-ca@0.6"],
            "density": equal_density,
        }
        models[equal_row] = swiglu
    with tempfile.TemporaryDirectory() as offload:  # `flashlm.eval.decode`, as `flashlm bench` runs rows
        forced: dict[str, Any] = {}

        def decode(name: str) -> dict[str, Any]:
            spec = {"name": name, "kind": "flashlm", "options": specs[name], **forced}
            return run_in_subprocess(
                spec, models[name], new_tokens=args.new_tokens, offload_dir=Path(offload)
            )

        decoded = {"dense": decode("dense")}  # exact: the relufied model's own greedy tokens
        if args.teacher_forced:
            forced["forced_tokens"] = decoded["dense"]["tokens"]
        decoded |= {name: decode(name) for name in specs if name != "dense"}
        # The verdict compares two rows on a noisy machine: more runs of both, alternating, so that a
        # slow spell of the machine does not land on one row only.
        verdict_runs = {name: [decoded[name]["decode_tok_s"]] for name in PREDICTOR_ROWS}
        if equal_row is not None:
            verdict_runs[equal_row] = [decoded[equal_row]["decode_tok_s"]]
            for _ in range(args.verdict_runs - 1):
                for name in verdict_runs:
                    verdict_runs[name].append(decode(name)["decode_tok_s"])
    results["decode"] = decoded
    results["verdict_runs"] = verdict_runs
    config = AutoConfig.from_pretrained(args.relufied)
    d_ff_total = config.intermediate_size * config.num_hidden_layers
    dense = decoded["dense"]["decode_tok_s"]
    report += [
        f"## Decode, relufied model, memory budget {args.memory_budget} of the MLP bytes, "
        f"{args.new_tokens} tokens",
        "",
        *(
            [
                "Teacher-forced: every row was fed the dense row's greedy tokens, so every row decoded "
                "the same text; `agreement` is the share of steps where a row's own greedy token was "
                "the dense row's.",
                "",
            ]
            if args.teacher_forced
            else []
        ),
        "| configuration | tok/s | x dense | MB read/token | requests/token | new neurons/token "
        "| MLP density | hit rate | hot set: units, MB, profiled uses covered | agreement |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in decoded.items():
        # a predictor unit is one neuron's bundle; predictor-gate's are a gate row or an up_down row
        new = f"{r['misses_per_token'] / d_ff_total:.1%}" if name.startswith("predictor") else "—"
        if name == "predictor-gate":
            new += " (rows: gate + up_down)"
        report.append(
            f"| {name} | {r['decode_tok_s']:.2f} | {r['decode_tok_s'] / dense:.2f} "
            f"| {r['reader_bytes_per_token'] / 1e6:.1f} | {r['reads_per_token']:.0f} | {new} "
            f"| {r['mlp_density']:.1%} "
            f"| {r['hit_rate']:.1%} | {hot_set_cell(r.get('hot_set'))} "
            f"| {format(r['agreement'], '.0%') if 'agreement' in r else '—'} |"
        )
    for name in PREDICTOR_ROWS if equal_row is not None else ():
        ours, theirs = verdict_runs[name], verdict_runs[equal_row]
        predictor, rival = statistics.median(ours), statistics.median(theirs)
        if min(ours) > max(theirs):
            verdict = "faster than it in every run"
        elif max(ours) < min(theirs):
            verdict = "slower than it in every run"
        else:
            verdict = "neither faster nor slower: the runs overlap"
        runs = ", ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(ours, theirs, strict=True))
        report += [
            "",
            f"At equal memory and at most the predictor's perplexity, the relufied model with its predictor "
            f"({name}) decodes {predictor:.2f} tok/s (median of {len(ours)} runs, alternating with the "
            f"rival's): {predictor / rival:.2f}x {equal_row} ({rival:.2f} tok/s), {verdict} "
            f"({name} / rival tok/s per run: {runs}).",
        ]
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))


if __name__ == "__main__":
    main()
