"""Runs that survive every stop: one owner per folder, --resume and --force, damaged checkpoints, a log cut short,
leftovers of killed jobs, permissions, and bad inputs that are one line instead of a traceback."""

from __future__ import annotations

import errno
import os

import pytest
from conftest import config_for, train_losses

from recurfit.errors import RecurfitError
from recurfit.train import Trainer, train
from recurfit.train.metrics import read_log


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
