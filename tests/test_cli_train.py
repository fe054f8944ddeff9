"""Tests of `recurfit/cli/train.py`."""

from __future__ import annotations

import pytest
import yaml
from conftest import run_cli, tiny_config
from conftest import run_cli as run

from recurfit.train import loop


@pytest.fixture
def tiny_config_file(workspace, tmp_path):
    import yaml

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run")))
    return path


@pytest.fixture
def config_file(workspace, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run")))
    return path


def test_data_prepare_and_train_from_the_command_line(workspace, tmp_path, capsys):
    from conftest import write_documents

    write_documents(tmp_path / "docs.jsonl", 60)
    args = [
        "data",
        "prepare",
        "--tokenizer",
        workspace / "parent",
        "--source",
        tmp_path / "docs.jsonl",
        "--seq-len",
        "16",
        "--val-fraction",
        "0.2",
    ]
    code, text = run(capsys, *args, "--out", tmp_path / "data")
    assert code == 0 and "training rows" in text
    code, text = run(capsys, *args, "--out", tmp_path / "data")
    assert code == 0 and "nothing to do" in text

    config = tmp_path / "run.yaml"
    config.write_text(
        f"out: {tmp_path / 'run'}\nmodel: {{path: {workspace / 'parent'}, shape: [2, 2, 2]}}\n"
        f"data: {{phases: [{{sources: [{tmp_path / 'data'}]}}]}}\n"
        "depth: {mean_recurrence: 2, backprop_depth: 1}\nbatch: {micro: 2, global: 4}\nsteps: 3\n"
        "log: {progress: false}\n"
    )
    code, text = run(capsys, "train", config, "optimizer.name=adamw")
    assert code == 0 and "Trained 3 steps" in text and (tmp_path / "run" / "final" / "config.json").is_file()


def test_dry_run_prints_the_plan_and_says_whether_it_fits(tiny_config_file, capsys):
    from conftest import run_cli

    # precision=auto (the tests' config pins fp32): a plan for --device-memory is a GPU's, where auto autocasts to bf16
    argv = ["train", tiny_config_file, "precision=auto", "--dry-run", "--device-memory", "80GB", "--world-size", "2"]
    code, text = run_cli(capsys, *argv)
    assert code == 0, text
    assert "Memory plan per device: micro-batch 2 × 32 tokens, k = 2 with gradient, bf16 autocast, 2 × DDP" in text
    assert "activations" in text and "optimizer muon" in text and "Fits: predicted peak" in text
    for units in ("recurrence", "layer"):  # FSDP2's plan has parts of its own
        code, text = run_cli(capsys, *argv, "distributed=fsdp", f"fsdp_units={units}")
        assert code == 0, text
        assert "2 × FSDP" in text and "unsharded gradients" in text and "Fits: predicted peak" in text


def test_dry_run_that_does_not_fit_is_a_one_line_error(tiny_config_file, capsys):
    from conftest import run_cli

    code, text = run_cli(capsys, "train", tiny_config_file, "--dry-run", "--device-memory", "1MB")
    assert code != 0
    assert "error: Does not fit: predicted peak" in text and "no micro-batch fits" in text
    code, text = run_cli(capsys, "train", tiny_config_file, "--dry-run", "--device-memory", "lots")
    assert code != 0 and "--device-memory must be a size such as 80GB" in text


def test_a_run_that_does_not_fit_warns_and_goes_on(tiny_config_file, capsys):
    import argparse

    from recurfit.cli.train import _warn_memory
    from recurfit.train import load_config

    config = load_config(tiny_config_file)
    lines = []
    args = argparse.Namespace(device_memory="1MB", world_size=None)
    _warn_memory(config, args, 10**6, lambda line, **_: lines.append(line))
    assert len(lines) == 1 and lines[0].startswith("[yellow]warning:[/] Does not fit: predicted peak")


def test_overrides_may_follow_resume(tmp_path, workspace, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run", steps=2)))
    code, text = run_cli(capsys, "train", config, "--resume", "steps=3", "optimizer.name=adamw")
    assert code == 0 and "Trained 3 steps" in text
    with pytest.raises(SystemExit):  # argparse: usage and the unknown option, exit 2
        run_cli(capsys, "train", config, "--resume", "--what")


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
