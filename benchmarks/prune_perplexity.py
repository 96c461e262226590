"""Perplexity of SmolLM2 dense, Wanda-pruned to 50% unstructured, and Wanda-pruned to 2:4.

Prunes the model (default: the embedded SmolLM2-135M-Instruct) with `flashlm.workflows.prune`, calibrated
on the calibration split of one corpus, into `<out>/wanda-50` (50% unstructured, the checkpoint other
benchmarks reuse) and `<out>/wanda-2-4` (2:4), then measures the perplexity of the dense and both
pruned checkpoints on the test split of each corpus (plain transformers models, no flashlm patching)
and prints a markdown table, also written to `<out>/perplexity.md` and `<out>/perplexity.json`.
A pruned checkpoint whose `pruning.json` matches the requested settings is reused (`--force` re-prunes).

    python benchmarks/prune_perplexity.py --out bench-results/prune
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from flashlm.workflows.prune import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_WINDOWS,
    prune_checkpoint,
    read_pruning_record,
)

VARIANTS = {
    # directory name -> (label, sparsity, n_m)
    "wanda-50": ("Wanda 50% unstructured", 0.5, None),
    "wanda-2-4": ("Wanda 2:4", None, (2, 4)),
}


def _matches(record: dict | None, sparsity, n_m, args, source: Path) -> bool:
    if record is None:
        return False
    wanted = {
        "sparsity": 0.5 if n_m is not None else sparsity,
        "n_m": list(n_m) if n_m is not None else None,
        "corpus": args.calibration_corpus,
        "windows": args.windows,
        "context_length": args.calibration_context_length,
        "source": str(source.resolve()),
    }
    return all(record.get(key) == value for key, value in wanted.items())


def prune_variants(args, source: Path, out: Path) -> dict[str, dict]:
    records = {}
    for name, (label, sparsity, n_m) in VARIANTS.items():
        path = out / name
        record = read_pruning_record(path)
        if args.force or not _matches(record, sparsity, n_m, args, source):
            print(f"== pruning {source.name}: {label} -> {path}", file=sys.stderr)
            prune_checkpoint(
                source,
                path,
                sparsity=sparsity,
                n_m=n_m,
                corpus=args.calibration_corpus,
                num_windows=args.windows,
                context_length=args.calibration_context_length,
                overwrite=True,
            )
            record = read_pruning_record(path)
        else:
            print(f"== reusing {path} ({label})", file=sys.stderr)
        records[name] = record
    return records


def measure(path: Path, corpora: dict, args) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from flashlm.eval.perplexity import perplexity

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
    result = {}
    for corpus, ids in corpora.items():
        measured = perplexity(
            model, ids, context_length=args.context_length, num_tokens=args.tokens, progress=False
        )
        result[corpus] = measured.perplexity
        print(f"   {path.name:<28} {corpus:<18} ppl {measured.perplexity:.3f}", file=sys.stderr)
    del model
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default="bench-results/prune", help="where the pruned checkpoints go")
    parser.add_argument("--corpora", default="shakespeare,jargon", help="comma-separated test corpora")
    parser.add_argument("--tokens", type=int, default=2048, help="test tokens per corpus (default: 2048)")
    parser.add_argument("--context-length", type=int, default=512, help="perplexity window (default: 512)")
    parser.add_argument("--calibration-corpus", default="shakespeare", help="corpus that calibrates Wanda")
    parser.add_argument("--windows", type=int, default=DEFAULT_WINDOWS, help="calibration windows")
    parser.add_argument(
        "--calibration-context-length", type=int, default=DEFAULT_CONTEXT_LENGTH, help="calibration window"
    )
    parser.add_argument("--force", action="store_true", help="re-prune even if matching checkpoints exist")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from transformers import AutoTokenizer

    from flashlm.data.corpora import corpus_tokens, require
    from flashlm.data.models import default_model_path

    corpus_names = [name.strip() for name in args.corpora.split(",") if name.strip()]
    for name in {*corpus_names, args.calibration_corpus}:
        require(name)
    source = Path(args.model) if args.model else default_model_path()
    out = Path(args.out)
    records = prune_variants(args, source, out)

    tokenizer = AutoTokenizer.from_pretrained(source)
    corpora = {name: corpus_tokens(name, tokenizer, split="test") for name in corpus_names}
    rows = [("dense", "dense", 0.0, measure(source, corpora, args))]
    for name, (label, _, _) in VARIANTS.items():
        rows.append((name, label, records[name]["achieved_sparsity"], measure(out / name, corpora, args)))

    header = ["model", "sparsity (decoder linears)", *(f"{corpus} ppl" for corpus in corpus_names)]
    lines = [
        f"Perplexity of {source.name} ({args.tokens} test tokens per corpus, context {args.context_length}; "
        f"Wanda calibrated on {args.windows} x {args.calibration_context_length} tokens of the "
        f"{args.calibration_corpus} calibration split, one pass)",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    for _, label, sparsity, ppl in rows:
        cells = [label, f"{sparsity:.1%}", *(f"{ppl[corpus]:.2f}" for corpus in corpus_names)]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "perplexity.md").write_text(table + "\n")
    record = {
        "model": str(source),
        "tokens": args.tokens,
        "context_length": args.context_length,
        "rows": [
            {"name": name, "label": label, "achieved_sparsity": sparsity, "perplexity": ppl}
            for name, label, sparsity, ppl in rows
        ],
        "pruning": records,
    }
    (out / "perplexity.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
