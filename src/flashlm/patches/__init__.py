"""The sparse MLP modules that replace a model's MLPs."""

from .streaming import StreamingMLP

__all__ = ["StreamingMLP"]
