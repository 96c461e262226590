"""Compute operators of the streamed MLPs that torch does not serve well on every CPU."""

from .columns import ColumnProduct, RowProduct

__all__ = ["ColumnProduct", "RowProduct"]
