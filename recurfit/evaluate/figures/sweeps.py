"""Figures of results files (`recurfit eval loss|tasks MODEL`): each metric against test recurrence, and against
inference FLOPs per token."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.ticker import NullLocator

from ...io.figures import save_figure
from ..results import Sweep
from .axes import (
    REFERENCE_STYLES,
    draw_series,
    finish_metric_axis,
    log_flops_axis,
    panel_grid,
    panel_title,
    references,
    run_name,
    shared_metrics,
    standard_errors,
)


def plot_recurrence(sweeps: Sequence[Sweep], path: Path) -> Path:
    """Each metric against test recurrence r (log₂ axis), one line per model; the parent dashed, chance dotted."""
    metrics = shared_metrics(sweeps)
    kind = "Validation loss" if sweeps[0].kind == "loss" else "Task scores"
    figure, axes = panel_grid(len(metrics), f"{kind} against test-time recurrence")
    depths = sorted({row.steps for sweep in sweeps for row in sweep.rows if row.steps is not None}) or [1]
    if len(depths) == 1:  # an axis needs two ticks to read
        depths.append(2 * depths[0])
    for axis, metric in zip(axes, metrics):
        for sweep in sweeps:
            recurrent = [row for row in sweep.rows if row.steps is not None and metric in row.metrics]
            if recurrent:
                ys = [row.metrics[metric] for row in recurrent]
                draw_series(
                    axis,
                    [row.steps for row in recurrent],
                    ys,
                    standard_errors(sweep, metric, ys),
                    marker="o",
                    label=run_name(sweep.model),
                )
            elif metric in sweep.rows[0].metrics:  # a fixed-depth model: one value whatever r
                axis.axhline(sweep.rows[0].metrics[metric], label=run_name(sweep.model))
        for row, style in references(sweeps, metric):
            axis.axhline(row.metrics[metric], label=row.label, **REFERENCE_STYLES[style])
        _note_equal_lines(axis, sweeps, metric)
        axis.set_title(panel_title(sweeps[0], metric), fontsize=9)
        axis.set_xscale("log", base=2)
        axis.set_xlim(depths[0] / 1.4, depths[-1] * 1.4)  # room for the end markers
        axis.set_xticks(depths, [f"{r:g}" for r in depths])
        axis.xaxis.set_minor_locator(NullLocator())
        finish_metric_axis(axis, metric, "test recurrence r (core iterations)")
    return save_figure(figure, path)


def plot_flops(sweeps: Sequence[Sweep], path: Path) -> Path:
    """Each metric against inference FLOPs per token: what a point of accuracy costs in compute."""
    metrics = shared_metrics(sweeps)
    kind = "Validation loss" if sweeps[0].kind == "loss" else "Task scores"
    figure, axes = panel_grid(len(metrics), f"{kind} against inference compute")
    for axis, metric in zip(axes, metrics):
        for sweep in sweeps:
            rows = [row for row in sweep.rows if row.flops_per_token and metric in row.metrics]
            ys = [row.metrics[metric] for row in rows]
            draw_series(
                axis,
                [row.flops_per_token for row in rows],
                ys,
                standard_errors(sweep, metric, ys),
                marker="o",
                label=run_name(sweep.model),
            )
            for row in rows:
                if row.steps is not None:
                    axis.annotate(
                        f"r={row.steps}",
                        (row.flops_per_token, row.metrics[metric]),
                        fontsize=7,
                        textcoords="offset points",
                        xytext=(4, 4),
                    )
        for row, _ in references(sweeps, metric, chance=False):
            axis.plot(
                [row.flops_per_token],
                [row.metrics[metric]],
                marker="*",
                markersize=12,
                color="black",
                linestyle="none",
                label=row.label,
            )
        axis.set_title(panel_title(sweeps[0], metric), fontsize=9)
        log_flops_axis(axis.xaxis, right_room=1.35)  # the r= labels sit right of their points
        finish_metric_axis(axis, metric, "inference FLOPs per token\n(2 × effective parameters; M = 10⁶, G = 10⁹)")
    return save_figure(figure, path)


def _note_equal_lines(axis, sweeps: Sequence[Sweep], metric: str) -> None:
    """Lines drawn on top of each other (the parent, chance and a flat data line, all at 0 %) read as one: name
    them, with their common value, just above it at the panel's right edge."""
    levels: dict[float, list[str]] = {}
    for sweep in sweeps:
        values = {row.metrics[metric] for row in sweep.rows if row.steps is not None and metric in row.metrics}
        if len(values) == 1:
            levels.setdefault(round(values.pop(), 9), []).append(run_name(sweep.model))
    for row, _ in references(sweeps, metric):
        levels.setdefault(round(row.metrics[metric], 9), []).append(row.label)
    for value, labels in levels.items():
        if len(labels) > 1:
            axis.annotate(
                f"{', '.join(labels)}: all {value:g}",
                (0.99, value),
                xycoords=axis.get_yaxis_transform(),
                textcoords="offset points",
                xytext=(0, 3),
                ha="right",
                va="bottom",
                fontsize=7,
            )
