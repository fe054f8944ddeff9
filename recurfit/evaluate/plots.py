"""Figures for a paper (matplotlib) from sweep results and training logs (`recurfit plot`).

    KIND_recurrence  each metric against test recurrence; the parent and random chance as horizontal lines
    KIND_flops       each metric against inference FLOPs per token (effective depth); the parent as a point
    training         training loss against steps and FLOPs; validation loss per r and store, if logged
    KIND_over_training, KIND_final, KIND_final_bars, KIND_table.md: evaluations of runs (run_figures.py)

(KIND is `loss` or `tasks`; `recurfit eval` writes the first two for its own results as recurrence and flops.)
Every figure is written as PNG, PDF and SVG side by side. Axes keep every point and label inside their limits,
show tick labels on every axis (FLOPs in engineering units), and share one legend placed below the panels, where
it covers no data. Task scores carry ±1 binomial standard error bars, sqrt(p(1 - p) / n) over the n documents
scored, when the results record n.

Several results files or runs are overlaid, each named as `run_name` names it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import cycle
from pathlib import Path, PurePath

from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator, NullLocator

from ..errors import RecurfitError
from ..io.figures import FORMATS, plt, save_figure
from ..train.metrics import read_log, validation_losses
from .results import Sweep

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


def _grid(count: int, title: str):
    columns = min(count, 3)
    rows = -(-count // columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(5 * columns, 3.8 * rows + 0.8), squeeze=False, layout="constrained"
    )
    for extra in axes.flat[count:]:
        extra.set_visible(False)
    figure.suptitle(title)
    return figure, list(axes.flat[:count])


def _metric_label(metric: str) -> str:
    return {"loss": "validation loss (nats/token)", "perplexity": "perplexity"}.get(metric, metric)


def _panel_title(sweep: Sweep, metric: str) -> str:
    """The metric and what it was measured on: the data (loss) or the number of documents (a task)."""
    if metric in LOSS_METRICS:
        data = sweep.details.get("data")
        return f"{metric} on {data}" if data else metric
    documents = sweep.details.get("documents", {}).get(metric)
    return f"{metric}, {documents} documents" if documents else metric


def _stderr(sweep: Sweep, metric: str, values: Sequence[float]) -> list[float] | None:
    """±1 binomial standard error of each score over the documents scored; None for a loss or unknown n."""
    documents = sweep.details.get("documents", {}).get(metric)
    if metric in LOSS_METRICS or not documents:
        return None
    return [math.sqrt(max(p * (1 - p), 0.0) / documents) for p in values]


def _draw(axis, xs, ys, errors, **style) -> None:
    if errors is None:
        axis.plot(xs, ys, **style)
    else:
        axis.errorbar(xs, ys, yerr=errors, capsize=3, **style)


def plot_recurrence(sweeps: Sequence[Sweep], path: Path) -> Path:
    """Each metric against test recurrence r (log₂ axis), one line per model; the parent dashed, chance dotted."""
    metrics = _shared_metrics(sweeps)
    kind = "Validation loss" if sweeps[0].kind == "loss" else "Task scores"
    figure, axes = _grid(len(metrics), f"{kind} against test-time recurrence")
    depths = sorted({row.steps for sweep in sweeps for row in sweep.rows if row.steps is not None}) or [1]
    if len(depths) == 1:  # an axis needs two ticks to read
        depths.append(2 * depths[0])
    for axis, metric in zip(axes, metrics):
        for sweep in sweeps:
            recurrent = [row for row in sweep.rows if row.steps is not None and metric in row.metrics]
            if recurrent:
                ys = [row.metrics[metric] for row in recurrent]
                _draw(
                    axis,
                    [row.steps for row in recurrent],
                    ys,
                    _stderr(sweep, metric, ys),
                    marker="o",
                    label=run_name(sweep.model),
                )
            elif metric in sweep.rows[0].metrics:  # a fixed-depth model: one value whatever r
                axis.axhline(sweep.rows[0].metrics[metric], label=run_name(sweep.model))
        for row, style in _references(sweeps, metric):
            axis.axhline(row.metrics[metric], label=row.label, **REFERENCE_STYLES[style])
        _note_equal_lines(axis, sweeps, metric)
        axis.set_title(_panel_title(sweeps[0], metric), fontsize=9)
        axis.set_xscale("log", base=2)
        axis.set_xlim(depths[0] / 1.4, depths[-1] * 1.4)  # room for the end markers
        axis.set_xticks(depths, [f"{r:g}" for r in depths])
        axis.xaxis.set_minor_locator(NullLocator())
        _finish_metric_axis(axis, metric, "test recurrence r (core iterations)")
    return save_figure(figure, path)


def plot_flops(sweeps: Sequence[Sweep], path: Path) -> Path:
    """Each metric against inference FLOPs per token: what a point of accuracy costs in compute."""
    metrics = _shared_metrics(sweeps)
    kind = "Validation loss" if sweeps[0].kind == "loss" else "Task scores"
    figure, axes = _grid(len(metrics), f"{kind} against inference compute")
    for axis, metric in zip(axes, metrics):
        for sweep in sweeps:
            rows = [row for row in sweep.rows if row.flops_per_token and metric in row.metrics]
            ys = [row.metrics[metric] for row in rows]
            _draw(
                axis,
                [row.flops_per_token for row in rows],
                ys,
                _stderr(sweep, metric, ys),
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
        for row, _ in _references(sweeps, metric, chance=False):
            axis.plot(
                [row.flops_per_token],
                [row.metrics[metric]],
                marker="*",
                markersize=12,
                color="black",
                linestyle="none",
                label=row.label,
            )
        axis.set_title(_panel_title(sweeps[0], metric), fontsize=9)
        _log_flops_axis(axis.xaxis, right_room=1.35)  # the r= labels sit right of their points
        _finish_metric_axis(axis, metric, "inference FLOPs per token\n(2 × effective parameters; M = 10⁶, G = 10⁹)")
    return save_figure(figure, path)


def _log_flops_axis(axis, right_room: float = 1.15) -> None:
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


def _finish_metric_axis(axis, metric: str, xlabel: str) -> None:
    """Scores (accuracies) start at 0, with room below so a zero score is a whole marker; labels and grid."""
    if metric not in LOSS_METRICS:  # so that an all-zero task reads as zero, not as a flat mystery
        top = max(0.05, axis.get_ylim()[1])
        axis.set_ylim(bottom=-0.05 * top, top=1.03 * top)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(_metric_label(metric))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.grid(alpha=0.3)


def _note_equal_lines(axis, sweeps: Sequence[Sweep], metric: str) -> None:
    """Lines drawn on top of each other (the parent, chance and a flat data line, all at 0 %) read as one: name
    them, with their common value, just above it at the panel's right edge."""
    levels: dict[float, list[str]] = {}
    for sweep in sweeps:
        values = {row.metrics[metric] for row in sweep.rows if row.steps is not None and metric in row.metrics}
        if len(values) == 1:
            levels.setdefault(round(values.pop(), 9), []).append(run_name(sweep.model))
    for row, _ in _references(sweeps, metric):
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


def _references(sweeps: Sequence[Sweep], metric: str, chance: bool = True):
    """The parent (line style "--") and chance (":") rows that have `metric`, each distinct one once: sweeps
    compared against the same parent share one line."""
    seen = set()
    for sweep in sweeps:
        for row, style in ((sweep.parent, "--"), (sweep.chance if chance else None, ":")):
            if row is not None and metric in row.metrics and (row.label, row.metrics[metric]) not in seen:
                seen.add((row.label, row.metrics[metric]))
                yield row, style


def _shared_metrics(sweeps: Sequence[Sweep]) -> list[str]:
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


def plot_training(runs: Sequence[Path], path: Path, paper_tokens_per_step: int | None = None) -> Path:
    """Training loss against optimizer steps and against training FLOPs; validation loss per r if logged, one
    panel per validation store. `paper_tokens_per_step`: the FLOPs axis as the paper's (`paper_axis_flops`)."""
    logs = {run_name(run): read_log(run) for run in runs}
    validation = {name: _validation_series(records) for name, records in logs.items()}
    stores = list(dict.fromkeys(store for series in validation.values() for store in series))
    figure, axes = _grid(2 + len(stores), "Training and validation loss")
    for color, (name, records) in zip(cycle(f"C{i}" for i in range(10)), logs.items()):
        train = [record for record in records if record.get("kind") == "train"]
        axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], color=color, label=name)
        # The paper's accounting, as its figures' FLOPs axes (logs written before it have only `flops`).
        flops = [paper_axis_flops(r, paper_tokens_per_step) for r in train]
        axes[1].plot(flops, [r["loss"] for r in train], color=color, label=name)
        for axis, store in zip(axes[2:], stores):
            _plot_validation(axis, name, color, validation[name].get(store, {}))
    axes[0].set_title("training loss by step", fontsize=9)
    axes[0].set_xlabel("optimizer step")
    axes[1].set_title("training loss by compute", fontsize=9)
    axes[1].set_xlabel(flops_axis_label(paper_tokens_per_step) + " (G = 10⁹, T = 10¹²)")
    _log_flops_axis(axes[1].xaxis)
    for axis in axes[:2]:
        axis.set_ylabel("training loss (nats/token)")
    for axis, store in zip(axes[2:], stores):
        axis.set_title(f"validation loss on {store} (fainter: smaller r)", fontsize=9)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("validation loss (nats/token)")
    for axis in axes:
        axis.grid(alpha=0.3)
        if axis is not axes[1]:
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: 5, 10, 15 rather than 2.5, 7.5
    return save_figure(figure, path)


def _validation_series(records: list[dict]) -> dict[str, dict[int | None, list[tuple[int, float]]]]:
    """store -> test recurrence (None for a fixed-depth model) -> [(step, loss)] from a run's eval records."""
    series: dict = {}
    for record in records:
        if record.get("kind") == "eval":
            for store, losses in validation_losses(record).items():
                for r, loss in losses.items():
                    series.setdefault(store, {}).setdefault(r, []).append((record["step"], loss))
    return series


def _plot_validation(axis, run: str, color: str, by_r: dict[int | None, list[tuple[int, float]]]) -> None:
    """One line per test recurrence in the run's colour, fading towards r = 1."""
    for rank, (r, points) in enumerate(sorted(by_r.items(), key=lambda item: item[0] or 0)):
        alpha = 0.3 + 0.7 * (rank + 1) / len(by_r)
        axis.plot(*zip(*points), marker=".", color=color, alpha=alpha, label=run + ("" if r is None else f" r={r}"))


def plot_paths(paths: Sequence[str | Path], out: Path, paper_tokens_per_step: int | None = None) -> list[Path]:
    """Figures for a mix of results files (or folders holding `results.json`) and training runs: every file written.
    `paper_tokens_per_step` draws the training-FLOPs axes as the paper's figures count them (`paper_axis_flops`)."""
    from .over_training import RunEvaluation, is_run_evaluation
    from .run_figures import plot_runs

    sweeps, runs, evaluations = [], [], []
    for raw in paths:
        path = Path(raw)
        if is_run_evaluation(path):
            evaluations.append(RunEvaluation.load(path))
        elif (path / "log.jsonl").is_file() or path.name == "log.jsonl":
            runs.append(path if path.is_dir() else path.parent)
        elif (path / "results.json").is_file() or path.suffix == ".json":
            sweeps.append(Sweep.load(path / "results.json" if path.is_dir() else path))
        else:
            raise RecurfitError(
                f"{path} is neither a training run (a folder with log.jsonl), a results file (results.json from "
                "`recurfit eval loss|tasks MODEL`) nor an evaluation of a run (`recurfit eval loss|tasks RUN`)."
            )
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in ("loss", "tasks"):
        group = [s for s in sweeps if s.kind == kind]
        if group:
            written.append(plot_recurrence(group, out / f"{kind}_recurrence.png"))
            written.append(plot_flops(group, out / f"{kind}_flops.png"))
    if runs:
        written.append(plot_training(runs, out / "training.png", paper_tokens_per_step))
    drawn = plot_runs(evaluations, out, paper_tokens_per_step) if evaluations else []
    written += [path for path in drawn if path.suffix == ".png"]
    tables = [path for path in drawn if path.suffix == ".md"]
    return [png.with_suffix(suffix) for png in written for suffix in FORMATS] + tables
