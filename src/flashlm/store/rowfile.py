"""`RowFile`: where one `[rows, width]` matrix of a store lies on disk (the reader's view of a store)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

ALIGNMENT = 4096
"""Byte alignment of every matrix's first row in a store file (O_DIRECT needs block-aligned reads)."""


@dataclass(frozen=True)
class RowFile:
    """A row-major `[rows, width]` matrix of `dtype` at byte `data_offset` of `path`.

    Row `i` occupies bytes `[data_offset + i * row_bytes, data_offset + (i + 1) * row_bytes)`.
    `data_offset` is a multiple of `ALIGNMENT`; rows need not be, so a direct read covers the
    aligned superset of the rows it wants and discards the rest.
    """

    path: Path
    data_offset: int
    rows: int
    width: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes
