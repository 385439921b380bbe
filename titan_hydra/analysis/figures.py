"""The one way a report draws a figure: matplotlib's Agg backend (no display), then a tight layout,
the PNG, and the figure closed so a long report does not hold every figure in memory.

matplotlib is imported here, when a figure is drawn, not when a report module is imported: a
sweep's tables and a fit's JSON need no plotting library.
"""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only; a headless node has no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def subplots(nrows: int = 1, ncols: int = 1, **kwargs):
    """(figure, axes) as ``plt.subplots`` makes them, on the Agg backend."""
    return pyplot().subplots(nrows, ncols, **kwargs)


def save(fig, path: str | Path, dpi: int = 100) -> Path:
    """Lay ``fig`` out tightly, write it to ``path`` as PNG and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)


def interval_bar(value: float, interval) -> list[list[float]]:
    """``errorbar``'s ``yerr`` from ``value`` to the ends of its interval. A bootstrap interval need
    not contain the full data's fit, and matplotlib refuses a negative bar: that side is drawn 0."""
    lo, hi = interval
    return [[max(0.0, value - lo)], [max(0.0, hi - value)]]
