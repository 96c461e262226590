"""The offline activation profile (PowerInfer §6.1): how often each neuron fires, per layer.

PowerInfer places neurons by their activation frequency on general text: a small set of "hot"
neurons fires for most tokens and is worth pinning in memory, the "cold" rest is loaded on demand
(`flashlm.cache.placement` decides which under a byte budget). The frequencies come from the same
label rule as the predictors' training data, so "active" means the same thing in both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from .labels import LabelRule, LayerSamples, collect_activations


def activation_frequency(collected: Sequence[LayerSamples | torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the share of token rows in which each neuron was active (float64 [d_ff] in [0, 1]).

    Each entry is a `LayerSamples` (its exact counts over every row seen, not only the kept sample)
    or a bool label matrix [n, d_ff] (its mean over rows). A layer that saw no rows has frequency 0.
    """
    frequencies = []
    for entry in collected:
        if isinstance(entry, LayerSamples):
            counts, rows = entry.active_counts.to(torch.float64), entry.rows_seen
        else:
            labels = entry.reshape(-1, entry.shape[-1])
            counts, rows = labels.sum(0, dtype=torch.float64), labels.shape[0]
        frequencies.append(counts / rows if rows else torch.zeros_like(counts))
    return frequencies


def profile_activations(
    model: nn.Module,
    batches: Iterable[torch.Tensor | Mapping[str, torch.Tensor]],
    *,
    rule: LabelRule | None = None,
    progress: bool = True,
) -> list[torch.Tensor]:
    """Run the dense `model` over `batches` and return every layer's activation frequency.

    Only counts are kept (no rows), so the profile can run over as many tokens as wanted
    (PowerInfer profiles about a million) in constant memory.
    """
    return activation_frequency(collect_activations(model, batches, rule=rule, max_rows=0, progress=progress))
