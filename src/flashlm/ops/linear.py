"""`linear_in_dtype`: `F.linear` in the activations' dtype, for weights that keep their store's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_in_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in `x`'s dtype. A model loaded in another dtype than its store's
    (float32 over a bf16 store) multiplies the weights converted, as transformers does with its upcast
    weights, which hold the same values. In the store's dtype the weights are used as they are: the
    check is one comparison in Python, no conversion call on the decode path."""
    if weight.dtype != x.dtype:
        weight, bias = weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)
