"""Tests of `recurfit/evaluate/figures/`."""

from __future__ import annotations

import json

import pytest
from conftest import (
    check_figure,
    run_cli,
    visible_ticks,
)
from matplotlib.container import ErrorbarContainer

from recurfit.evaluate import figures
from recurfit.evaluate.over_training import RunEvaluation
from recurfit.evaluate.results import Row, Sweep
from recurfit.io.runs import read_log

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


TASK = "arc_challenge (acc_norm)"


def test_plot_overlays_results_and_training_runs(saved, workspace, tmp_path, capsys):
    run_cli(
        capsys,
        "eval",
        "loss",
        saved / "model",
        "--data",
        workspace / "prose",
        "-r",
        "1,2",
        "--out",
        tmp_path / "a",
    )
    run_cli(capsys, "eval", "loss", saved / "parent", "--data", workspace / "prose", "--out", tmp_path / "b")
    log = tmp_path / "run" / "log.jsonl"
    log.parent.mkdir()
    log.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"kind": "train", "step": 1, "loss": 5.0, "flops": 1e9},
                {"kind": "train", "step": 2, "loss": 4.0, "flops": 2e9},
                {"kind": "eval", "step": 2, "prose/loss@1": 4.5, "prose/loss@4": 4.2},
            ]
        )
    )
    code, text = run_cli(
        capsys, "plot", tmp_path / "a", tmp_path / "b" / "results.json", tmp_path / "run", "--out", tmp_path / "figs"
    )
    assert code == 0, text
    assert {p.name for p in (tmp_path / "figs").iterdir()} == {
        f"{name}.{suffix}" for name in ("loss_recurrence", "loss_flops", "training") for suffix in ("png", "pdf", "svg")
    }
    code, text = run_cli(capsys, "plot", tmp_path, "--out", tmp_path / "figs2")
    assert code == 2 and "neither a training run" in text


def test_figures_draw_a_shared_parent_once_and_a_validation_panel_per_store(tmp_path, monkeypatch):
    from recurfit.evaluate import figures as plots
    from recurfit.evaluate.figures import sweeps as sweep_figures
    from recurfit.evaluate.figures import training as training_figures

    parent = Row("parent (p)", {"loss": 3.0}, flops_per_token=10**8)
    sweeps = [
        Sweep("loss", name, ["loss"], [Row("r=1", {"loss": loss}, 1, 1, 10**8)], parent)
        for name, loss in [("a", 4.0), ("b", 5.0)]
    ]
    log = tmp_path / "run" / "log.jsonl"
    log.parent.mkdir()
    log.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"kind": "train", "step": 1, "loss": 5.0, "flops": 1e9},
                {
                    "kind": "eval",
                    "step": 1,
                    "prose/loss@1": 4.5,
                    "prose/loss@4": 4.2,
                    "math/loss@1": 3.5,
                    "math/loss@4": 3.2,
                },
            ]
        )
    )
    figures = []
    for module in (sweep_figures, training_figures):
        monkeypatch.setattr(module, "save_figure", lambda figure, path: figures.append(figure) or path)
    plots.plot_recurrence(sweeps, tmp_path / "r.png")
    plots.plot_training([log.parent], tmp_path / "t.png")
    recurrence, training = figures
    assert [line.get_label() for line in recurrence.axes[0].get_lines()] == ["a", "b", "parent (p)"]
    panels = [axis for axis in training.axes if axis.get_visible()]
    titles = [f"validation loss on {s} (fainter: smaller r)" for s in ("prose", "math")]
    assert [axis.get_title() for axis in panels[2:]] == titles
    assert [line.get_label() for line in panels[3].get_lines()] == ["run r=1", "run r=4"]


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


def test_the_training_figure_can_draw_the_papers_flops_axis(runs, tmp_path, drawn):
    from recurfit.evaluate import figures

    figures.plot_training([runs / "recurrent"], tmp_path / "training.png", paper_tokens_per_step=2**20)
    train = [r for r in read_log(runs / "recurrent" / "log.jsonl") if r.get("kind") == "train"]
    expected = [r["flops_paper"] * 2**20 * r["step"] / r["tokens"] for r in train]
    assert list(drawn[-1].axes[1].get_lines()[0].get_xdata()) == pytest.approx(expected)
    assert expected[-1] > 100 * train[-1]["flops_paper"]  # 2^20 tokens per step, where the tiny run steps few


def test_figures_over_training_from_two_runs(runs, tmp_path, capsys, drawn):
    evaluations = []
    for name in ("recurrent", "parent"):
        out = tmp_path / f"eval-{name}"
        code, text = run_cli(
            capsys, "eval", "tasks", runs / name, "--tasks", "arc_challenge", "-r", "1,2", "--limit", "3",
            "--steps", "3,8", "--out", out,
        )  # fmt: skip
        assert code == 0, text
        evaluations.append(out)
    recurrent = RunEvaluation.load(evaluations[0])
    assert [s.details["step"] for s in recurrent.sweeps] == [3, 8]
    assert recurrent.final.details["documents"][TASK] == 3

    code, text = run_cli(capsys, "plot", *evaluations, "--out", tmp_path / "figures")
    assert code == 0, text
    names = {p.name for p in (tmp_path / "figures").iterdir()}
    for figure in ("tasks_over_training", "tasks_final", "tasks_final_bars"):
        assert {f"{figure}.{suffix}" for suffix in ("png", "pdf", "svg")} <= names
    figures = {
        "tasks_over_training.png": next(f for f in drawn if f.get_suptitle().endswith("over training")),
        "tasks_final.png": next(f for f in drawn if f.get_suptitle().endswith("end of training")),
        "tasks_final_bars.png": next(f for f in drawn if f.get_suptitle().endswith("last model")),
    }

    over = figures["tasks_over_training.png"].axes[0]
    assert "training FLOPs" in over.get_xlabel() and over.get_ylabel() == TASK
    legend = [t.get_text() for t in figures["tasks_over_training.png"].legends[0].get_texts()]
    assert legend == ["recurrent", "parent (fixed depth)"]
    lines = [line for line in over.get_lines() if len(line.get_xdata()) == 2]
    assert list(lines[0].get_xdata()) == [s.details["flops_paper"] for s in recurrent.sweeps]
    assert over.get_xlim()[0] <= 0 and over.get_xlim()[1] >= recurrent.final.details["flops_paper"]

    final = figures["tasks_final.png"].axes[0]
    assert final.get_xscale() == "log" and final.get_xlabel().startswith("test recurrence")
    top = final.child_axes  # the secondary x axis
    assert top and "inference FLOPs per token" in top[0].get_xlabel()
    legend = [t.get_text() for t in figures["tasks_final.png"].legends[0].get_texts()]
    assert {"recurrent", "parent (fixed depth)", "random chance"} <= set(legend)
    flat = [line for line in final.get_lines() if line.get_label() == "parent (fixed depth)"]
    assert flat and flat[0].get_ydata()[0] == RunEvaluation.load(evaluations[1]).final.rows[0].metrics[TASK]

    bars = figures["tasks_final_bars.png"].axes[0]
    heights = [patch.get_height() for patch in bars.patches]
    assert heights == [
        recurrent.final.rows[-1].metrics[TASK],
        RunEvaluation.load(evaluations[1]).final.rows[0].metrics[TASK],
    ]
    table = (tmp_path / "figures" / "tasks_table.md").read_text()
    assert "| recurrent | 2 | 8 |" in table and "| parent (fixed depth) | – | 8 |" in table
    assert json.loads((evaluations[0] / "evaluation.json").read_text())["settings"]["tasks"] == ["arc_challenge"]


def test_legends_name_runs_by_the_settings_that_differ():
    from recurfit.evaluate.figures import run_labels

    def evaluation(name, mean, lr, recurrent=True):
        sweep = Sweep("tasks", name, [TASK], [], details={"recurrent": recurrent})
        from recurfit.evaluate.results import Row

        sweep.rows = [Row("r=4", {TASK: 0.3}, steps=4 if recurrent else None)]
        config = {"out": f"runs/{name}", "depth": {"mean_recurrence": mean}, "optimizer": {"lr": lr}}
        return RunEvaluation(None, name, config, {}, [sweep])

    labels = run_labels([evaluation("a", 4, 1e-3), evaluation("b", 8, 1e-3), evaluation("p", 32, 2e-3, False)])
    assert labels == {"a": "a (mean_recurrence 4)", "b": "b (mean_recurrence 8)", "p": "p (fixed depth)"}
    # Arms of a study: each run is named by where it departs from what most runs share; a path by its last part.
    arms = [evaluation("ref", 4, 1e-3), evaluation("same", 4, 1e-3), evaluation("fast", 4, 5e-3)]
    arms.append(evaluation("deep", 8, "runs/study/ref"))
    assert run_labels(arms) == {
        "ref": "ref",
        "same": "same",
        "fast": "fast (lr 0.005)",
        "deep": "deep (mean_recurrence 8, lr ref)",
    }


def lens_of(tokens: int, r: int, prompt_length: int):
    """A lens of `tokens` tokens × `r` steps with predictions that settle part-way up (no model needed)."""
    import torch

    from recurfit.evaluate.lens import Lens

    generator = torch.Generator().manual_seed(0)
    settle = torch.randint(1, r + 1, (tokens, 1), generator=generator)
    steps = torch.arange(1, r + 1)
    top_ids = torch.where(steps < settle, steps % 3, 10 + torch.arange(tokens)[:, None])
    kl = torch.logspace(-1, -6, r).repeat(tokens, 1)
    kl[:, 0] = float("nan")
    names = [f"t{i}" for i in range(10 + tokens)]
    return Lens(
        tokens=[f" word{i}" if i % 4 else "\n" for i in range(tokens)],
        prompt_length=prompt_length,
        rules=["kl:5e-4", "argmax:2"],
        top_ids=top_ids,
        top_tokens=[[names[t] for t in row] for row in top_ids.tolist()],
        probabilities=torch.rand(tokens, r, generator=generator),
        kl=kl,
        exits={"kl:5e-4": settle[:, 0].tolist(), "argmax:2": [r] * tokens},
    )


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_the_lens_figure_is_one_file_in_the_format_its_suffix_names(tmp_path, suffix):
    from recurfit.evaluate.figures.lens import plot_lens

    path = plot_lens(lens_of(6, 4, prompt_length=6), tmp_path / f"lens{suffix}", "lens")
    assert sorted(tmp_path.iterdir()) == [path]
    content = path.read_bytes()
    assert content.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in content[:2000]


def test_the_lens_figure_marks_each_rules_exits_names_every_token_and_keeps_its_text_inside(tmp_path, monkeypatch):
    """40 tokens × 32 steps, the size the lens is read at: every token named under both panels, each rule's exit
    steps as its markers, the prompt's end, and the predictions' text where it changes, inside the panel."""
    from recurfit.evaluate.figures import lens as lens_figures
    from recurfit.io import figures as io_figures

    monkeypatch.setattr(io_figures.plt, "close", lambda figure: None)
    lens = lens_of(40, 32, prompt_length=24)
    lens_figures.plot_lens(lens, tmp_path / "lens.png", "lens")
    figure = io_figures.plt.gcf()
    top, kl = figure.axes[:2]  # the panels (then their colour bars)
    renderer = figure.canvas.get_renderer()
    for axis in (top, kl):
        assert [t.get_text() for t in axis.get_xticklabels()][:4] == ["⏎", "·word1", "·word2", "·word3"]
        marks = {line.get_label(): line for line in axis.get_lines() if line.get_label().startswith("exit")}
        assert list(marks["exit: kl:5e-4"].get_ydata()) == lens.exits["kl:5e-4"]
        assert list(marks["exit: argmax:2"].get_ydata()) == [32] * 40
        (prompt_end,) = [line for line in axis.get_lines() if not line.get_label().startswith("exit")]
        assert prompt_end.get_xdata()[0] == 24.5  # between the prompt's last token and the continuation's first
    # A prediction's text where it changes: at step 1 and wherever the top token differs from the step below.
    changes = 40 + int((lens.top_ids[:, 1:] != lens.top_ids[:, :-1]).sum())
    assert len(top.texts) == changes
    panel = top.get_window_extent(renderer)
    assert all(panel.contains(*text.get_window_extent(renderer).get_points().mean(0)) for text in top.texts)
    assert {t.get_text() for t in figure.legends[0].get_texts()} == {"exit: kl:5e-4", "exit: argmax:2"}
