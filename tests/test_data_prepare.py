"""Tests of `recurfit/data/prepare.py`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import SMALL, char_tokenizer, write_documents

from recurfit.data import TokenStore, prepare
from recurfit.errors import RecurfitError

REPO = Path(__file__).resolve().parents[1]


def store_contents(folder: Path) -> tuple[dict, dict[str, bytes]]:
    """meta.json and every file's bytes: two stores are the same store when these are equal."""
    files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    return json.loads(files.pop("meta.json")), files


KILLABLE = """
import sys, time
sys.path.insert(0, {tests!r})
from conftest import char_tokenizer
from recurfit.data import packing, prepare
from recurfit.data.shards import Layout
slow = packing.BlockEncoder.__call__
def slower(self, texts):
    time.sleep(0.05)
    return slow(self, texts)
packing.BlockEncoder.__call__ = slower
prepare(char_tokenizer(), [{source!r}], 16, {out!r}, val_fraction=0.1, layout=Layout(16, 4), show_progress=False)
"""


TASK = """
import sys, time
sys.path.insert(0, {tests!r})
from conftest import char_tokenizer
from recurfit.data import packing, prepare
from recurfit.data.shards import Layout
slow = packing.BlockEncoder.__call__
packing.BlockEncoder.__call__ = lambda self, texts: time.sleep(0.01) or slow(self, texts)
result = prepare(char_tokenizer(), [{source!r}], 16, {out!r}, val_fraction=0.1, layout=Layout(16, 4),
                 max_tokens=9000, task=({index}, 2), show_progress=False)
print("wrote the store" if result.meta is not None and not result.skipped else "waited")
"""


def test_prepare_is_idempotent_and_refuses_other_jobs(tmp_path):
    tokenizer = char_tokenizer()
    write_documents(tmp_path / "docs.jsonl", 40)
    source, settings = [str(tmp_path / "docs.jsonl")], {"show_progress": False, "val_fraction": 0.2}
    first = prepare(tokenizer, source, 16, tmp_path / "store", **settings)
    mtime = (tmp_path / "store" / "shards" / "00000.train.bin").stat().st_mtime_ns
    again = prepare(tokenizer, source, 16, tmp_path / "store", **settings)
    assert again.skipped and not first.skipped
    assert (tmp_path / "store" / "shards" / "00000.train.bin").stat().st_mtime_ns == mtime
    with pytest.raises(RecurfitError, match="already exists"):
        prepare(tokenizer, source, 8, tmp_path / "store", **settings)
    assert TokenStore(tmp_path / "store").seq_len == 16  # untouched
    assert prepare(tokenizer, source, 8, tmp_path / "store", force=True, **settings).meta["seq_len"] == 8


def test_every_store_gets_a_validation_row_or_prepare_says_how(tmp_path):
    tokenizer = char_tokenizer()
    write_documents(tmp_path / "docs.jsonl", 40)
    source = [str(tmp_path / "docs.jsonl")]
    with pytest.raises(
        RecurfitError,
        match=r"store: the held-out share \(--val-fraction 0.01\) of 40 documents .*"
        r"less than one validation row of 17; pass --val-fraction 0.08 or more",
    ):
        prepare(tokenizer, source, 16, tmp_path / "store", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]  # nothing half-written
    result = prepare(tokenizer, source, 16, tmp_path / "store", val_fraction=0.08, show_progress=False)
    assert result.meta["rows"]["val"] > 0


def test_one_worker_two_workers_and_two_tasks_make_the_same_store(tmp_path, documents):
    tokenizer = char_tokenizer()
    settings = dict(val_fraction=0.1, show_progress=False, layout=SMALL, max_tokens=5000)
    one = prepare(tokenizer, documents, 16, tmp_path / "one", workers=1, **settings)
    two = prepare(tokenizer, documents, 16, tmp_path / "two", workers=2, **settings)
    first = prepare(tokenizer, documents, 16, tmp_path / "tasks", task=(1, 2), **settings)
    assert first.meta is None and first.missing and not (tmp_path / "tasks").exists()  # waits for task 0
    last = prepare(tokenizer, documents, 16, tmp_path / "tasks", task=(0, 2), workers=2, **settings)
    assert len(one.meta["shards"]) > 2 and one.meta["budget_reached"]
    reference = store_contents(tmp_path / "one")
    assert store_contents(tmp_path / "two") == reference
    assert store_contents(tmp_path / "tasks") == reference
    assert last.meta == one.meta == two.meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "one", "tasks", "two"]  # nothing left over
    # The checksums recorded are those of the files.
    import hashlib

    for shard in one.meta["shards"]:
        for split in ("train", "val"):
            data = (tmp_path / "one" / "shards" / f"{shard['name']}.{split}.bin").read_bytes()
            assert hashlib.sha256(data).hexdigest() == shard["sha256"][split]
            assert len(data) == 2 * shard["tokens"][split]


def test_the_budget_stops_a_streaming_source(tmp_path, monkeypatch, capsys):
    from recurfit.data import sources

    read = []

    def endless(spec):
        for index in range(10**9):
            read.append(index)
            yield {"text": f"document {index} " + "abc " * (index % 7)}

    monkeypatch.setattr(sources, "_hub_dataset", endless)
    tokenizer = char_tokenizer()
    meta = prepare(
        tokenizer, ["hf:some/stream"], 16, tmp_path / "s", max_tokens=3000, layout=SMALL, show_progress=False
    ).meta
    train_tokens = sum(shard["tokens"]["train"] for shard in meta["shards"])
    assert meta["budget_reached"] and 3000 <= train_tokens < 3000 + 4 * 40  # stops at the end of a block
    assert len(read) < 200  # ~100 documents hold the budget; the reader stopped, give or take the queue
    # A source that runs dry finishes the store and says how far it got.
    lines = []
    write_documents(tmp_path / "few.jsonl", 30)
    meta = prepare(
        tokenizer,
        [str(tmp_path / "few.jsonl")],
        16,
        tmp_path / "dry",
        max_tokens=10**6,
        val_fraction=0.2,
        show_progress=False,
        say=lines.append,
    ).meta
    assert meta["budget_reached"] is False and meta["documents"] == 30
    assert any(
        line.startswith("The sources ran dry at ") and "of the --max-tokens budget of 1,000,000" in line
        for line in lines
    ), lines


def test_disk_size_is_said_up_front_and_a_short_disk_refused(tmp_path, documents, monkeypatch):
    module = sys.modules["recurfit.data.prepare"]

    lines = []
    monkeypatch.setattr(module, "free_bytes", lambda folder: 10_000)
    with pytest.raises(RecurfitError, match=r"has 10.0 kB free but the store needs 2.0 MB more; free space"):
        prepare(
            char_tokenizer(), documents, 16, tmp_path / "s", max_tokens=10**6, show_progress=False, say=lines.append
        )
    assert (
        lines == ["Expected size on disk: 2.0 MB for 1,010,101 tokens × 2 bytes; 10.0 kB free where it is written."]
        or "Expected size on disk" in lines[0]
    )
    assert not (tmp_path / "s").exists()


def test_a_killed_prepare_resumes_to_the_store_of_an_uninterrupted_one(tmp_path, documents, monkeypatch):
    from recurfit.data import packing

    out = tmp_path / "killed"
    script = KILLABLE.format(tests=str(REPO / "tests"), source=documents[0], out=str(out))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(tmp_path.glob(".killed.building-*/shards/*.json"))) < 3:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    building = next(tmp_path.glob(".killed.building-*"))
    done = sorted(p.stem for p in building.glob("shards/*.json"))
    assert 3 <= len(done) < 19 and not out.exists()  # killed midway
    # A finished shard damaged after the kill is found by its checksum and made again.
    damaged = building / "shards" / f"{done[0]}.train.bin"
    data = bytearray(damaged.read_bytes())
    data[5] ^= 1
    damaged.write_bytes(bytes(data))
    calls = []
    real = packing.BlockEncoder.__call__
    monkeypatch.setattr(packing.BlockEncoder, "__call__", lambda self, texts: calls.append(1) or real(self, texts))
    resumed = prepare(char_tokenizer(), documents, 16, out, val_fraction=0.1, layout=SMALL, show_progress=False)
    assert len(calls) <= 75 - 4 * (len(done) - 1)  # the intact finished shards were not tokenised again
    monkeypatch.undo()
    reference = prepare(
        char_tokenizer(), documents, 16, tmp_path / "whole", val_fraction=0.1, layout=SMALL, show_progress=False
    )
    assert resumed.meta == reference.meta
    assert store_contents(out) == store_contents(tmp_path / "whole")


def test_two_tasks_running_at_once_make_the_store_once(tmp_path, documents):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tasks = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                TASK.format(tests=str(REPO / "tests"), source=documents[0], out=str(tmp_path / "s"), index=index),
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            text=True,
        )
        for index in (0, 1)
    ]
    said = [task.communicate(timeout=300)[0].strip() for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0]
    assert sorted(said) == ["waited", "wrote the store"]  # exactly one task wrote meta.json
    reference = prepare(
        char_tokenizer(),
        documents,
        16,
        tmp_path / "one",
        val_fraction=0.1,
        layout=SMALL,
        max_tokens=9000,
        show_progress=False,
    )
    assert reference.meta["budget_reached"]
    assert store_contents(tmp_path / "s") == store_contents(tmp_path / "one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "one", "s"]
