"""Selection: which units a token uses. Pure functions of tensors, as the DIP paper defines them.

Every function works on the last dimension and keeps the leading ones (tokens), so one call
selects for a whole batch: a boolean mask `[..., n]` says which of `n` units each token keeps.
"""

from __future__ import annotations

import torch

from ..ops import select


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the `k` largest `scores` of each row (the paper's per-token topK); equal scores are kept
    lowest index first, so the mask is a function of the scores (bf16 activations tie often)."""
    if not 0 <= k <= scores.shape[-1]:
        raise ValueError(f"k must be in [0, {scores.shape[-1]}], got {k}.")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, order, True)


def cache_aware_scores(x: torch.Tensor, resident: torch.Tensor, gamma: float) -> torch.Tensor:
    """DIP-CA's re-weighted magnitudes (eq. 10): `|x| (c + γ (1 - c)) / ||x||_inf`.

    `resident` (`c`, broadcast over tokens) marks the units in cache; units that would have to be
    read are penalized by `gamma`. The per-token normalization keeps scores comparable whatever the
    activations' dynamic range. `gamma = 1` ranks by `|x|` alone (plain DIP).
    """
    magnitude = x.abs().float()
    weight = torch.where(resident, 1.0, float(gamma)).to(magnitude.device)
    norm = magnitude.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return magnitude * weight / norm


def magnitude_topk(
    x: torch.Tensor, k: int, resident: torch.Tensor | None = None, gamma: float = 1.0
) -> torch.Tensor:
    """The `k` units of largest `|x|` per token, or with `resident` and `gamma < 1` of largest eq. 10
    score (DIP-CA): `topk_mask(cache_aware_scores(x, resident, gamma), k)` but for eq. 10's division
    by `max|x|`, which scales a whole row and so selects the same units.

    On the CPU a C radix select computes it (`flashlm.ops.select`); elsewhere, or without the C
    library, torch ops.
    """
    weighted = resident is not None and gamma != 1
    if x.dim() == 2:
        mask = select.topk_mask(x, k, resident if weighted else None, gamma)
        if mask is not None:
            return mask
    scores = x.abs().float()
    if weighted:
        scores = scores * torch.where(resident, 1.0, float(gamma)).to(scores.device)
    return topk_mask(scores, k)


def threshold_mask(values: torch.Tensor, threshold: float) -> torch.Tensor:
    """Keep the units whose magnitude exceeds `threshold` (per-layer or global thresholds, CATS)."""
    return values.abs() > threshold


def threshold_for_density(quantiles: torch.Tensor, keep: float) -> float:
    """The magnitude above which a fraction `keep` of values lie, from calibrated quantiles.

    `quantiles[i]` is the magnitude quantile at level `i / (len - 1)`; linear interpolation between
    levels, as `torch.quantile` does.
    """
    if not 0 <= keep <= 1:
        raise ValueError(f"keep must be in [0, 1], got {keep}.")
    position = (1 - keep) * (quantiles.numel() - 1)
    low = int(position)
    high = min(low + 1, quantiles.numel() - 1)
    frac = position - low
    return float(quantiles[low] * (1 - frac) + quantiles[high] * frac)


def union_ids(mask: torch.Tensor) -> torch.Tensor:
    """Sorted ids of the units any token keeps (`mask` is `[tokens, n]`)."""
    kept = mask.view(-1) if mask.shape[0] == 1 and mask.is_contiguous() else mask.any(dim=0)
    return kept.nonzero().view(-1)


def kept_pairs(mask: torch.Tensor, ids: torch.Tensor | None = None) -> int:
    """The (token, unit) pairs `mask` keeps. Given its `union_ids(mask)` and one token, their count, known
    on the host already, so a decode step spends no `mask.sum()` (a device sync on a GPU) on it."""
    return ids.numel() if ids is not None and mask.shape[0] == 1 else int(mask.sum())
