"""The paper's figures from evaluations of several training runs (`recurfit plot EVAL_A EVAL_B …`).

Runs are named by their folders and by the settings in which their configs differ (a fixed-depth run as such),
so a legend says what is compared.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from matplotlib.ticker import EngFormatter, NullLocator

from ...io.figures import save_figure
from ...io.runs import flatten_settings
from ..over_training import RunEvaluation
from ..results import Row, table_cell
from .axes import (
    REFERENCE_STYLES,
    draw_series,
    finish_metric_axis,
    flops_axis_label,
    kind_title,
    panel_grid,
    panel_title,
    paper_axis_flops,
    recurrence_axis,
    recurrence_ticks,
    references,
    shared_metrics,
    standard_errors,
)

# Settings that say how a run ran, not what it is: never what a legend tells runs apart by.
INCIDENTAL = ("out", "log.", "checkpoint.", "snapshots.", "eval.", "compile", "precision", "distributed", "batch.micro")
MAX_LABEL_SETTINGS = 3


def _color(evaluations: Sequence[RunEvaluation], evaluation: RunEvaluation) -> str:
    """A run's colour, the same in every figure of one call."""
    return f"C{list(evaluations).index(evaluation) % 10}"


def run_labels(evaluations: Sequence[RunEvaluation]) -> dict[str, str]:
    """Legend names: the run's folder name, then (among recurrent runs) the settings in which it departs from the
    others: from the value most runs share, or, where no value is shared, every run's own; a fixed-depth run is
    marked as such. Ten arms of a study read `distill-s0 (alpha 0.5, temperature 2.0)`, the reference bare."""
    recurrent = [e for e in evaluations if e.recurrent]
    flat = {e.run: flatten_settings(e.config) for e in recurrent}
    keys = dict.fromkeys(key for settings in flat.values() for key in settings)
    usual = {}  # each differing setting's shared value (None: no value is shared, so every run shows its own)
    for key in keys:
        values = Counter(repr(settings.get(key)) for settings in flat.values())
        if not key.startswith(INCIDENTAL) and len(values) > 1:
            (value, count), *_ = values.most_common()
            usual[key] = value if count > 1 and list(values.values()).count(count) == 1 else None
    labels = {}
    for evaluation in evaluations:
        if not evaluation.recurrent:
            labels[evaluation.run] = f"{evaluation.run} (fixed depth)"
            continue
        settings = flat[evaluation.run]
        departs = [key for key, value in usual.items() if repr(settings.get(key)) != value]
        shown = [f"{key.rsplit('.', 1)[-1]} {_setting(settings.get(key))}" for key in departs[:MAX_LABEL_SETTINGS]]
        more = ", …" if len(departs) > MAX_LABEL_SETTINGS else ""
        labels[evaluation.run] = evaluation.run + (f" ({', '.join(shown)}{more})" if shown else "")
    return labels


def _legend_columns(figure) -> int | None:
    """One column when runs are named by their settings at length (side by side they would leave the figure)."""
    labels = [text for axis in figure.axes for text in axis.get_legend_handles_labels()[1]]
    return 1 if labels and max(map(len, labels)) * 0.07 + 0.6 > figure.get_figwidth() / 2 else None


def _setting(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, str) and "/" in value:  # a path (model.init_from, distill.teacher): its last part
        return Path(value).name
    return "none" if value is None else str(value)


def plot_runs(evaluations: Sequence[RunEvaluation], out: Path, paper_tokens_per_step: int | None = None) -> list[Path]:
    """The three figures and the table for each kind of evaluation among `evaluations`; the PNGs and tables.
    `paper_tokens_per_step`: the over-training figure's FLOPs axis as the paper's (`plot_over_training`)."""
    written = []
    for kind in ("loss", "tasks"):
        group = [e for e in evaluations if e.kind == kind]
        if group:
            labels = run_labels(group)
            over_training = out / f"{kind}_over_training.png"
            written.append(plot_over_training(group, labels, over_training, paper_tokens_per_step))
            written.append(plot_final(group, labels, out / f"{kind}_final.png"))
            if kind == "tasks":  # bars of accuracy from zero; a loss has no zero worth drawing from
                written.append(plot_final_bars(group, labels, out / f"{kind}_final_bars.png"))
            table = out / f"{kind}_table.md"
            table.write_text(final_table(group, labels))
            written.append(table)
    return written


def _metrics(evaluations: Sequence[RunEvaluation]) -> list[str]:
    return shared_metrics([e.final for e in evaluations])


def _kind(evaluations: Sequence[RunEvaluation]) -> str:
    return kind_title(evaluations[0].kind)


def plot_over_training(
    evaluations: Sequence[RunEvaluation],
    labels: dict[str, str],
    path: Path,
    paper_tokens_per_step: int | None = None,
) -> Path:
    """Each metric against the training FLOPs spent when each model was saved. With `paper_tokens_per_step`, the
    paper's axis instead: only the run's own steps, each at that many tokens (`paper_axis_flops`)."""
    metrics = _metrics(evaluations)
    figure, axes = panel_grid(len(metrics), f"{_kind(evaluations)} over training")
    for axis, metric in zip(axes, metrics):
        for evaluation in evaluations:
            points = [(s, evaluation.curve_row(s)) for s in evaluation.sweeps]
            points = [(s, row) for s, row in points if metric in row.metrics]
            ys = [row.metrics[metric] for _, row in points]
            xs = [_training_flops(s, paper_tokens_per_step) for s, _ in points]
            style = {"marker": "o", "color": _color(evaluations, evaluation), "label": labels[evaluation.run]}
            draw_series(axis, xs, ys, standard_errors(evaluation.final, metric, ys), **style)
        title = panel_title(evaluations[0].final, metric)
        axis.set_title(f"{title}\nrecurrent runs at their mean training recurrence", fontsize=9)
        axis.set_xlim(left=0)
        axis.margins(x=0.05)
        axis.xaxis.set_major_formatter(EngFormatter(sep=" "))
        sweeps = [s for e in evaluations for s in e.sweeps]
        what = [flops_axis_label(paper_tokens_per_step)]
        if paper_tokens_per_step is None:  # the paper's axis counts each run's own steps: no teacher, no earlier run
            if any(_flops_of(s.details, "flops_teacher") for s in sweeps):
                what.append("distillation teachers' forwards")
            if any(s.details.get("earlier") for s in sweeps):
                what.append("the runs each continued (model.init_from)")
        finish_metric_axis(axis, metric, "\n+ ".join(what) + "\n(G = 10⁹, T = 10¹², P = 10¹⁵, E = 10¹⁸)")
    return save_figure(figure, path, _legend_columns(figure))


def _training_flops(sweep, paper_tokens_per_step: int | None = None) -> float:
    """What training had cost when the model was saved: the paper's accounting, and a teacher's forwards, if any
    (distillation's compute counts when runs are compared per FLOP), counted from the first of the runs it
    continued (a run from `model.init_from` starts where that run ended). With `paper_tokens_per_step`, as the
    paper's plots count it: the run's own steps from its step 0 (their two-phase runs' second phase starts at 0),
    each at that many tokens."""
    if paper_tokens_per_step is not None:
        return paper_axis_flops(sweep.details, paper_tokens_per_step)
    records = (sweep.details, sweep.details.get("earlier") or {})
    return sum(_flops_of(record, key) for record in records for key in ("flops_paper", "flops_teacher"))


def _flops_of(record: dict, key: str) -> float:
    return record.get(key) or 0.0


def plot_final(evaluations: Sequence[RunEvaluation], labels: dict[str, str], path: Path) -> Path:
    """Each metric against test recurrence at the end of training; fixed-depth runs and parents as lines."""
    metrics = _metrics(evaluations)
    figure, axes = panel_grid(len(metrics), f"{_kind(evaluations)} at the end of training")
    recurrent = [e for e in evaluations if e.recurrent]
    depths = recurrence_ticks(row.steps for e in recurrent for row in e.final.rows)
    for axis, metric in zip(axes, metrics):
        for evaluation in evaluations:
            rows = [row for row in evaluation.final.rows if metric in row.metrics]
            style = {"color": _color(evaluations, evaluation), "label": labels[evaluation.run]}
            if evaluation.recurrent:
                ys = [row.metrics[metric] for row in rows]
                xs = [row.steps for row in rows]
                draw_series(axis, xs, ys, standard_errors(evaluation.final, metric, ys), marker="o", **style)
            elif rows:
                axis.axhline(rows[0].metrics[metric], linewidth=1.5, zorder=2, **style)
        for row, style in references([e.final for e in evaluations], metric):
            axis.axhline(row.metrics[metric], label=row.label, **REFERENCE_STYLES[style])
        axis.set_title(panel_title(evaluations[0].final, metric), fontsize=9)
        recurrence_axis(axis, depths)
        _inference_flops_axis(axis, recurrent, depths)
        finish_metric_axis(axis, metric, "test recurrence r (core iterations)")
    return save_figure(figure, path, _legend_columns(figure))


def _inference_flops_axis(axis, recurrent: Sequence[RunEvaluation], depths: list[int]) -> None:
    """A top axis in inference FLOPs per token at each r (linear in r: the core's FLOPs once per iteration), from
    the first recurrent run; named after it when the runs' shapes differ."""
    lines = {_flops_line(e.final.rows) for e in recurrent} - {None}
    if not lines:
        return
    first = _flops_line(recurrent[0].final.rows) or next(iter(lines))
    intercept, slope = first
    top = axis.secondary_xaxis("top", functions=(lambda r: intercept + slope * r, lambda f: (f - intercept) / slope))
    top.set_ticks([intercept + slope * r for r in depths])
    top.xaxis.set_major_formatter(EngFormatter(places=1, sep=" "))
    top.xaxis.set_minor_locator(NullLocator())
    top.tick_params(labelsize=7)
    whose = "" if len(lines) == 1 else f" ({recurrent[0].run})"
    top.set_xlabel(f"inference FLOPs per token{whose}", fontsize=8)


def _flops_line(rows: Sequence[Row]) -> tuple[float, float] | None:
    """(FLOPs at r = 0, FLOPs per iteration) from two rows of a sweep; None with fewer."""
    points = sorted({(row.steps, row.flops_per_token) for row in rows if row.steps and row.flops_per_token})
    if len(points) < 2:
        return None
    (r1, f1), (r2, f2) = points[0], points[-1]
    slope = (f2 - f1) / (r2 - r1)
    return f1 - slope * r1, slope


def _bar_row(evaluation: RunEvaluation) -> Row:
    """A run's bar: its last model at the largest test recurrence evaluated (fixed depth: its one row)."""
    return max(evaluation.final.rows, key=lambda row: row.steps or 0)


def plot_final_bars(evaluations: Sequence[RunEvaluation], labels: dict[str, str], path: Path) -> Path:
    """Grouped bars: a group per metric, a bar per run (the paper's Fig. 9)."""
    metrics = _metrics(evaluations)
    figure, axes = panel_grid(1, f"{_kind(evaluations)} of each run's last model")
    axis = axes[0]
    figure.set_figwidth(max(5.0, 1.2 * len(metrics) * max(1, len(evaluations)) ** 0.5 + 2))
    width = 0.8 / len(evaluations)
    for number, evaluation in enumerate(evaluations):
        row = _bar_row(evaluation)
        present = [(i, m) for i, m in enumerate(metrics) if m in row.metrics]
        ys = [row.metrics[m] for _, m in present]
        errors = [standard_errors(evaluation.final, m, [y]) for (_, m), y in zip(present, ys)]
        where = f", r={row.steps}" if row.steps else ""
        axis.bar(
            [i - 0.4 + width * (number + 0.5) for i, _ in present],
            ys,
            width,
            yerr=[e[0] if e else 0 for e in errors],
            capsize=3,
            color=_color(evaluations, evaluation),
            label=f"{labels[evaluation.run]}{where}",
        )
    axis.set_xticks(range(len(metrics)), [_wrap(m) for m in metrics], fontsize=8)
    axis.set_title(panel_title(evaluations[0].final, metrics[0]) if len(metrics) == 1 else "", fontsize=9)
    finish_metric_axis(axis, metrics[0] if len(metrics) == 1 else "score (the paper's metric of each task)", "")
    return save_figure(figure, path, _legend_columns(figure))


def _wrap(metric: str) -> str:
    return metric.replace(" (", "\n(")


def final_table(evaluations: Sequence[RunEvaluation], labels: dict[str, str]) -> str:
    """Table 1's layout: a row per run and test recurrence of its last model, a column per metric."""
    metrics = _metrics(evaluations)
    header = ["run", "test recurrence", "step", *metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    parents: dict[str, Row] = {}
    for evaluation in evaluations:
        final = evaluation.final
        for row in final.rows:
            cells = [labels[evaluation.run], str(row.steps or "–"), f"{final.details.get('step', '–'):,}"]
            lines.append("| " + " | ".join(cells + [table_cell(row.metrics.get(m)) for m in metrics]) + " |")
        for row in (final.parent, final.chance):
            if row is not None:
                parents.setdefault(row.label, row)
    for label, row in parents.items():
        lines.append("| " + " | ".join([label, "–", "–", *(table_cell(row.metrics.get(m)) for m in metrics)]) + " |")
    headline = "the metric the paper reports for each task" if evaluations[0].kind == "tasks" else "loss in nats/token"
    return "\n".join(lines) + f"\n\nColumns: {headline}; the last model of each run.\n"
