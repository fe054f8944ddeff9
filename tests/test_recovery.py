"""Runs that survive every stop: one owner per folder, --resume and --force, damaged checkpoints, a log cut short,
leftovers of killed jobs, permissions, and bad inputs that are one line instead of a traceback."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import char_tokenizer, run_cli, write_documents
from test_train import REPO, tiny_config, train_losses

from recurfit.data import prepare
from recurfit.errors import RecurfitError
from recurfit.train import Trainer, load_config, train
from recurfit.train.metrics import read_log


def config_for(workspace: Path, out: Path, *overrides: str, **sections):
    return load_config(None, list(overrides), base=tiny_config(workspace, out, **sections))


def stopped_run(workspace: Path, out: Path, steps_done: int = 4, *overrides: str):
    """A run of 8 steps that stopped (as if killed) after `steps_done`, with a checkpoint every 2 steps."""
    config = config_for(workspace, out, "steps=8", "checkpoint.every=2", *overrides)
    trainer = Trainer(config)
    for _ in range(steps_done):
        trainer.log.write(trainer.train_step())
        if trainer.counters.step % 2 == 0:
            trainer.checkpoint()
    trainer.log.close()
    return config


def snapshot(folder: Path) -> dict:
    """Every file and folder under `folder`, with its content's hash: equal snapshots mean nothing changed."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        for path in sorted(folder.rglob("*"))
    }


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


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, workspace, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run", steps=3)))
    assert run_cli(capsys, "train", config)[0] == 0
    before = snapshot(tmp_path / "run")
    code, text = run_cli(capsys, "train", config, "--resume")
    assert code == 0 and "is already finished (3 steps): nothing to do" in text
    assert snapshot(tmp_path / "run") == before


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


def test_a_log_write_that_fails_stops_the_run_and_the_torn_line_is_dropped_on_resume(tmp_path, workspace, monkeypatch):
    out = tmp_path / "run"
    config = config_for(workspace, out, "steps=6", "checkpoint.every=2")
    trainer = Trainer(config)
    real_write = os.write

    def disk_fills_at_step_3(fd, data):
        if fd == trainer.log.fd and trainer.counters.step == 3:
            real_write(fd, data[:20])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_fills_at_step_3)
    with pytest.raises(RecurfitError, match=r"Cannot write .*log.jsonl \(No space left on device\).*--resume"):
        trainer.run()
    monkeypatch.undo()
    trainer.log.close()
    assert not (out / "log.jsonl").read_text().endswith("\n")  # the torn record
    result = train(config, resume=True)
    assert result.counters.step == 6 and list(train_losses(out)) == [1, 2, 3, 4, 5, 6]


def test_a_damaged_log_line_before_the_last_names_the_file_and_line(tmp_path):
    (tmp_path / "log.jsonl").write_text(
        '{"kind": "train", "step": 1}\n{"kind": "tr\n{"kind": "train", "step": 2}\n{"ki'
    )
    with pytest.raises(RecurfitError, match=r"log.jsonl:2 is not a log record"):
        read_log(tmp_path)
    (tmp_path / "log.jsonl").write_text('{"kind": "train", "step": 1}\n{"kind": "tr')
    assert read_log(tmp_path) == [{"kind": "train", "step": 1}]


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


@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte, _pickled_optimizer, _trainer_json_without_counters])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, workspace, capsys, damage):
    out = tmp_path / "run"
    config = stopped_run(workspace, out)
    capsys.readouterr()
    name = damage(out / "checkpoints" / "step-000004")
    resumed = Trainer(config, resume=True)
    assert resumed.counters.step == 2 and resumed.stream.position == 16
    said = " ".join(capsys.readouterr().out.split())
    assert f"Skipping a damaged checkpoint: {out / 'checkpoints' / 'step-000004' / name}" in said
    assert "Resuming from step-000002 instead" in said
    resumed.close()
    damage(out / "checkpoints" / "step-000002")
    with pytest.raises(RecurfitError, match=rf"Cannot read checkpoint .*step-000004/{name}.*--force"):
        Trainer(config, resume=True)


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


# ---------------------------------------------------------------- owners, leftovers, permissions

HOLD = """
import os, sys, time
from recurfit.io.lock import owned
with owned(sys.argv[1]):
    if len(sys.argv) > 2:
        os.mkdir(sys.argv[2])  # a staging folder, as a job killed mid-write leaves it
    print("holding", flush=True)
    time.sleep(120)
"""


def _holder(*paths) -> subprocess.Popen:
    """Another process that owns `paths[0]` until it is killed."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, *map(str, paths)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_two_prepares_into_one_store_do_not_both_proceed_and_a_killed_ones_leftovers_go(tmp_path):
    tokenizer = char_tokenizer()
    write_documents(tmp_path / "docs.jsonl", 60)
    source, store = [str(tmp_path / "docs.jsonl")], tmp_path / "store"
    holder = _holder(store, tmp_path / ".store.partial-killed")
    try:
        with pytest.raises(RecurfitError, match=rf"{store} is in use by process {holder.pid} on .*; wait for it"):
            prepare(tokenizer, source, 16, store, val_fraction=0.2, show_progress=False)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / ".store.partial-killed").is_dir() and not store.exists()
    prepare(tokenizer, source, 16, store, val_fraction=0.2, show_progress=False)  # the kernel dropped the lock
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "store"]  # no staging folder, no lock file


def test_a_second_train_on_a_live_run_names_the_first_ones_pid(tmp_path, workspace):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run", steps=400)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        [sys.executable, "-m", "recurfit", "train", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (tmp_path / "run" / "log.jsonl").exists():
            time.sleep(0.05)
        for extra in ([], ["--resume"]):
            second = subprocess.run(
                [sys.executable, "-m", "recurfit", "train", str(config), *extra],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            said = " ".join(second.stdout.split())
            assert second.returncode == 2 and f"is in use by process {first.pid}" in said, said + second.stderr[-2000:]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    from recurfit.io.lock import owned

    with owned(tmp_path / "run"):  # the killed run left no lock behind
        pass


def test_outputs_get_the_permissions_of_the_umask(tmp_path, workspace):
    previous = os.umask(0o022)
    try:
        write_documents(tmp_path / "docs.jsonl", 60)
        prepare(
            char_tokenizer(),
            [str(tmp_path / "docs.jsonl")],
            16,
            tmp_path / "store",
            val_fraction=0.2,
            show_progress=False,
        )
        train(config_for(workspace, tmp_path / "run", "steps=2"))
    finally:
        os.umask(previous)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    for path in (tmp_path / "store", checkpoint, tmp_path / "run" / "final"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
    for path in (
        tmp_path / "store" / "shards" / "00000.train.bin",
        checkpoint / "model.safetensors",
        tmp_path / "run" / "final" / "model.safetensors",
    ):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


# ---------------------------------------------------------------- bad inputs: one line, exit 2


def _copy_store(workspace: Path, tmp_path: Path, edit) -> Path:
    store = tmp_path / "store"
    shutil.copytree(workspace / "prose", store)
    meta = json.loads((store / "meta.json").read_text())
    edit(store, meta)
    (store / "meta.json").write_text(json.dumps(meta))
    return store


def test_bad_stores_are_refused_before_training(tmp_path, workspace):
    def no_training_rows(store, meta):
        meta["rows"]["train"] = meta["shards"][0]["tokens"]["train"] = 0
        (store / "shards" / "00000.train.bin").write_bytes(b"")

    def foreign_ids(store, meta):
        rows = np.fromfile(store / "shards" / "00000.train.bin", dtype=np.uint16)
        rows[33 * 5 + 7] = 200  # row 5 holds an id the 97-token model has no embedding for
        rows.tofile(store / "shards" / "00000.train.bin")

    for edit, message in (
        (no_training_rows, "has no training rows"),
        (foreign_ids, r"\(train row 5\) holds token id 200, but the model"),
        (lambda s, m: m.pop("rows"), r"meta.json: 'rows' is missing"),
        (lambda s, m: m.update(seq_len="32"), r"'seq_len' must be a whole number >= 1, got '32'"),
    ):
        store = _copy_store(workspace, tmp_path, edit)
        phases = [{"sources": [str(store)]}]
        with pytest.raises(RecurfitError, match=message):
            train(config_for(workspace, tmp_path / "run", "steps=8", data={"phases": phases, "validation": []}))
        shutil.rmtree(store)
        shutil.rmtree(tmp_path / "run", ignore_errors=True)


def test_validation_stores_are_named_and_one_without_rows_is_refused(tmp_path, workspace, capsys):
    train(config_for(workspace, tmp_path / "run", "steps=2"))
    said = " ".join(capsys.readouterr().out.split())
    assert f"Validation: {workspace / 'prose'} (4 rows), {workspace / 'math'} (4 rows)." in said
    write_documents(tmp_path / "docs.jsonl", 60)
    prepare(
        char_tokenizer(), [str(tmp_path / "docs.jsonl")], 32, tmp_path / "no-val", val_fraction=0, show_progress=False
    )
    with pytest.raises(
        RecurfitError, match=r"no-val has no validation rows .*--val-fraction 0\).*drop it from data.validation"
    ):
        train(config_for(workspace, tmp_path / "other", "steps=2", f"data.validation=[{tmp_path / 'no-val'}]"))
    code, text = run_cli(
        capsys, "eval", "loss", workspace / "parent", "--data", tmp_path / "no-val", "--out", tmp_path / "e"
    )
    assert code == 2 and "no-val has no validation rows" in text and not (tmp_path / "e").exists()


def test_config_values_out_of_range_and_bad_overrides_are_one_line(tmp_path, workspace):
    base = tiny_config(workspace, tmp_path / "run")
    for override, message in (
        ("max_bad_steps=0", "max_bad_steps must be >= 1, got 0"),
        ("checkpoint.every=-1", "checkpoint.every must be >= 0, got -1"),
        ("eval.rows=0", "eval.rows must be >= 1"),
        ("log.every=0", "log.every must be >= 1"),
        ("optimizer.lr=0", "optimizer.lr must be > 0"),
        ("optimizer.betas=[0.9]", "optimizer.betas must be two"),
        ("steps=[1,", r"Override 'steps=\[1,': '\[1,' is not a YAML value"),
        ("data.phases=[{sources: []}]", r"data.phases\[0\] has no sources"),
    ):
        with pytest.raises(RecurfitError, match=message):
            load_config(None, [override], base=base)
    layers = ["model.shape=null", "model.prelude=[3]", "model.core=[1,2]", "model.coda=[5]"]
    with pytest.raises(RecurfitError, match=r"must run in parent order"):
        load_config(None, layers, base=base)


def test_a_baseline_of_an_unsupported_family_is_refused(tmp_path, workspace):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(
        tmp_path / "gpt2"
    )
    config = config_for(workspace, tmp_path / "run", "model.shape=null", f"model.path={tmp_path / 'gpt2'}")
    with pytest.raises(RecurfitError, match="model.path is a gpt2 model"):
        train(config)
    assert not (tmp_path / "run").exists()


def test_overrides_may_follow_resume(tmp_path, workspace, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run", steps=2)))
    code, text = run_cli(capsys, "train", config, "--resume", "steps=3", "optimizer.name=adamw")
    assert code == 0 and "Trained 3 steps" in text
    with pytest.raises(SystemExit):  # argparse: usage and the unknown option, exit 2
        run_cli(capsys, "train", config, "--resume", "--what")


def test_a_checkpoint_from_before_checksums_resumes_unverified_and_says_so(tmp_path, workspace, capsys):
    out = tmp_path / "run"
    config = stopped_run(workspace, out)
    capsys.readouterr()
    (out / "checkpoints" / "step-000004" / "sha256sums.txt").unlink()  # as an earlier recurfit wrote it
    resumed = Trainer(config, resume=True)
    assert resumed.counters.step == 4
    assert "has no sha256sums.txt (written by an earlier recurfit)" in " ".join(capsys.readouterr().out.split())
    resumed.close()
