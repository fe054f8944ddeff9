"""`recurfit train` tells its user what it does: the resolved config (printed, saved as OUT/config.yaml), the
model's size and cost, the schedules (--dry-run), a phase that swallows the run, the final validation and the
outputs; overrides reach list items; --out like every other command."""

from __future__ import annotations

from typing import ClassVar

import pytest
import yaml
from conftest import run_cli, tiny_config

from recurfit.train import load_config, loop


@pytest.fixture
def config_file(workspace, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "from-config")))
    return path


class RecordingBar:
    """A stand-in for the progress bar that records the status it shows."""

    shown: ClassVar[list[str]] = []

    def __init__(self, *columns, disable=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, description, **fields):
        RecordingBar.shown.append(fields["status"])

    def update(self, task, advance=0, **fields):
        RecordingBar.shown.append(fields["status"])


def test_dry_run_prints_the_config_and_schedules_and_trains_nothing(config_file, tmp_path, capsys):
    code, text = run_cli(capsys, "train", config_file, "steps=40", "--dry-run")
    assert code == 0, text
    assert "not run: --dry-run" in text and "steps: 40" in text and "mean_recurrence: 4" in text
    assert "Schedule over 40 steps" in text and "mean r̄" in text and "Muon LR" in text
    assert not (tmp_path / "from-config").exists()


def test_a_phase_that_swallows_the_run_is_a_warning(config_file, capsys):
    code, text = run_cli(capsys, "train", config_file, "data.phases.0.tokens=100000", "--dry-run")
    assert code == 0 and "warning: data.phases.0 (phase 1) ends at 100,000 tokens, but the run trains 3,072" in text


def test_a_run_says_what_it_is_and_where_it_wrote(config_file, tmp_path, capsys):
    out = tmp_path / "via-out"
    code, text = run_cli(capsys, "train", config_file, "steps=3", "--out", out)
    assert code == 0, text
    assert not (tmp_path / "from-config").exists()  # --out wins over the config's out, as out=… does
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["out"] == str(out) and saved["steps"] == 3 and saved["batch"]["global"] == 8
    assert "Parts" in text and "core (2 layers) ×r" in text and "inference GFLOPs" in text
    assert "Validation loss (nats/token) at step 3" in text and "r=1" in text and "r=4" in text
    assert f"Wrote {out / 'config.yaml'}, {out / 'log.jsonl'}" in text and f"{out / 'final'}/" in text


def test_the_progress_bar_shows_a_real_state_before_the_first_step_ends(workspace, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "progress_bar", RecordingBar)
    config = load_config(None, ["steps=2", "log.progress=true"], base=tiny_config(workspace, tmp_path / "run"))
    loop.Trainer(config).run()
    first, *after = RecordingBar.shown
    assert first.startswith("step 1: first forward and backward") and "nan" not in first
    assert len(after) == 2 and all(s.startswith("loss ") and "tok/s" in s for s in after)
