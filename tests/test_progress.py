"""Progress in a file: when standard output is not a terminal (Slurm, nohup, CI), long jobs print plain progress
lines at a steady interval, and they reach the file while the job still runs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import tiny_config, write_documents

from recurfit.errors import RecurfitError
from recurfit.progress import PlainLines, progress_bar


def run_until_lines(tmp_path: Path, argv: list[str], held: str, wanted: str, count: int) -> str:
    """`recurfit ARGV` in a fresh process with its output sent to a file and `held` (module:Class.method) made to
    wait, so the job cannot end, until the file shows `count` lines containing `wanted`; the file's text then."""
    log, release = tmp_path / "job.log", tmp_path / "release"
    module, _, attribute = held.partition(":")
    owner, _, method = attribute.partition(".")
    code = (
        "import importlib, pathlib, sys, time\n"
        f"target = importlib.import_module({module!r})\n"
        f"original = target.{owner}.{method}\n"
        "def held(*args, **kwargs):\n"
        f"    while not pathlib.Path({str(release)!r}).exists():\n"
        "        time.sleep(0.05)\n"
        "    return original(*args, **kwargs)\n"
        f"target.{owner}.{method} = held\n"
        "from recurfit.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    env = {"RECURFIT_PROGRESS_EVERY": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=output, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while log.read_text().count(wanted) < count:
            assert process.poll() is None, f"the job ended before its progress lines appeared:\n{log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        seen = log.read_text()
        assert process.poll() is None  # still running: the lines came during the job, not at its end
        release.touch()
        assert process.wait(timeout=120) == 0, log.read_text()
    finally:
        release.touch()
        process.kill() if process.poll() is None else None
    return seen


def test_plain_lines_every_n_items_and_at_the_end(monkeypatch, capsys):
    monkeypatch.setenv("RECURFIT_PROGRESS_EVERY", "2")
    with progress_bar() as bar:  # pytest's captured stdout is not a terminal
        assert isinstance(bar, PlainLines)
        task = bar.add_task("training", total=5, status="")
        for step in range(5):
            bar.update(task, advance=1, status=f"loss {5 - step:.4f}  {100:,} tok/s")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("  ")[0] for line in lines] == [
        "training: 2/5 (40%)",
        "training: 4/5 (80%)",
        "training: 5/5 (100%)",
    ]
    assert "loss 4.0000  100 tok/s" in lines[0] and "elapsed 0:00:00" in lines[0] and "eta " in lines[0]
    assert "eta" not in lines[-1]  # finished


def test_plain_lines_every_few_seconds_and_a_last_one_without_a_total(monkeypatch, capsys):
    monkeypatch.setenv("RECURFIT_PROGRESS_SECONDS", "0")
    monkeypatch.setenv("RECURFIT_PROGRESS_EVERY", "1000")
    with progress_bar() as bar:
        task = bar.add_task("tokenising", total=None)
        bar.advance(task, 512)
        bar.advance(task, 100)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["tokenising: 512", "tokenising: 612"]


def test_the_default_is_a_line_every_5_percent_and_a_disabled_bar_prints_nothing(monkeypatch, capsys):
    monkeypatch.delenv("RECURFIT_PROGRESS_EVERY", raising=False)
    with progress_bar() as bar:
        task = bar.add_task("loss", total=100)
        for _ in range(100):
            bar.advance(task)
    assert len(capsys.readouterr().err.splitlines()) == 20
    with progress_bar(disable=True) as bar:  # another rank than the main one
        bar.advance(bar.add_task("training", total=3), 3)
    assert capsys.readouterr().err == ""


def test_a_bad_interval_is_named(monkeypatch):
    monkeypatch.setenv("RECURFIT_PROGRESS_SECONDS", "often")
    with pytest.raises(RecurfitError, match="RECURFIT_PROGRESS_SECONDS='often': expected a number >= 0"):
        progress_bar()


def test_training_prints_its_steps_to_a_file_while_it_runs(workspace, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run", log={"progress": True})))
    seen = run_until_lines(
        tmp_path, ["train", str(config), "steps=4"], "recurfit.train.loop:Trainer.export", "training: ", 4
    )
    steps = [line for line in seen.splitlines() if line.startswith("training: ")]
    assert [line.split("  ")[0] for line in steps] == [f"training: {i}/4 ({i / 4:.0%})" for i in range(1, 5)]
    assert all("loss " in line and " tok/s" in line and "elapsed " in line for line in steps)
    assert "eta " in steps[0] and "Trained 4 steps" not in seen


def test_data_prepare_prints_its_progress_to_a_file_while_it_runs(workspace, tmp_path):
    write_documents(tmp_path / "docs.jsonl", 3000)  # three blocks of at most 1,024 documents, in one shard
    argv = ["data", "prepare", "--tokenizer", str(workspace / "parent"), "--source", str(tmp_path / "docs.jsonl")]
    argv += ["--seq-len", "32", "--workers", "1", "--out", str(tmp_path / "store")]
    # held as the shard is finished: after every block is tokenised, before the store exists
    seen = run_until_lines(tmp_path, argv, "recurfit.data.shards:ShardWriter.finish", "tokenising shard 0: ", 3)
    lines = [line for line in seen.splitlines() if line.startswith("tokenising shard 0: ")]
    counts = [int(line.split(": ")[1].split("  ")[0].replace(",", "")) for line in lines]
    assert len(counts) == 3 and 0 < counts[0] < counts[1] < counts[2]  # training tokens so far, growing
    assert all("elapsed " in line for line in lines)
    assert "training rows" not in seen


@pytest.mark.parametrize("main", [True, False])
def test_only_the_main_process_prints_progress(workspace, tmp_path, monkeypatch, capsys, main):
    from recurfit.train import load_config, loop
    from recurfit.train.distributed import Processes

    monkeypatch.setenv("RECURFIT_PROGRESS_EVERY", "1")
    config = load_config(None, ["steps=2"], base=tiny_config(workspace, tmp_path / "run", log={"progress": True}))
    trainer = loop.Trainer(config)
    monkeypatch.setattr(Processes, "is_main", property(lambda processes: main))  # as rank 1 would be
    trainer.run()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("training: ")]
    assert len(lines) == (2 if main else 0)
