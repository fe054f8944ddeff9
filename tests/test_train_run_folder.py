"""Tests of `recurfit/train/run_folder.py`."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml
from conftest import (
    config_for,
    run_cli,
    stopped_run,
    tiny_config,
    train_losses,
)

from recurfit.errors import RecurfitError
from recurfit.train import Trainer, train


def snapshot(folder: Path) -> dict:
    """Every file and folder under `folder`, with its content's hash: equal snapshots mean nothing changed."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        for path in sorted(folder.rglob("*"))
    }


def test_switching_a_healing_loss_on_or_off_is_refused_on_resume(tmp_path, workspace):
    stopped_run(workspace, tmp_path / "plain", 2)
    with pytest.raises(RecurfitError, match="--resume: distill differs from the run's"):
        Trainer(config_for(workspace, tmp_path / "plain", "steps=8", "checkpoint.every=2", "distill={}"), resume=True)
    stopped_run(workspace, tmp_path / "supervised", 2, "depth.supervise.last=2")
    with pytest.raises(RecurfitError, match="--resume: depth.supervise differs from the run's"):
        Trainer(config_for(workspace, tmp_path / "supervised", "steps=8", "checkpoint.every=2"), resume=True)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_force_starts_over_and_deletes_the_old_run_only_once_the_new_one_is_set_up(tmp_path, workspace):
    out = tmp_path / "run"
    train(config_for(workspace, out, "steps=3"))
    before = snapshot(out)
    broken = config_for(workspace, out, "steps=4", f"data.validation=[{tmp_path / 'nowhere'}]")
    with pytest.raises(RecurfitError, match="not a token store"):
        train(broken, force=True)
    assert snapshot(out) == before  # a new run that cannot start deletes nothing
    with pytest.raises(RecurfitError, match="give one of them"):
        train(config_for(workspace, out, "steps=4"), resume=True, force=True)
    result = train(config_for(workspace, out, "steps=4"), force=True)
    assert result.counters.step == 4 and list(train_losses(out)) == [1, 2, 3, 4]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004"]


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, workspace, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run", steps=3)))
    assert run_cli(capsys, "train", config)[0] == 0
    before = snapshot(tmp_path / "run")
    code, text = run_cli(capsys, "train", config, "--resume")
    assert code == 0 and "is already finished (3 steps): nothing to do" in text
    assert snapshot(tmp_path / "run") == before


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_resume_refuses_changed_settings_and_accepts_changed_resources(tmp_path, workspace):
    out = tmp_path / "run"
    stopped_run(workspace, out, 2)
    for override, key in (
        ("depth.mean_recurrence=3", "depth.mean_recurrence"),
        ("batch.global=4", "batch.global"),
        ("model.shape=[1,2,1]", "model.shape"),
        ("optimizer.muon_lr=0.5", "optimizer.muon_lr"),
    ):
        with pytest.raises(RecurfitError, match=rf"--resume: {key} differs from the run's"):
            Trainer(config_for(workspace, out, "steps=8", "checkpoint.every=2", override), resume=True)
    resumed = Trainer(
        config_for(workspace, out, "steps=8", "checkpoint.every=4", "batch.micro=4", "eval.rows=2"), resume=True
    )
    assert resumed.counters.step == 2
