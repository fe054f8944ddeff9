"""Runs that survive every stop: one owner per folder, --resume and --force, damaged checkpoints, a log cut short,
leftovers of killed jobs, permissions, and bad inputs that are one line instead of a traceback."""

from __future__ import annotations

import os
import stat

from conftest import char_tokenizer, config_for, write_documents

from recurfit.data import prepare
from recurfit.train import train


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
