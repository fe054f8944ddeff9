"""Figures as files: matplotlib without a display, and every figure saved as PNG, PDF and SVG side by side with
one legend below its panels. Shared by the evaluation plots (evaluate/) and the layer-score plot (surgery/)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from ..extras import require

require("Drawing figures", "plots")
import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

FORMATS = (".png", ".pdf", ".svg")

__all__ = ["FORMATS", "plt", "save_figure"]


def save_figure(figure, path: Path, legend_columns: int | None = None, formats: tuple[str, ...] = FORMATS) -> Path:
    """The figure as PNG, PDF and SVG beside each other (`path` names the first of `formats`); the legend below the
    panels, in `legend_columns` columns (None: as many as fit the width)."""
    _figure_legend(figure, legend_columns)
    path = Path(path)
    for suffix in formats:
        figure.savefig(path.with_suffix(suffix), dpi=150)
    plt.close(figure)
    return path.with_suffix(formats[0])


def _figure_legend(figure, columns: int | None = None) -> None:
    """One legend for all panels, outside them (a legend inside an axis covers some data sooner or later)."""
    entries: dict = {}
    for axis in figure.axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        columns = columns or min(len(entries), 4, max(1, round(figure.get_figwidth() / 2.5)))  # as fit the width
        width = int(figure.get_figwidth() * 14 / columns)  # characters of 8-point text a column holds, about
        labels = [textwrap.fill(label, width, subsequent_indent="  ") for label in entries]
        figure.legend(entries.values(), labels, loc="outside lower center", ncols=columns, fontsize=8, frameon=False)
