"""Figures the tools write (matplotlib, headless): one way to open and save them."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed: servers, CI, log files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Lay out, write the PNG (creating its folder) and free the figure."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    fig.clear()
    pyplot().close(fig)
    return out
