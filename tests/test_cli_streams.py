"""Every command writes its results on stdout and its progress, statistics, notices and errors on stderr: a
user who redirects stdout (`recurfit generate … > out.txt`) gets the result alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml
from conftest import tiny_config, write_documents

from recurfit.cli import main


def streams(capsys, *argv) -> tuple[int, str, str]:
    """`recurfit ARGV…` in this process: its exit status, stdout and stderr (each with rich's wrapping undone)."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, " ".join(captured.out.split()), " ".join(captured.err.split())


@pytest.fixture(scope="module")
def retrofitted(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("streams") / "rec"
    assert main(["retrofit", "--model", str(workspace / "parent"), "--shape", "2,2,2", "--out", str(out)]) == 0
    return out


def test_generate_writes_the_text_alone_on_stdout(retrofitted, capsys, monkeypatch):
    import recurfit.generation

    capsys.readouterr()
    code, out, err = streams(capsys, "generate", retrofitted, "--prompt", "the cat", "-r", "3", "--max-new-tokens", "5")
    assert code == 0 and "5 tokens in" in err and "recurrences per token: mean 3.0" in err
    assert "tokens in" not in out and "recurrences per token" not in out
    done = SimpleNamespace(text="Paris.", tokens=2, seconds=0.5, steps_per_token=[3, 3], acceptance_rate=None)
    monkeypatch.setattr(recurfit.generation, "generate_text", lambda *args, **kwargs: done)
    code, out, err = streams(capsys, "generate", retrofitted, "--prompt", "the cat")
    assert code == 0 and out == "Paris." and "2 tokens in 0.5 s" in err
    code, out, err = streams(capsys, "generate", "--prompt", "the cat")  # the embedded model: a notice on stderr
    assert code == 0 and out == "Paris." and "not trained" in err


def test_retrofit_and_inspect_write_their_results_on_stdout(workspace, retrofitted, tmp_path, capsys):
    code, out, err = streams(
        capsys, "retrofit", "--model", workspace / "parent", "--shape", "2,2,2", "--out", tmp_path / "rec"
    )
    assert code == 0 and "Saved to" in out and "prelude" in out and not err
    assert "`import recurfit`" in out and "recurfit.model.modeling" not in out  # the package import registers it
    code, out, err = streams(capsys, "inspect", retrofitted)
    assert code == 0 and "prelude" in out and not err


def test_errors_go_to_stderr(tmp_path, capsys):
    code, out, err = streams(capsys, "retrofit", "--model", tmp_path / "missing", "--out", tmp_path / "rec")
    assert code == 2 and not out and err.startswith("error:")


def test_data_prepare_reports_progress_on_stderr_and_the_store_on_stdout(workspace, tmp_path, capsys):
    write_documents(tmp_path / "docs.jsonl", 60)
    argv = ["data", "prepare", "--tokenizer", workspace / "parent", "--source", tmp_path / "docs.jsonl"]
    code, out, err = streams(capsys, *argv, "--seq-len", "16", "--val-fraction", "0.2", "--out", tmp_path / "data")
    assert code == 0 and "training rows" in out and "training rows" not in err
    assert "Expected size" in err and "Expected size" not in out
    argv = ["data", "prepare", "--source", tmp_path / "docs.jsonl", "--seq-len", "16", "--val-fraction", "0.2"]
    code, out, err = streams(capsys, *argv, "--decontaminate", "none", "--out", tmp_path / "d2")
    assert code == 0 and "Tokenising with the tokenizer of" in err and "Tokenising" not in out


def test_train_writes_its_progress_on_stderr_and_its_outcome_on_stdout(workspace, tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run", steps=4, checkpoint={"every": 0})))
    code, out, err = streams(capsys, "train", config, "--dry-run")
    assert code == 0 and "Config" in out and "Memory" in out  # a dry run's plan is its result
    code, out, err = streams(capsys, "train", config, "log.progress=true")
    assert code == 0 and "Trained 4 steps" in out and "Trained 4 steps" not in err
    assert "training:" in err and "training:" not in out and "Validation:" in err and "Config" not in out


def test_eval_loss_writes_its_table_on_stdout(retrofitted, workspace, tmp_path, capsys):
    argv = ["eval", "loss", retrofitted, "--data", workspace / "prose", "--recurrence", "1,2", "--limit", "4"]
    code, out, err = streams(capsys, *argv, "--out", tmp_path / "eval")
    assert code == 0 and "| r=2 |" in out and "Wrote" in out and "| r=2 |" not in err
