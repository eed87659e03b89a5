"""Shared figure plumbing for every study's probes: matplotlib's pyplot on the Agg backend (no
display needed) and one way to save a figure."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, rect: tuple[float, float, float, float] | None = None) -> Path:
    """Lay out ``fig`` (within ``rect``, figure fractions ``(left, bottom, right, top)``: room left for a figure
    legend), write it to ``path`` (PNG, 110 dpi), close it and return the path."""
    path = Path(path)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
