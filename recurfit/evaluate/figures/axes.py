"""What every figure shares: the panel grid, axis labels and titles, error bars, the parent and chance lines,
the log FLOPs axis, and how a run or model is named. Public, so each kind of figure draws with the same parts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path, PurePath

from matplotlib.ticker import EngFormatter, FuncFormatter, NullLocator

from ...io.figures import plt
from ..results import Sweep

# The parent (--) and chance (:) lines: thin and above the data, dashed out of phase with each other, so that a
# data line, the parent and chance at one value (all at 0 % on a task the models cannot do) all stay visible.
REFERENCE_STYLES = {
    "--": {"color": "black", "linestyle": (0, (6, 6)), "linewidth": 1.0, "zorder": 3},
    ":": {"color": "grey", "linestyle": (6, (2, 2, 2, 6)), "linewidth": 1.0, "zorder": 3},
}
LOSS_METRICS = ("loss", "perplexity")


def run_name(name: str | Path) -> str:
    """How legends name a model or training run: `runs/NAME/final` and the run folder `runs/NAME` are both NAME,
    so an evaluated model and its training curves carry one name; a Hub id or label stays as it is."""
    path = PurePath(str(name).rstrip("/"))
    if path.name == "final" and len(path.parts) > 1:
        path = path.parent
    return path.name or str(name)


def kind_title(kind: str) -> str:
    """What a figure of `loss` or `tasks` results shows, for its title."""
    return "Validation loss" if kind == "loss" else "Task scores"


def recurrence_ticks(depths) -> list[int]:
    """The test recurrences evaluated (None, a fixed depth, left out), sorted: at least two, for an axis to read."""
    ticks = sorted({r for r in depths if r is not None}) or [1]
    if len(ticks) == 1:
        ticks.append(2 * ticks[0])
    return ticks


def recurrence_axis(axis, ticks: list[int]) -> None:
    """A log₂ x axis of test recurrence, labelled at each r of `ticks`, with room for the end markers."""
    axis.set_xscale("log", base=2)
    axis.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)
    axis.set_xticks(ticks, [f"{r:g}" for r in ticks])
    axis.xaxis.set_minor_locator(NullLocator())


def panel_grid(count: int, title: str):
    columns = min(count, 3)
    rows = -(-count // columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(5 * columns, 3.8 * rows + 0.8), squeeze=False, layout="constrained"
    )
    for extra in axes.flat[count:]:
        extra.set_visible(False)
    figure.suptitle(title)
    return figure, list(axes.flat[:count])


def metric_label(metric: str) -> str:
    return {"loss": "validation loss (nats/token)", "perplexity": "perplexity"}.get(metric, metric)


def panel_title(sweep: Sweep, metric: str) -> str:
    """The metric and what it was measured on: the data (loss) or the number of documents (a task)."""
    if metric in LOSS_METRICS:
        data = sweep.details.get("data")
        return f"{metric} on {data}" if data else metric
    documents = sweep.details.get("documents", {}).get(metric)
    return f"{metric}, {documents} documents" if documents else metric


def standard_errors(sweep: Sweep, metric: str, values: Sequence[float]) -> list[float] | None:
    """±1 binomial standard error of each score over the documents scored; None for a loss or unknown n."""
    documents = sweep.details.get("documents", {}).get(metric)
    if metric in LOSS_METRICS or not documents:
        return None
    return [math.sqrt(max(p * (1 - p), 0.0) / documents) for p in values]


def draw_series(axis, xs, ys, errors, **style) -> None:
    if errors is None:
        axis.plot(xs, ys, **style)
    else:
        axis.errorbar(xs, ys, yerr=errors, capsize=3, **style)


def log_flops_axis(axis, right_room: float = 1.15) -> None:
    """A log axis of FLOPs with at least two labelled ticks (1, 2, 5 × 10ⁿ, or every digit when the data span
    less than a decade: matplotlib's log locator alone leaves a narrow range without any label)."""
    axis.axes.set_xscale("log") if axis is axis.axes.xaxis else axis.axes.set_yscale("log")
    low, high = axis.get_data_interval()
    low = low if low > 0 else axis.get_minpos()  # a log axis ignores the zero FLOPs before the first step
    low, high = low / 1.15, high * right_room
    if high / low < 4:  # widen around the middle so that at least two ticks fall inside
        middle, half = math.sqrt(low * high), 2.0
        low, high = min(low, middle / half), max(high, middle * half)
    for digits in ((1, 2, 5), range(1, 10)):
        ticks = [
            m * 10.0**e
            for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
            for m in digits
            if low <= m * 10.0**e <= high
        ]
        if len(ticks) >= 2:
            break
    axis.set_view_interval(low, high, ignore=True)
    axis.set_ticks(ticks)
    axis.set_major_formatter(EngFormatter(places=0, sep=" "))  # 200 M, 1 G: short enough not to collide
    axis.set_minor_locator(NullLocator())


def finish_metric_axis(axis, metric: str, xlabel: str) -> None:
    """Scores (accuracies) start at 0, with room below so a zero score is a whole marker; labels and grid."""
    if metric not in LOSS_METRICS:  # so that an all-zero task reads as zero, not as a flat mystery
        top = max(0.05, axis.get_ylim()[1])
        axis.set_ylim(bottom=-0.05 * top, top=1.03 * top)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(metric_label(metric))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.grid(alpha=0.3)


def references(sweeps: Sequence[Sweep], metric: str, chance: bool = True):
    """The parent (line style "--") and chance (":") rows that have `metric`, each distinct one once: sweeps
    compared against the same parent share one line."""
    seen = set()
    for sweep in sweeps:
        for row, style in ((sweep.parent, "--"), (sweep.chance if chance else None, ":")):
            if row is not None and metric in row.metrics and (row.label, row.metrics[metric]) not in seen:
                seen.add((row.label, row.metrics[metric]))
                yield row, style


def shared_metrics(sweeps: Sequence[Sweep]) -> list[str]:
    """The metrics to draw: every one that some sweep has, perplexity left out (it repeats the loss); of a task
    sweep, each task's headline metric only (the paper's)."""
    seen: list[str] = []
    for sweep in sweeps:
        shown = sweep.details.get("headline") or sweep.metrics
        seen += [m for m in shown if m not in seen and m != "perplexity"]
    return seen


def paper_axis_flops(record: dict, tokens_per_step: int | None) -> float:
    """A log or training record's `flops_paper` (its `flops` in logs written before it), or, given
    `tokens_per_step`, that count as the paper's plots took it: every step at `tokens_per_step` tokens (their
    `get_flops`: 2²⁰ for every run, whatever its batch) instead of the run's own `batch.global × seq_len`."""
    flops = record.get("flops_paper", record.get("flops")) or 0.0
    if tokens_per_step is None or not record.get("tokens"):
        return flops
    return flops * tokens_per_step * record["step"] / record["tokens"]  # the run's steps are all the same size


def flops_axis_label(tokens_per_step: int | None) -> str:
    if tokens_per_step is None:
        return "training FLOPs, the paper's accounting"
    return f"training FLOPs, the paper's accounting at {tokens_per_step:,} tokens per step, as its figures"
