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


def test_a_staged_file_appears_whole_with_the_umask_or_not_at_all(tmp_path):
    import pytest

    from recurfit.errors import RecurfitError
    from recurfit.io.files import staged_file

    target = tmp_path / "figure.png"
    with pytest.raises(OSError):
        with staged_file(target) as staging:
            assert staging.parent == tmp_path and staging.suffix == ".png"  # writers pick the format by the suffix
            staging.write_bytes(b"half")
            raise OSError("the writer failed")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its staging copy
    previous = os.umask(0o022)
    try:
        with staged_file(target) as staging:
            os.close(os.open(staging, os.O_WRONLY | os.O_CREAT, 0o600))  # as some writers create files
            staging.write_bytes(b"whole")
    finally:
        os.umask(previous)
    assert target.read_bytes() == b"whole" and stat.S_IMODE(target.stat().st_mode) == 0o644
    with pytest.raises(RecurfitError, match="already exists; pass --force"):
        with staged_file(target) as staging:
            pass
    with staged_file(target, replace=True) as staging:
        staging.write_bytes(b"new")
    assert target.read_bytes() == b"new" and sorted(tmp_path.iterdir()) == [target]
