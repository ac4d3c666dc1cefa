"""Matplotlib without a display (Agg), and the two ways a figure leaves: a file or a data URI.

Every figure of a report goes through `save_figure` (PNG file) or `figure_data_uri` (PNG bytes
inlined as `data:image/png;base64,...`, so an HTML page needs nothing beside it). Both close
the figure, so a long report never holds more than one open.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

DPI = 100


def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any, target: Any, dpi: int) -> None:
    plt = pyplot()
    try:
        fig.savefig(target, format="png", dpi=dpi)
    finally:
        plt.close(fig)


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    path = Path(path)
    _png(fig, path, dpi)
    return path


def figure_data_uri(fig: Any, dpi: int = DPI) -> str:
    buf = io.BytesIO()
    _png(fig, buf, dpi)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def file_data_uri(path: str | Path) -> str:
    """A PNG file already written (e.g. a simulation's allocation.png) as a data URI."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")
