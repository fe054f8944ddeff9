"""The figures `recurfit plot` and `recurfit eval` draw, checked on matplotlib's objects (not pixels): readable
ticks on every axis, nothing outside the limits, a legend over no data, titles, error bars, PDF/SVG beside PNG."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.container import ErrorbarContainer

from recurfit.evaluate import figures
from recurfit.evaluate.results import Row, Sweep

DEPTHS = (1, 2, 4, 8, 16, 32)


def loss_sweep(name: str, offset: float) -> Sweep:
    rows = [
        Row(f"r={r}", {"loss": offset + 2 / r, "perplexity": 0.0}, r, 56_000_000 * r, 112_000_000 * r) for r in DEPTHS
    ]
    parent = Row("parent (embedded)", {"loss": 3.3, "perplexity": 27.0}, None, 106_000_000, 212_000_000)
    return Sweep("loss", name, ["loss", "perplexity"], rows, parent, None, {"data": "data/prose (val split)"})


def task_sweep() -> Sweep:
    columns = ["arc_challenge (acc_norm)", "gsm8k_cot (exact_match, flexible-extract)"]
    rows = [
        Row(f"r={r}", {columns[0]: 0.25 + 0.05 * i, columns[1]: 0.0}, r, 56_000_000 * r, 112_000_000 * r)
        for i, r in enumerate((1, 4, 16))
    ]
    parent = Row("parent (embedded)", {columns[0]: 0.5, columns[1]: 0.0}, None, 106_000_000, 212_000_000)
    chance = Row("random chance", {columns[0]: 0.25, columns[1]: 0.0})
    details = {"headline": columns, "documents": {columns[0]: 16, columns[1]: 16}}
    return Sweep("tasks", "runs/smollm2-cpu/final", columns, rows, parent, chance, details)


def training_run(folder):
    folder.mkdir()
    records = [{"kind": "train", "step": s, "loss": 6 - s / 10, "flops": 1.3e12 * s} for s in range(1, 21)]
    records += [
        {"kind": "eval", "step": s, "prose/loss@1": 6.5 - s / 20, "prose/loss@4": 6.2 - s / 20} for s in (10, 20)
    ]
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def visible_ticks(axis, which: str) -> list[str]:
    low, high = sorted(getattr(axis, f"get_{which}lim")())
    ticks = zip(getattr(axis, f"get_{which}ticks")(), getattr(axis, f"get_{which}ticklabels")())
    return [label.get_text() for value, label in ticks if low <= value <= high and label.get_text()]


def assert_inside(axis, xs, ys) -> None:
    (x0, x1), (y0, y1) = sorted(axis.get_xlim()), sorted(axis.get_ylim())
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    assert np.all((xs > x0) & (xs < x1)), (axis.get_title(), xs, (x0, x1))
    assert np.all((ys > y0) & (ys < y1)), (axis.get_title(), ys, (y0, y1))


def check_figure(figure) -> None:
    renderer = figure.canvas.get_renderer()
    panels = [axis for axis in figure.axes if axis.get_visible()]
    assert figure.get_suptitle()
    (legend,) = figure.legends  # one legend for the figure, none inside a panel
    legend_box = legend.get_window_extent(renderer)
    assert 0 <= legend_box.x0 and legend_box.x1 <= figure.bbox.width and 0 <= legend_box.y0, legend_box
    for axis in panels:
        assert axis.get_legend() is None and axis.get_title() and axis.get_xlabel() and axis.get_ylabel()
        assert len(visible_ticks(axis, "x")) >= 2, (axis.get_title(), axis.get_xticks(), axis.get_xlim())
        assert len(visible_ticks(axis, "y")) >= 2, axis.get_title()
        assert not legend_box.overlaps(axis.get_window_extent(renderer))
        for line in axis.get_lines():
            if line.get_transform() == axis.transData:  # data lines, not the parent's horizontal line
                assert_inside(axis, *line.get_data())
            else:
                y = line.get_ydata()[0]
                assert min(axis.get_ylim()) < y < max(axis.get_ylim()), axis.get_title()
        for text in axis.texts:  # the r= labels
            assert axis.get_window_extent(renderer).contains(*text.get_window_extent(renderer).p1), text.get_text()


def test_every_figure_has_readable_ticks_nothing_clipped_and_the_legend_off_the_data(drawn, tmp_path):
    sweeps = [loss_sweep("runs/smollm2-cpu/final", 4.0), loss_sweep("runs/other/final", 4.5)]
    sweeps[1].parent.label = "parent (a long name: untrained, 30 layers)"  # a wide legend under one panel
    figures.plot_recurrence(sweeps, tmp_path / "loss_recurrence.png")
    figures.plot_flops(sweeps, tmp_path / "loss_flops.png")
    figures.plot_recurrence([task_sweep()], tmp_path / "tasks_recurrence.png")
    figures.plot_flops([task_sweep()], tmp_path / "tasks_flops.png")
    figures.plot_training([training_run(tmp_path / "smollm2-cpu")], tmp_path / "training.png")
    for figure in drawn:
        check_figure(figure)
    for name in ("loss_recurrence", "loss_flops", "tasks_recurrence", "tasks_flops", "training"):
        assert all((tmp_path / f"{name}{suffix}").stat().st_size > 1000 for suffix in (".png", ".pdf", ".svg"))
    loss, flops, tasks, _, training = drawn
    assert loss.axes[0].get_title() == "loss on data/prose (val split)"
    assert [t.get_text() for t in loss.axes[0].get_xticklabels()] == [str(r) for r in DEPTHS]
    assert visible_ticks(flops.axes[0], "x") == ["100 M", "200 M", "500 M", "1 G", "2 G"]
    assert tasks.axes[0].get_title() == "arc_challenge (acc_norm), 16 documents"
    (bars,) = [c for c in tasks.axes[0].containers if isinstance(c, ErrorbarContainer)]
    segments = bars.lines[2][0].get_segments()  # ±1 binomial standard error: sqrt(p (1 - p) / 16) at p = 0.25
    assert segments[0][1][1] - segments[0][0][1] == pytest.approx(2 * (0.25 * 0.75 / 16) ** 0.5)
    # one name for a run everywhere: its evaluated final model and its training curves
    assert "smollm2-cpu" in [t.get_text() for t in loss.legends[0].get_texts()]
    assert "smollm2-cpu" in [t.get_text() for t in training.legends[0].get_texts()]


def test_a_zero_score_and_a_single_point_keep_their_markers_and_ticks(drawn, tmp_path):
    sweep = task_sweep()
    sweep.rows = sweep.rows[:1]  # one depth: a FLOPs range of a single point
    figures.plot_flops([sweep], tmp_path / "one.png")
    figures.plot_recurrence([sweep], tmp_path / "one_r.png")
    for figure in drawn:
        check_figure(figure)


def test_run_names_are_the_run_folder():
    assert figures.run_name("runs/smollm2-cpu/final") == figures.run_name("runs/smollm2-cpu/") == "smollm2-cpu"
    assert figures.run_name("embedded SmolLM2-135M (4, 8, 4)") == "embedded SmolLM2-135M (4, 8, 4)"


# ---------------------------------------------------------------- FLOPs axis labels, lines of equal value


def test_flops_figures_keep_their_axis_labels_inside_and_apart(drawn, tmp_path):
    figures.plot_flops([loss_sweep("runs/smollm2-cpu/final", 4.0)], tmp_path / "loss_flops.png")
    figures.plot_flops([task_sweep()], tmp_path / "tasks_flops.png")
    for figure in drawn:
        figure.canvas.draw()
        page = figure.bbox
        labels = [axis.xaxis.label.get_window_extent() for axis in figure.axes if axis.get_visible()]
        for box in labels:
            assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0
        for left, right in zip(labels, labels[1:]):
            assert left.x1 < right.x0  # the two panels' labels do not run into each other


def test_lines_of_equal_value_stay_visible_and_are_named(drawn, tmp_path):
    figures.plot_recurrence([task_sweep()], tmp_path / "tasks_recurrence.png")
    arc, gsm8k = drawn[0].axes[:2]
    data = gsm8k.containers[0].lines[0]  # the errorbar's line through the scores
    parent, chance = (
        next(line for line in gsm8k.get_lines() if line.get_label() == name)
        for name in ("parent (embedded)", "random chance")
    )
    assert parent.get_zorder() > data.get_zorder() and chance.get_zorder() > data.get_zorder()
    assert parent.get_linewidth() < data.get_linewidth()  # the data line shows around the references
    assert [text.get_text() for text in gsm8k.texts] == ["smollm2-cpu, parent (embedded), random chance: all 0"]
    assert len(arc.texts) == 0  # values that differ need no note
