"""Figures of results files (`recurfit eval loss|tasks MODEL`): each metric against test recurrence, and against
inference FLOPs per token."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ...io.figures import save_figure
from ..results import Sweep
from .axes import (
    REFERENCE_STYLES,
    draw_series,
    finish_metric_axis,
    kind_title,
    log_flops_axis,
    panel_grid,
    panel_title,
    recurrence_axis,
    recurrence_ticks,
    references,
    run_name,
    shared_metrics,
    standard_errors,
)


def plot_recurrence(sweeps: Sequence[Sweep], path: Path) -> Path:
    """Each metric against test recurrence r (log₂ axis), one line per model; the parent dashed, chance dotted."""
    metrics = shared_metrics(sweeps)
    figure, axes = panel_grid(len(metrics), f"{kind_title(sweeps[0].kind)} against test-time recurrence")
    depths = recurrence_ticks(row.steps for sweep in sweeps for row in sweep.rows)
    for axis, metric in zip(axes, metrics):
        for sweep in sweeps:
            recurrent = [row for row in sweep.rows if row.steps is not None and metric in row.metrics]
            if recurrent:
                _draw_sweep(axis, sweep, metric, recurrent, [row.steps for row in recurrent])
            elif metric in sweep.rows[0].metrics:  # a fixed-depth model: one value whatever r
                axis.axhline(sweep.rows[0].metrics[metric], label=run_name(sweep.model))
        for row, style in references(sweeps, metric):
            axis.axhline(row.metrics[metric], label=row.label, **REFERENCE_STYLES[style])
        _note_equal_lines(axis, sweeps, metric)
        axis.set_title(panel_title(sweeps[0], metric), fontsize=9)
        recurrence_axis(axis, depths)
        finish_metric_axis(axis, metric, "test recurrence r (core iterations)")
    return save_figure(figure, path)


def plot_flops(sweeps: Sequence[Sweep], path: Path) -> Path:
    """Each metric against inference FLOPs per token: what a point of accuracy costs in compute."""
    metrics = shared_metrics(sweeps)
    figure, axes = panel_grid(len(metrics), f"{kind_title(sweeps[0].kind)} against inference compute")
    for axis, metric in zip(axes, metrics):
        for sweep in sweeps:
            rows = [row for row in sweep.rows if row.flops_per_token and metric in row.metrics]
            _draw_sweep(axis, sweep, metric, rows, [row.flops_per_token for row in rows])
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


def _draw_sweep(axis, sweep: Sweep, metric: str, rows, xs) -> None:
    """One model's line: `metric` of `rows` at `xs`, with error bars where the results give n."""
    ys = [row.metrics[metric] for row in rows]
    draw_series(axis, xs, ys, standard_errors(sweep, metric, ys), marker="o", label=run_name(sweep.model))


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
