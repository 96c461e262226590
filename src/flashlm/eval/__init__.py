"""Evaluation: perplexity on offline corpora (`flashlm.data.corpora`), sweeps over methods and
densities, decode benchmarks.

- `flashlm.eval.perplexity`: `perplexity(model, ids)`, `evaluate(model_path, corpus, ...)`,
  `PerplexityResult` (method specs: `flashlm.methods.specs`).
- `flashlm.eval.sweep`: `sweep(...)` (CSV + the DIP paper's Fig. 8), `plot_throughput_vs_perplexity`.
- `flashlm.eval.decode`: decode throughput of one configuration in a subprocess (benchmarks).
"""

from __future__ import annotations

from ..data.corpora import CORPORA, corpus_text, corpus_tokens
from .perplexity import PerplexityResult, evaluate, perplexity
from .sweep import plot_perplexity_vs_density, plot_throughput_vs_perplexity, sweep

__all__ = [
    "CORPORA",
    "PerplexityResult",
    "corpus_text",
    "corpus_tokens",
    "evaluate",
    "perplexity",
    "plot_perplexity_vs_density",
    "plot_throughput_vs_perplexity",
    "sweep",
]
