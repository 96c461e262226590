"""Where a relufied model's perplexity gap lies, token by token, against the dense model it came from.

Runs the dense model and a checkpoint saved by `flashlm train relufy` over the perplexity harness's
windows (the first `--tokens` tokens of each corpus's test split, non-overlapping windows of
`--context`), keeps every predicted token's NLL, and prints per corpus:

- perplexity, mean entropy of the next-token distribution and top-1 accuracy of both models;
- the gap (relufied NLL - dense NLL, nats per token) by position in the window;
- the gap by how sure the dense model was of the true token (its NLL), and each bucket's share of
  the whole gap;
- how few tokens carry it (the share of the summed gap in the worst 1/5/10/25% of tokens);
- whether temperature scaling of the relufied model's logits (0.8-1.0) would lower its perplexity:
  if not, the gap is lost knowledge, not a miscalibrated (too flat) distribution;
- the tokens that lost most, in context.

    python benchmarks/relufy_gap.py --model bench-results/relufy/RUN/model [--corpora shakespeare,jargon]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

POSITION_EDGES = (0, 8, 32, 64, 128, 256, 384)
DENSE_NLL_EDGES = (0.0, 0.5, 2.0, 4.0, 8.0)
WORST_SHARES = (0.01, 0.05, 0.10, 0.25)
TEMPERATURES = (1.0, 0.95, 0.9, 0.8)


def token_statistics(
    model: torch.nn.Module, ids: torch.Tensor, context: int, *, keep_logits: bool = False
) -> dict[str, torch.Tensor]:
    """Per predicted token, window by window as the harness: the true token's NLL, the distribution's
    entropy, whether the true token is the top-1, its position in the window, and with `keep_logits`
    the logits (for temperature scaling)."""
    nll, entropy, top1, targets_all, logits_all = [], [], [], [], []
    with torch.no_grad():
        for start in range(0, ids.numel() - context + 1, context):
            window = ids[start : start + context].unsqueeze(0)
            logits = model(input_ids=window, use_cache=False).logits[0, :-1].float()
            log_p = F.log_softmax(logits, dim=-1)
            targets = window[0, 1:]
            nll.append(-log_p.gather(1, targets[:, None])[:, 0])
            entropy.append(-(log_p.exp() * log_p).sum(-1))
            top1.append((log_p.argmax(-1) == targets).float())
            targets_all.append(targets)
            if keep_logits:
                logits_all.append(logits)
    windows = len(nll)
    return {
        "nll": torch.cat(nll),
        "entropy": torch.cat(entropy),
        "top1": torch.cat(top1),
        "target": torch.cat(targets_all),
        "position": torch.arange(1, context).repeat(windows),
        **({"logits": torch.cat(logits_all)} if keep_logits else {}),
    }


def gap_report(dense: dict, relufied: dict) -> dict:
    """The figures the module docstring lists, as a JSON-able dict."""
    gap = relufied["nll"] - dense["nll"]
    total = gap.sum().item()

    def buckets(values: torch.Tensor, edges: tuple, end: float) -> list[dict]:
        rows = []
        for low, high in zip(edges, (*edges[1:], end), strict=True):
            mask = (values >= low) & (values < high)
            count = int(mask.sum())
            rows.append(
                {
                    "range": [low, high],
                    "tokens": count,
                    "mean_gap": gap[mask].mean().item() if count else math.nan,
                    "share": gap[mask].sum().item() / total if total else math.nan,
                }
            )
        return rows

    ordered = gap.sort(descending=True).values
    scaled = {
        str(t): math.exp(F.cross_entropy(relufied["logits"] / t, relufied["target"]).item())
        for t in TEMPERATURES
    }
    return {
        "tokens": gap.numel(),
        "models": {
            name: {
                "perplexity": math.exp(stats["nll"].mean().item()),
                "entropy": stats["entropy"].mean().item(),
                "top1": stats["top1"].mean().item(),
            }
            for name, stats in (("dense", dense), ("relufied", relufied))
        },
        "mean_gap": gap.mean().item(),
        "by_position": buckets(relufied["position"].float(), POSITION_EDGES, math.inf),
        "by_dense_nll": buckets(dense["nll"], DENSE_NLL_EDGES, math.inf),
        "worst_share": {str(q): ordered[: int(q * gap.numel())].sum().item() / total for q in WORST_SHARES},
        "relufied_perplexity_at_temperature": scaled,
    }


def worst_tokens(dense: dict, relufied: dict, tokenizer, k: int) -> list[dict]:
    """The `k` tokens whose NLL rose most, each with the six tokens before it."""
    targets = relufied["target"]
    rows = []
    for i in (relufied["nll"] - dense["nll"]).argsort(descending=True)[:k].tolist():
        rows.append(
            {
                "context": tokenizer.decode(targets[max(0, i - 6) : i]),
                "token": tokenizer.decode(targets[i : i + 1]),
                "dense_nll": dense["nll"][i].item(),
                "relufied_nll": relufied["nll"][i].item(),
            }
        )
    return rows


def markdown(corpus: str, report: dict) -> str:
    models = report["models"]
    lines = [
        f"## {corpus} ({report['tokens']} predicted tokens)",
        "",
        "| model | perplexity | entropy (nats) | top-1 |",
        "|---|---|---|---|",
        *(
            f"| {n} | {m['perplexity']:.3f} | {m['entropy']:.3f} | {m['top1']:.3f} |"
            for n, m in models.items()
        ),
        "",
        f"Mean gap {report['mean_gap']:+.3f} nats per token.",
        "",
        "| position in window | tokens | mean gap | share of gap |",
        "|---|---|---|---|",
        *(
            f"| {r['range'][0]}-{r['range'][1] if math.isfinite(r['range'][1]) else 'end'} | {r['tokens']} | "
            f"{r['mean_gap']:+.3f} | {r['share']:+.2f} |"
            for r in report["by_position"]
        ),
        "",
        "| dense NLL of the true token | tokens | mean gap | share of gap |",
        "|---|---|---|---|",
        *(
            f"| {r['range'][0]}-{r['range'][1] if math.isfinite(r['range'][1]) else 'inf'} | {r['tokens']} | "
            f"{r['mean_gap']:+.3f} | {r['share']:+.2f} |"
            for r in report["by_dense_nll"]
        ),
        "",
        "Share of the summed gap in the worst tokens: "
        + ", ".join(f"{float(q):.0%}: {s:.2f}" for q, s in report["worst_share"].items()),
        "",
        "Relufied perplexity with its logits divided by T: "
        + ", ".join(f"T={t}: {p:.3f}" for t, p in report["relufied_perplexity_at_temperature"].items()),
        "",
        "| context | token | dense NLL | relufied NLL |",
        "|---|---|---|---|",
        *(
            f"| {json.dumps(w['context'])} | {json.dumps(w['token'])} | "
            f"{w['dense_nll']:.2f} | {w['relufied_nll']:.2f} |"
            for w in report["worst"]
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", required=True, help="a checkpoint saved by `flashlm train relufy` (OUT/model)"
    )
    parser.add_argument(
        "--dense", default=None, help="the dense checkpoint (default: the one it was relufied from)"
    )
    parser.add_argument("--corpora", default="shakespeare,jargon")
    parser.add_argument("--tokens", type=int, default=4096, help="test tokens per corpus (default: 4096)")
    parser.add_argument("--context", type=int, default=512, help="window (default: 512)")
    parser.add_argument("--worst", type=int, default=15, help="tokens listed that lost most (default: 15)")
    parser.add_argument("--out", type=Path, default=None, help="also write gap.md and gap.json here")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashlm.data.corpora import corpus_tokens
    from flashlm.eval.perplexity import num_windows
    from flashlm.training.checkpoints import load_relufied
    from flashlm.training.relufy import RECORD_NAME

    dense_path = args.dense or json.loads((Path(args.model) / RECORD_NAME).read_text())["model"]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dense_model = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32).eval()
    relufied_model = load_relufied(args.model, dtype=torch.float32)
    reports, text = {}, []
    for corpus in args.corpora.split(","):
        ids = corpus_tokens(corpus, tokenizer, split="test")
        ids = ids[: num_windows(ids.numel(), args.context, args.tokens) * args.context]
        dense = token_statistics(dense_model, ids, args.context)
        relufied = token_statistics(relufied_model, ids, args.context, keep_logits=True)
        report = gap_report(dense, relufied)
        report["worst"] = worst_tokens(dense, relufied, tokenizer, args.worst)
        reports[corpus] = report
        text.append(markdown(corpus, report))
        print(text[-1], flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gap.md").write_text("\n".join(text))
        (args.out / "gap.json").write_text(
            json.dumps({"model": str(args.model), "corpora": reports}, indent=1)
        )


if __name__ == "__main__":
    main()
