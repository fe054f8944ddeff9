"""PNG figures (matplotlib) from sweep results and training logs (`recurfit plot`).

    KIND_recurrence.png  each metric against test recurrence; the parent and random chance as horizontal lines
    KIND_flops.png       each metric against inference FLOPs per token (effective depth); the parent as a point
    training.png         training loss against steps and FLOPs; validation loss per r and store, if logged

(KIND is `loss` or `tasks`; `recurfit eval` writes the first two for its own results as recurrence.png and
flops.png.)

Several results files or runs are overlaid, each labelled with its model or run folder.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import cycle
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

from ..errors import RecurfitError  # noqa: E402
from ..train.metrics import read_log  # noqa: E402
from .results import Sweep  # noqa: E402

EVAL_KEY = re.compile(r"^(?P<data>.+)/loss(?:@(?P<r>\d+))?$")


def _grid(count: int, title: str):
    columns = min(count, 3)
    rows = -(-count // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4 * rows), squeeze=False)
    for extra in axes.flat[count:]:
        extra.set_visible(False)
    figure.suptitle(title)
    return figure, list(axes.flat[:count])


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _metric_label(metric: str) -> str:
    return {"loss": "validation loss (nats/token)", "perplexity": "perplexity"}.get(metric, metric)


def plot_recurrence(sweeps: Sequence[Sweep], path: Path) -> Path:
    """Each metric against test recurrence r (log₂ axis), one line per model; the parent dashed, chance dotted."""
    metrics = _shared_metrics(sweeps)
    figure, axes = _grid(len(metrics), "Metric vs test-time recurrence")
    for axis, metric in zip(axes, metrics):
        for sweep in sweeps:
            recurrent = [row for row in sweep.rows if row.steps is not None]
            if recurrent:
                axis.plot([row.steps for row in recurrent], [row.metrics[metric] for row in recurrent], marker="o",
                          label=sweep.model)  # fmt: skip
            else:  # a fixed-depth model: one value whatever r
                axis.axhline(sweep.rows[0].metrics[metric], label=sweep.model)
        for row, style in _references(sweeps, metric):
            axis.axhline(row.metrics[metric], linestyle=style, color="black" if style == "--" else "grey",
                         label=row.label)  # fmt: skip
        _finish_metric_axis(axis, metric, "test recurrence r (core iterations)", log_base=2)
    return _save(figure, path)


def plot_flops(sweeps: Sequence[Sweep], path: Path) -> Path:
    """Each metric against inference FLOPs per token: what a point of accuracy costs in compute."""
    metrics = _shared_metrics(sweeps)
    figure, axes = _grid(len(metrics), "Metric vs inference compute")
    for axis, metric in zip(axes, metrics):
        for sweep in sweeps:
            rows = [row for row in sweep.rows if row.flops_per_token]
            axis.plot([row.flops_per_token / 1e9 for row in rows], [row.metrics[metric] for row in rows],
                      marker="o", label=sweep.model)  # fmt: skip
            for row in rows:
                if row.steps is not None:
                    axis.annotate(f"r={row.steps}", (row.flops_per_token / 1e9, row.metrics[metric]), fontsize=7,
                                  textcoords="offset points", xytext=(3, 3))  # fmt: skip
        for row, _ in _references(sweeps, metric, chance=False):
            axis.plot([row.flops_per_token / 1e9], [row.metrics[metric]], marker="*", markersize=12,
                      linestyle="none", label=row.label)  # fmt: skip
        _finish_metric_axis(axis, metric, "inference GFLOPs per token (2 × eff. params)", log_base=10)
    return _save(figure, path)


def _finish_metric_axis(axis, metric: str, xlabel: str, log_base: int) -> None:
    """A log x axis with plain tick labels; scores (accuracies) start at 0; labels, grid, legend."""
    axis.set_xscale("log", base=log_base)
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 1, 2, 4 rather than 2⁰, 2¹
    axis.xaxis.set_minor_formatter(NullFormatter())
    if metric not in ("loss", "perplexity"):  # so that an all-zero task reads as zero, not as a flat mystery
        axis.set_ylim(bottom=0, top=max(0.05, axis.get_ylim()[1]))
    axis.set_xlabel(xlabel)
    axis.set_ylabel(_metric_label(metric))
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)


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


def plot_training(runs: Sequence[Path], path: Path) -> Path:
    """Training loss against optimizer steps and against training FLOPs; validation loss per r if logged, one
    panel per validation store."""
    logs = {Path(run).name: read_log(run) for run in runs}
    validation = {name: _validation_series(records) for name, records in logs.items()}
    stores = list(dict.fromkeys(store for series in validation.values() for store in series))
    figure, axes = _grid(2 + len(stores), "Training")
    for color, (name, records) in zip(cycle(f"C{i}" for i in range(10)), logs.items()):
        train = [record for record in records if record.get("kind") == "train"]
        axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], color=color, label=name)
        axes[1].plot([r["flops"] for r in train], [r["loss"] for r in train], color=color, label=name)
        for axis, store in zip(axes[2:], stores):
            _plot_validation(axis, name, color, validation[name].get(store, {}))
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("training FLOPs (from the depths drawn)")
    axes[1].set_xscale("log")
    for axis in axes[:2]:
        axis.set_ylabel("training loss (nats/token)")
    for axis, store in zip(axes[2:], stores):
        axis.set_title(f"validation: {store} (fainter: smaller r)", fontsize=10)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("validation loss (nats/token)")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    return _save(figure, path)


def _validation_series(records: list[dict]) -> dict[str, dict[int | None, list[tuple[int, float]]]]:
    """store -> test recurrence (None for a fixed-depth model) -> [(step, loss)] from a run's eval records."""
    series: dict = {}
    for record in records:
        if record.get("kind") != "eval":
            continue
        for key, value in record.items():
            match = EVAL_KEY.match(key)
            if match:
                r = int(match["r"]) if match["r"] else None
                series.setdefault(match["data"], {}).setdefault(r, []).append((record["step"], value))
    return series


def _plot_validation(axis, run: str, color: str, by_r: dict[int | None, list[tuple[int, float]]]) -> None:
    """One line per test recurrence in the run's colour, fading towards r = 1."""
    for rank, (r, points) in enumerate(sorted(by_r.items(), key=lambda item: item[0] or 0)):
        alpha = 0.3 + 0.7 * (rank + 1) / len(by_r)
        axis.plot(*zip(*points), marker=".", color=color, alpha=alpha,
                  label=run + ("" if r is None else f" r={r}"))  # fmt: skip


def plot_paths(paths: Sequence[str | Path], out: Path) -> list[Path]:
    """Figures for a mix of results files (or folders holding `results.json`) and training runs."""
    sweeps, runs = [], []
    for raw in paths:
        path = Path(raw)
        if (path / "log.jsonl").is_file() or path.name == "log.jsonl":
            runs.append(path if path.is_dir() else path.parent)
        elif (path / "results.json").is_file() or path.suffix == ".json":
            sweeps.append(Sweep.load(path / "results.json" if path.is_dir() else path))
        else:
            raise RecurfitError(
                f"{path} is neither a training run (a folder with log.jsonl) nor a results file "
                "(results.json from `recurfit eval loss|tasks`)."
            )
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in ("loss", "tasks"):
        group = [s for s in sweeps if s.kind == kind]
        if group:
            written.append(plot_recurrence(group, out / f"{kind}_recurrence.png"))
            written.append(plot_flops(group, out / f"{kind}_flops.png"))
    if runs:
        written.append(plot_training(runs, out / "training.png"))
    return written
