"""The rough edges a new user hit: what `train` says when it stops or resumes, what --dry-run checks, errors
that come before the work (and before the heavy imports), and --help lines that give their defaults."""

from __future__ import annotations

import pytest
import yaml
from conftest import run_cli
from test_train import tiny_config

from recurfit.train import loop


@pytest.fixture
def config_file(workspace, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run")))
    return path


def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(config_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real_step = loop.Trainer.train_step

    def interrupted_at_step_3(trainer):
        if trainer.counters.step == 2:
            raise KeyboardInterrupt
        return real_step(trainer)

    monkeypatch.setattr(loop.Trainer, "train_step", interrupted_at_step_3)
    code, text = run_cli(capsys, "train", config_file, "checkpoint.every=1")
    assert code == 130
    assert (
        f"Stopped by Ctrl-C at step 2: its last checkpoint is {out / 'checkpoints' / 'step-000002'} (step 2); "
        f"continue with `recurfit train {out / 'config.yaml'} --resume`." in text
    )
    monkeypatch.setattr(loop.Trainer, "train_step", real_step)
    code, text = run_cli(capsys, "train", out / "config.yaml", "--resume")
    assert code == 0 and f"Resuming {out} from step 2 ({out / 'checkpoints' / 'step-000002'})." in text


def test_ctrl_c_before_the_first_checkpoint_says_resume_starts_over(config_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(loop.Trainer, "train_step", lambda trainer: (_ for _ in ()).throw(KeyboardInterrupt))
    code, text = run_cli(capsys, "train", config_file)
    assert code == 130 and "Stopped by Ctrl-C at step 0: it has no checkpoint yet, so --resume starts" in text


def test_resuming_with_other_settings_suggests_the_runs_own_config(config_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert run_cli(capsys, "train", config_file, "steps=4", "checkpoint.every=2", "--out", out)[0] == 0
    (out / "final").rename(tmp_path / "unfinished")  # as if stopped after its last checkpoint
    code, text = run_cli(capsys, "train", config_file, "--resume", "--out", out)  # the recipe: steps=12, not 4
    assert code == 2 and f"`recurfit train {out / 'config.yaml'} --resume`" in text


def test_a_run_that_cannot_start_prints_one_line_and_no_config(config_file, tmp_path, capsys):
    code, text = run_cli(capsys, "train", config_file, f"data.validation=[{tmp_path / 'nowhere'}]")
    assert code == 2 and "not a token store" in text
    assert "Config" not in text and "saved as" not in text and not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.phases.0.sources=[/nowhere/store]", "/nowhere/store"),
        ("data.validation=[/nowhere/val]", "/nowhere/val"),
        ("model.shape=[20,20,20]", "model: "),
    ],
)
def test_dry_run_fails_as_the_run_would(config_file, capsys, override, message):
    code, text = run_cli(capsys, "train", config_file, override, "--dry-run")
    assert code == 2 and message in text and "Config" not in text
