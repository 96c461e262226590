"""Evaluation: perplexity on offline corpora, sweeps over methods and densities, decode benchmarks.

- `flashlm.eval.corpora`: `CORPORA`, `corpus_text(name)`, `corpus_tokens(name, tokenizer, split=...)`.
- `flashlm.eval.perplexity`: `perplexity(model, ids)`, `evaluate(model_path, corpus, ...)`,
  `parse_method_spec(spec)`, `PerplexityResult`.
- `flashlm.eval.sweep`: `sweep(...)` (CSV + the DIP paper's Fig. 8), `plot_throughput_vs_perplexity`.
- `flashlm.eval.decode`: decode throughput of one configuration in a subprocess (benchmarks).
"""

from __future__ import annotations

from .corpora import CORPORA, corpus_text, corpus_tokens
from .perplexity import PerplexityResult, evaluate, parse_method_spec, perplexity
from .sweep import plot_perplexity_vs_density, plot_throughput_vs_perplexity, sweep

__all__ = [
    "CORPORA",
    "PerplexityResult",
    "corpus_text",
    "corpus_tokens",
    "evaluate",
    "parse_method_spec",
    "perplexity",
    "plot_perplexity_vs_density",
    "plot_throughput_vs_perplexity",
    "sweep",
]
