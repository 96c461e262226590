"""Compute operators of the streamed MLPs that torch does not serve well on every CPU."""

from .columns import ColumnProduct

__all__ = ["ColumnProduct"]
