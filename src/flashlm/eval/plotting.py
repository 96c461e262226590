"""Saving figures: one home for how flashlm writes a plot (PNG, atomic, no pyplot state)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def save_figure(figure: Figure, path: str | os.PathLike) -> Path:
    """Render `figure` (a `matplotlib.figure.Figure`, never pyplot: no global backend or state is
    touched) to `path` as PNG, written under a temporary name and renamed into place."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        figure.savefig(tmp, dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
