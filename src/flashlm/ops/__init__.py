"""Compute operators of the streamed MLPs that torch does not serve well on every CPU."""

from .columns import ColumnProduct, RowProduct, TokenColumns
from .linear import linear_in_dtype

__all__ = ["ColumnProduct", "RowProduct", "TokenColumns", "linear_in_dtype"]
