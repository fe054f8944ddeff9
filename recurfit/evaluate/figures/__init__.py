"""Figures for a paper (matplotlib) from sweep results, training logs and evaluations of runs (`recurfit plot`).

    KIND_recurrence      each metric against test recurrence; the parent and random chance as horizontal lines
    KIND_flops           each metric against inference FLOPs per token (effective depth); the parent as a point
    training             training loss against steps and FLOPs; validation loss per r and store, if logged
    KIND_over_training   each metric against training FLOPs (the paper's accounting), one line per run, every
                         snapshot at the run's snapshot recurrence (Figs. 2 right, 5-8 left)
    KIND_final           each metric against test recurrence for the last model of each recurrent run; fixed-depth
                         runs and the parent as horizontal lines; inference FLOPs per token on the top axis
                         (the right panels)
    tasks_final_bars     the last model of each run per task, at its largest test recurrence (Fig. 9)
    KIND_table.md        Table 1's layout: a row per run and test recurrence, a column per metric

KIND is `loss` or `tasks`; `recurfit eval` writes the first two for its own results. Every figure is written as
PNG, PDF and SVG side by side. Axes keep every point and label inside their limits, show tick labels on every
axis (FLOPs in engineering units), and share one legend placed below the panels, where it covers no data. Task
scores carry ±1 binomial standard error bars, sqrt(p(1 - p) / n) over the n documents scored, when the results
record n. Several results files or runs are overlaid, each named as `run_name` names it.

axes.py      the parts every figure shares: panel grid, labels, error bars, parent and chance lines, FLOPs axes
sweeps.py    KIND_recurrence and KIND_flops, from results files
training.py  training, from run folders' log.jsonl
runs.py      KIND_over_training, KIND_final, tasks_final_bars and KIND_table.md, from evaluations of runs
paths.py     `recurfit plot PATH…`: which of these a mix of paths gets
lens.py      `recurfit lens`'s figure: each token's top prediction and KL at every step, the exit rules' steps
"""

from ...extras import require

require("Drawing figures", "plots")  # before the modules below import matplotlib
from .axes import paper_axis_flops, run_name  # noqa: E402
from .paths import plot_paths  # noqa: E402
from .runs import final_table, plot_runs, run_labels  # noqa: E402
from .sweeps import plot_flops, plot_recurrence  # noqa: E402
from .training import plot_training  # noqa: E402

__all__ = [
    "final_table",
    "paper_axis_flops",
    "plot_flops",
    "plot_paths",
    "plot_recurrence",
    "plot_runs",
    "plot_training",
    "run_labels",
    "run_name",
]
