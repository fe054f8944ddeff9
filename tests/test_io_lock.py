"""Runs that survive every stop: one owner per folder, --resume and --force, damaged checkpoints, a log cut short,
leftovers of killed jobs, permissions, and bad inputs that are one line instead of a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import REPO, char_tokenizer, tiny_config, write_documents

from recurfit.data import prepare
from recurfit.errors import RecurfitError

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
            said = " ".join(second.stderr.split())  # an error: stderr
            assert second.returncode == 2 and f"is in use by process {first.pid}" in said, said[-2000:]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    from recurfit.io.lock import owned

    with owned(tmp_path / "run"):  # the killed run left no lock behind
        pass
