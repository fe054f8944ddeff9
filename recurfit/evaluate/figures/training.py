"""The figure of training runs' logs: training loss against steps and FLOPs, validation loss per r and store."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import cycle
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from ...io.figures import save_figure
from ...io.runs import read_log, validation_losses
from .axes import flops_axis_label, log_flops_axis, panel_grid, paper_axis_flops, run_name


def plot_training(runs: Sequence[Path], path: Path, paper_tokens_per_step: int | None = None) -> Path:
    """Training loss against optimizer steps and against training FLOPs; validation loss per r if logged, one
    panel per validation store. `paper_tokens_per_step`: the FLOPs axis as the paper's (`paper_axis_flops`)."""
    logs = {run_name(run): read_log(run) for run in runs}
    validation = {name: _validation_series(records) for name, records in logs.items()}
    stores = list(dict.fromkeys(store for series in validation.values() for store in series))
    figure, axes = panel_grid(2 + len(stores), "Training and validation loss")
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
    log_flops_axis(axes[1].xaxis)
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
