"""Snapshots during training, a run evaluated snapshot by snapshot (and continued after a stop), and the paper's
figures over training drawn from two runs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file
from test_train import tiny_config

from recurfit.errors import RecurfitError
from recurfit.evaluate.over_training import RunEvaluation, evaluate_run, find_snapshots
from recurfit.evaluate.results import Sweep
from recurfit.io.runs import read_log
from recurfit.train import load_config, train

TASK = "arc_challenge (acc_norm)"


@pytest.fixture(scope="module")
def runs(workspace, tmp_path_factory):
    """A recurrent run and its fixed-depth parent trained on the same data, 8 steps, snapshots every 3."""
    root = tmp_path_factory.mktemp("runs")
    for name, extra in (("recurrent", []), ("parent", ["model.shape=null"])):
        overrides = ["steps=8", "snapshots.every=3", "checkpoint.every=4", *extra]
        train(load_config(None, overrides, base=tiny_config(workspace, root / name)))
    return root


def test_snapshots_are_loadable_models_at_their_steps_apart_from_checkpoints(runs):
    from transformers import AutoModelForCausalLM

    run = runs / "recurrent"
    assert sorted(p.name for p in (run / "snapshots").iterdir()) == ["step-000000", "step-000003", "step-000006"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004", "step-000008"]
    log = {r["step"]: r for r in read_log(run) if r["kind"] == "train"}
    for snapshot in find_snapshots(run):
        files = {p.name for p in snapshot.path.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "training.json"} <= files
        assert "optimizer.pt" not in files  # weights only
        record = snapshot.training
        assert record["step"] == (8 if snapshot.final else int(snapshot.path.name[5:]))
        if record["step"]:  # the counters the log wrote at that step
            assert [record[k] for k in ("tokens", "flops", "flops_paper")] == [
                log[record["step"]][k] for k in ("tokens", "flops", "flops_paper")
            ]
        assert record["mean_recurrence"] == 4 and record["recurrent"]
    # The step-4 checkpoint's weights are not the step-3 snapshot's (one more update), the final's are step 8's.
    final = AutoModelForCausalLM.from_pretrained(run / "final")
    checkpoint = load_file(run / "checkpoints" / "step-000008" / "model.safetensors")
    assert all(torch.equal(checkpoint[k], v) for k, v in final.state_dict().items() if k in checkpoint)
    first = AutoModelForCausalLM.from_pretrained(run / "snapshots" / "step-000000")
    assert not torch.equal(first.lm_head.weight, final.lm_head.weight)


def test_snapshot_disk_use_is_said_at_start(workspace, tmp_path, capsys):
    overrides = ["steps=2", "snapshots.every=1", "checkpoint.every=0"]
    train(load_config(None, overrides, base=tiny_config(workspace, tmp_path / "run")))
    weights = load_file(tmp_path / "run" / "snapshots" / "step-000000" / "model.safetensors")
    size = sum(t.numel() * t.element_size() for t in weights.values())
    said = " ".join(capsys.readouterr().out.split())
    # Steps 0 and 1 (step 2 is final/).
    assert f"Snapshots: every 1 steps, 2 × {size / 1e3:.1f} kB = {2 * size / 1e6:.1f} MB" in said


def test_a_run_is_evaluated_per_snapshot_and_a_stopped_evaluation_continues(runs, workspace, tmp_path, capsys):
    out = tmp_path / "eval"
    code, text = run_cli(
        capsys, "eval", "loss", runs / "recurrent", "--data", workspace / "prose", "-r", "1,2", "--limit", "4",
        "--out", out,
    )  # fmt: skip
    assert code == 0, text
    sweeps = [Sweep.load(out / f"step-{s:06d}" / "results.json") for s in (0, 3, 6, 8)]
    assert [[row.steps for row in sweep.rows] for sweep in sweeps] == [[4], [4], [4], [1, 2, 4]]
    assert [s.details["final"] for s in sweeps] == [False, False, False, True]
    assert sweeps[1].details["flops_paper"] < sweeps[2].details["flops_paper"] < sweeps[3].details["flops_paper"]
    # The snapshot's loss is the loss of that model evaluated alone.
    code, _ = run_cli(
        capsys, "eval", "loss", runs / "recurrent" / "snapshots" / "step-000003", "--data", workspace / "prose",
        "-r", "4", "--limit", "4", "--out", tmp_path / "alone",
    )  # fmt: skip
    alone = Sweep.load(tmp_path / "alone" / "results.json")
    assert alone.rows[0].metrics["loss"] == pytest.approx(sweeps[1].rows[0].metrics["loss"], abs=1e-6)

    # Stopped after one model: the next call evaluates only the others, with the same settings only.
    calls = []

    def evaluate(snapshot, recurrences, name):
        if calls:
            raise KeyboardInterrupt
        calls.append(snapshot.step)
        return Sweep.load(out / snapshot.folder_name / "results.json"), {}

    settings = {"kind": "loss"}
    again = tmp_path / "again"
    with pytest.raises(KeyboardInterrupt):
        evaluate_run(runs / "recurrent", again, evaluate, settings, recurrences=[1, 2])
    assert calls == [0] and sorted(p.name for p in again.glob("step-*")) == ["step-000000"]
    calls[:] = []

    def evaluate_rest(snapshot, recurrences, name):
        calls.append(snapshot.step)
        return Sweep.load(out / snapshot.folder_name / "results.json"), {}

    evaluate_run(runs / "recurrent", again, evaluate_rest, settings, recurrences=[1, 2])
    assert calls == [3, 6, 8]
    with pytest.raises(RecurfitError, match="other settings .*recurrence"):
        evaluate_run(runs / "recurrent", again, evaluate_rest, settings, recurrences=[1, 4])
    with pytest.raises(RecurfitError, match="no snapshot at step 5; the run has \\[0, 3, 6, 8\\]"):
        evaluate_run(runs / "recurrent", tmp_path / "x", evaluate_rest, settings, recurrences=[1], steps=[5])
    code, text = run_cli(capsys, "eval", "loss", runs / "recurrent" / "final", "--data", workspace / "prose",
                         "--steps", "3", "--out", tmp_path / "y")  # fmt: skip
    assert code == 2 and "not a run folder" in text and not (tmp_path / "y").exists()


def test_a_continued_run_counts_the_runs_it_continued(runs, workspace, tmp_path, capsys, drawn):
    """Phase 2 of a chained training (model.init_from) starts on the FLOPs axis where phase 1 ended, and a third
    phase counts both: curves over training FLOPs compare chained and single runs at equal cost."""
    chained = ["model.shape=null", "model.path=null", "steps=2", "snapshots.every=1", "checkpoint.every=0"]
    for name, earlier in (("then", runs / "recurrent"), ("last", tmp_path / "then")):
        base = tiny_config(workspace, tmp_path / name)
        train(load_config(None, [*chained, f"model.init_from={earlier}"], base=base))
    first, then, last = (
        json.loads((folder / "final" / "training.json").read_text())
        for folder in (runs / "recurrent", tmp_path / "then", tmp_path / "last")
    )
    counted = ("tokens", "flops", "flops_paper", "flops_teacher")
    assert first["earlier"] is None
    assert then["earlier"] == {"runs": ["recurrent"], **{key: first[key] for key in counted}}
    assert last["earlier"] == {"runs": ["recurrent", "then"], **{key: first[key] + then[key] for key in counted}}

    out = tmp_path / "eval"
    code, text = run_cli(
        capsys, "eval", "loss", tmp_path / "last", "--data", workspace / "prose", "-r", "4", "--limit", "2",
        "--out", out,
    )  # fmt: skip
    assert code == 0, text
    code, text = run_cli(capsys, "plot", out, "--out", tmp_path / "figures")
    assert code == 0, text
    axis = next(f for f in drawn if f.get_suptitle().endswith("over training")).axes[0]
    steps = [s.details for s in RunEvaluation.load(out).sweeps]
    assert [d["step"] for d in steps] == [0, 1, 2]
    start = first["flops_paper"] + then["flops_paper"]
    assert list(axis.get_lines()[0].get_xdata()) == [start + d["flops_paper"] for d in steps]
    assert "model.init_from" in axis.get_xlabel()

    # The paper's axis: this run's own steps from its step 0 (as the authors plotted phase 2 of two-phase runs),
    # each at 2^20 tokens whatever the run's batch.
    code, text = run_cli(capsys, "plot", out, "--out", tmp_path / "paper", "--paper-tokens-per-step", "1048576")
    assert code == 0, text
    axis = [f for f in drawn if f.get_suptitle().endswith("over training")][-1].axes[0]
    expected = [0.0] + [d["flops_paper"] * 2**20 * d["step"] / d["tokens"] for d in steps[1:]]
    assert list(axis.get_lines()[0].get_xdata()) == pytest.approx(expected)
    assert expected[-1] != pytest.approx(steps[-1]["flops_paper"])  # the tiny runs' batches are not 2^20 tokens
    assert "1,048,576 tokens per step" in axis.get_xlabel() and "model.init_from" not in axis.get_xlabel()


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
