"""Tests of `recurfit/train/checkpoint.py`."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    DISTILL,
    REPO,
    config_for,
    small_run,
    spawn_recurfit,
    stopped_run,
    tiny_config,
    train_losses,
)
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from recurfit.errors import RecurfitError
from recurfit.evaluate.over_training import find_snapshots
from recurfit.train import Trainer, load_config, train
from recurfit.train.checkpoint import newest_readable
from recurfit.train.metrics import read_log


class NotAState:  # a pickled object that torch.load(weights_only=True) refuses
    pass


def _rewrite_sums(folder: Path) -> None:
    """Checksums that match damaged files: the damage must be caught when the files are read, too."""
    lines = [
        f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}"
        for n in ("model.safetensors", "optimizer.pt", "trainer.json")
    ]
    (folder / "sha256sums.txt").write_text("\n".join(lines) + "\n")


def _truncate(folder: Path) -> str:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "model.safetensors"


def _flip_a_byte(folder: Path) -> str:
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-100] ^= 0x40  # inside the last tensor: it still loads, with one weight changed
    (folder / "model.safetensors").write_bytes(bytes(data))
    return "model.safetensors"


def _pickled_optimizer(folder: Path) -> str:
    import pickle

    (folder / "optimizer.pt").write_bytes(pickle.dumps({"optimizers": [NotAState()], "schedulers": []}))
    _rewrite_sums(folder)
    return "optimizer.pt"


def _trainer_json_without_counters(folder: Path) -> str:
    trainer = json.loads((folder / "trainer.json").read_text())
    del trainer["counters"]
    (folder / "trainer.json").write_text(json.dumps(trainer))
    _rewrite_sums(folder)
    return "trainer.json"


def test_a_resumed_distilled_run_equals_an_uninterrupted_one(tmp_path, workspace):
    settings = ("distill.alpha=0.4", *DISTILL, "depth.supervise.last=2")
    straight = config_for(workspace, tmp_path / "straight", "steps=8", "checkpoint.every=2", *settings)
    train(straight)
    config = stopped_run(workspace, tmp_path / "stopped", 4, *settings)
    train(config, resume=True)
    expected, got = read_log(tmp_path / "straight"), read_log(tmp_path / "stopped")
    pick = lambda log: [(r["loss"], r["ce"], r["kl"], r["flops_teacher"]) for r in log if r["kind"] == "train"]  # noqa: E731
    assert pick(got) == pick(expected) and len(pick(got)) == 8
    assert train_losses(tmp_path / "stopped") == train_losses(tmp_path / "straight")
    a, b = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("straight", "stopped"))
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
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


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_snapshot_disk_use_is_said_at_start(workspace, tmp_path, capsys):
    overrides = ["steps=2", "snapshots.every=1", "checkpoint.every=0"]
    train(load_config(None, overrides, base=tiny_config(workspace, tmp_path / "run")))
    weights = load_file(tmp_path / "run" / "snapshots" / "step-000000" / "model.safetensors")
    size = sum(t.numel() * t.element_size() for t in weights.values())
    said = " ".join(capsys.readouterr().err.split())
    # Steps 0 and 1 (step 2 is final/).
    assert f"Snapshots: every 1 steps, 2 × {size / 1e3:.1f} kB = {2 * size / 1e6:.1f} MB" in said


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_chained_run_can_carry_the_optimizer_state_and_data_position(tmp_path, workspace):
    train(load_config(None, [], base=small_run(workspace, tmp_path / "parent", steps=3)))
    checkpoint = newest_readable(tmp_path / "parent" / "checkpoints")
    overrides = ["model.path=null", "model.shape=null", f"model.init_from={tmp_path / 'parent'}", "steps=2"]
    carried = Trainer(
        load_config(None, [*overrides, "model.carry_state=true"], base=small_run(workspace, tmp_path / "b"))
    )
    fresh = Trainer(load_config(None, overrides, base=small_run(workspace, tmp_path / "c")))
    assert fresh.stream.position == 0 and all(not optimizer.state for optimizer in fresh.optimizers)
    # The moments are the parent's; the LR is this run's own schedule, not where the parent's ended.
    for optimizer, saved in zip(carried.optimizers, checkpoint.optimizer["optimizers"]):
        state = get_optimizer_state_dict(carried.model, optimizer, options=StateDictOptions(full_state_dict=True))
        assert state["state"].keys() == saved["state"].keys() and saved["state"]
        for name, values in saved["state"].items():
            assert all(torch.equal(state["state"][name][key], value) for key, value in values.items())
    assert [s.get_last_lr() for s in carried.schedulers] == [s.get_last_lr() for s in fresh.schedulers]
    assert [g["lr"] for o in carried.optimizers for g in o.param_groups] == [
        g["lr"] for o in fresh.optimizers for g in o.param_groups
    ]
    # The data continue where the parent stopped: its next rows, not the stream's first ones.
    assert carried.stream.position == checkpoint.trainer["stream"]["position"] > 0
    fresh.stream.load_state_dict(checkpoint.trainer["stream"])
    assert torch.equal(carried.stream.next_batch(8, 0, 1), fresh.stream.next_batch(8, 0, 1))
    with pytest.raises(RecurfitError, match="model.carry_state carries a finished run's state"):
        load_config(None, ["model.carry_state=true"], base=small_run(workspace, tmp_path / "d"))


@pytest.mark.two_processes
def test_a_sharded_checkpoint_carries_the_same_state_as_a_whole_one(tmp_path, workspace):
    """A run under torchrun (one process: a process group all the same) writes its checkpoint as DCP shards; a
    one-process run chained onto it carries the moments, data position and counters a one-process parent's whole
    checkpoint gives (bit for bit: a group of one reduces nothing), and a sharded checkpoint whose DCP metadata
    would unpickle anything but DCP's own classes is refused, naming the file."""
    for name, launcher in (
        ("whole", []),
        ("sharded", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]),
    ):
        config = {**small_run(workspace, tmp_path / name, steps=3), "checkpoint": {"every": 3, "keep": 1}}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        command = [sys.executable, *launcher, "-m", "recurfit", "train", str(tmp_path / f"{name}.yaml")]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "sharded" / "checkpoints" / "step-000003" / "state" / ".metadata").is_file()
    assert train_losses(tmp_path / "sharded") == train_losses(tmp_path / "whole")
    carried = {}
    for name in ("whole", "sharded"):
        overrides = ["model.path=null", "model.shape=null", f"model.init_from={tmp_path / name}", "steps=2"]
        base = small_run(workspace, tmp_path / f"{name}-carried")
        trainer = Trainer(load_config(None, [*overrides, "model.carry_state=true"], base=base))
        options = StateDictOptions(full_state_dict=True)
        carried[name] = [get_optimizer_state_dict(trainer.model, o, options=options) for o in trainer.optimizers]
        carried[name] = (carried[name], trainer.stream.state_dict(), vars(trainer.counters))
        trainer.close()
    (sharded, sharded_stream, sharded_counters), (whole, whole_stream, whole_counters) = carried.values()
    assert sharded[0]["state"]  # the moments are there
    for mine, theirs in zip(sharded, whole, strict=True):
        torch.testing.assert_close(mine["state"], theirs["state"], rtol=0, atol=0)
        assert mine["param_groups"] == theirs["param_groups"]
    assert sharded_stream == whole_stream and sharded_stream["position"] > 0
    assert sharded_counters == whole_counters
    metadata = tmp_path / "sharded" / "checkpoints" / "step-000003" / "state" / ".metadata"
    metadata.write_bytes(pickle.dumps({"a": __import__("collections").Counter()}))  # not DCP's: refused
    sums = metadata.parents[1] / "sha256sums.txt"
    digest = hashlib.sha256(metadata.read_bytes()).hexdigest()
    sums.write_text("".join(
        f"{digest}  state/.metadata\n" if line.endswith("state/.metadata") else line + "\n"
        for line in sums.read_text().splitlines()
    ))  # fmt: skip
    with pytest.raises(RecurfitError, match=r"\.metadata cannot be read \(UnpicklingError: collections.Counter"):
        newest_readable(metadata.parents[2])


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_0(tmp_path, workspace, monkeypatch):
    out = tmp_path / "run"
    config = config_for(workspace, out, "steps=6", "max_bad_steps=2", "checkpoint.every=4")
    trainer = Trainer(config)
    real = trainer._micro_batch_loss
    monkeypatch.setattr(trainer, "_micro_batch_loss", lambda *a: real(*a) * float("nan"))
    with pytest.raises(RecurfitError, match="2 non-finite losses"):
        trainer.run()
    trainer.log.close()
    assert [(r["kind"], r["step"]) for r in read_log(out)] == [("start", 0), ("train", 1)]
    assert not (out / "checkpoints").exists()
    with pytest.raises(
        RecurfitError, match="stopped before its first checkpoint; pass --resume to continue it, or --force"
    ):
        train(config)
    result = train(config, resume=True)
    assert result.counters.step == 6 and list(train_losses(out)) == [1, 2, 3, 4, 5, 6]  # step 1 logged once


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_run_killed_while_exporting_finishes_without_a_second_validation(tmp_path, workspace):
    out = tmp_path / "run"
    config = config_for(workspace, out, "steps=3")
    train(config)
    evaluations = [r for r in read_log(out) if r["kind"] == "eval"]
    shutil.rmtree(out / "final")
    (out / ".final.partial-deadbeef").mkdir()  # what the killed export left
    (out / ".final.partial-deadbeef" / "model.safetensors").write_bytes(b"half")
    train(config, resume=True)
    assert (out / "final" / "config.json").is_file() and not list(out.glob(".final.*"))
    assert [r for r in read_log(out) if r["kind"] == "eval"] == evaluations


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_failing_final_validation_loses_neither_the_checkpoint_nor_the_final_model(
    tmp_path, workspace, monkeypatch, capsys
):
    """The final validation runs after the final checkpoint and export: an out-of-memory error there (injected)
    leaves both written, and the final model equal to the one of a run whose validation succeeds."""
    from recurfit.train import validation_loss

    config = config_for(workspace, tmp_path / "run", "steps=3")
    whole = train(config_for(workspace, tmp_path / "whole", "steps=3"))
    card = (whole.out / "final" / "README.md").read_text()
    assert "## Validation loss (nats/token, step 3)" in card  # added to the card after the export

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("injected: out of memory in the final validation")

    monkeypatch.setattr(validation_loss, "depth_losses", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        train(config)
    out = tmp_path / "run"
    assert f"the final model is saved: `recurfit eval loss {out / 'final'}`" in " ".join(
        capsys.readouterr().err.split()
    )
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")] == ["step-000003"]
    expected, got = (load_file(folder / "final" / "model.safetensors") for folder in (whole.out, out))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert [r["kind"] for r in read_log(out)][-1] == "save"  # no eval record: validation never finished
    assert "## Validation loss" not in (out / "final" / "README.md").read_text()


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte, _pickled_optimizer, _trainer_json_without_counters])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, workspace, capsys, damage):
    out = tmp_path / "run"
    config = stopped_run(workspace, out)
    capsys.readouterr()
    name = damage(out / "checkpoints" / "step-000004")
    resumed = Trainer(config, resume=True)
    assert resumed.counters.step == 2 and resumed.stream.position == 16
    said = " ".join(capsys.readouterr().err.split())
    assert f"Skipping a damaged checkpoint: {out / 'checkpoints' / 'step-000004' / name}" in said
    assert "Resuming from step-000002 instead" in said
    resumed.close()
    damage(out / "checkpoints" / "step-000002")
    with pytest.raises(RecurfitError, match=rf"Cannot read checkpoint .*step-000004/{name}.*--force"):
        Trainer(config, resume=True)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_checkpoint_from_before_checksums_resumes_unverified_and_says_so(tmp_path, workspace, capsys):
    out = tmp_path / "run"
    config = stopped_run(workspace, out)
    capsys.readouterr()
    (out / "checkpoints" / "step-000004" / "sha256sums.txt").unlink()  # as an earlier recurfit wrote it
    resumed = Trainer(config, resume=True)
    assert resumed.counters.step == 4
    assert "has no sha256sums.txt (written by an earlier recurfit)" in " ".join(capsys.readouterr().err.split())
    resumed.close()


def test_sigkill_then_resume_gives_the_same_losses(tmp_path, workspace):
    base = tiny_config(workspace, tmp_path / "x", steps=60, checkpoint={"every": 10, "keep": 2})
    for name in ("straight", "killed"):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**base, "out": str(tmp_path / name)}))
    straight = spawn_recurfit(
        "train", str(tmp_path / "straight.yaml"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    killed = spawn_recurfit(
        "train", str(tmp_path / "killed.yaml"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    log = tmp_path / "killed" / "log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 25):
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    assert not (tmp_path / "killed" / "final").exists(), "the run finished before it could be killed"
    resumed = spawn_recurfit(
        "train", str(tmp_path / "killed.yaml"), "--resume", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert resumed.wait() == 0, resumed.stderr.read().decode()[-2000:]
    assert straight.wait() == 0

    expected, got = train_losses(tmp_path / "straight"), train_losses(tmp_path / "killed")
    assert list(got) == list(range(1, 61))  # each step logged once: the killed run's extra steps were dropped
    assert got == expected
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("straight", "killed"))
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_a_failed_checkpoint_write_leaves_the_previous_one_intact(tmp_path, workspace, monkeypatch):
    import recurfit.train.checkpoint as checkpoint

    trainer = Trainer(load_config(None, ["steps=4"], base=tiny_config(workspace, tmp_path / "run")))
    for _ in range(2):
        trainer.train_step()
    trainer.checkpoint()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    trainer.train_step()
    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    with pytest.raises(RecurfitError, match="No space left on device.*--resume"):
        trainer.checkpoint()
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step-000002"]  # no half-written step-000003
    resumed = Trainer(load_config(None, ["steps=4"], base=tiny_config(workspace, tmp_path / "run")), resume=True)
    assert resumed.counters.step == 2 and resumed.stream.position == 16
