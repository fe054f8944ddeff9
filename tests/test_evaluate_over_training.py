"""Snapshots during training, a run evaluated snapshot by snapshot (and continued after a stop), and the paper's
figures over training drawn from two runs."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, tiny_config

from recurfit.errors import RecurfitError
from recurfit.evaluate.over_training import RunEvaluation, evaluate_run
from recurfit.evaluate.results import Sweep
from recurfit.train import load_config, train


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
