"""`RowFile`: where one `[rows, width]` matrix of a store lies on disk (the reader's view of a store)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

ALIGNMENT = 4096
"""Byte alignment of every matrix's first row in a store file (O_DIRECT needs block-aligned reads)."""


def whole_blocks(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of `ALIGNMENT`."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


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

    @property
    def read_amplification(self) -> float:
        """Bytes a read of one row alone moves off the disk (whole 4 KiB pages), per row byte.

        1.0 for page-aligned rows of whole pages; about 4.4 for SmolLM2's 1152-byte down columns,
        most of which sit inside one page and some across two.
        """
        if self.rows == 0:
            return 1.0
        starts = self.data_offset + torch.arange(self.rows, dtype=torch.int64) * self.row_bytes
        pages = (starts + self.row_bytes - 1) // ALIGNMENT - starts // ALIGNMENT + 1
        return int(pages.sum()) * ALIGNMENT / self.nbytes
