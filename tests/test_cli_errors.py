"""Tests of cli_errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import (
    assert_never_asked,
    error_lines,
    run_in_terminal,
)
from conftest import run_cli as run
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from recurfit.cli import main


def refusal_commands(folders, out):
    raven = folders / "raven"
    train_config = out.parent / "run.yaml"
    train_config.write_text(
        f"out: {out}\nmodel: {{path: {raven}, shape: [1, 1, 1]}}\n"
        f"data: {{phases: [{{sources: [{folders / 'data'}]}}]}}\n"
        "depth: {mean_recurrence: 2, backprop_depth: 1}\nbatch: {micro: 2, global: 2}\nsteps: 1\n"
        "log: {progress: false}\n"
    )
    return {
        "retrofit": ["retrofit", "--model", raven, "--shape", "1,1,1", "--out", out],
        "inspect": ["inspect", raven],
        "generate": ["generate", raven, "--prompt", "hi", "--max-new-tokens", "2"],
        "generate-own-tokenizer": ["generate", folders / "recurrent", "--prompt", "hi", "--max-new-tokens", "2"],
        "eval": ["eval", "loss", raven, "--data", folders / "data", "--limit", "2", "--out", out],
        "train": ["train", train_config],
    }


def recurfit_in_fresh_process(*argv) -> str:
    """`python -m recurfit ARGV` in a new interpreter: its output, then its exit status and whether it imported
    torch (from Python's list of imports, PYTHONPROFILEIMPORTTIME)."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run([sys.executable, "-m", "recurfit", *map(str, argv)], capture_output=True, text=True, env=env)
    imports = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")]
    said = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("import time")]
    return " ".join(" ".join(said).split()) + f" status {done.returncode} torch imported {'torch' in imports}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "5,5,5"], "needs 15 layers but the parent has only 6"),
        (["--prelude", "0,1", "--core", "1,2", "--coda", "5"], "Layer 1 is in both prelude and core"),
        (["--shape", "1,2,1", "--core", "2,3"], "not both"),
        (["--prelude", "3", "--core", "1,2", "--coda", "5"], "must run in parent order"),
        (["--shape", "1,2,1", "--mean-recurrence", "0"], "mean_recurrence and backprop_depth must be >= 1"),
        (["--shape", "1,2,1", "--select", "shortgpt"], "--calibration FILE"),
    ],
)
def test_bad_specs_exit_2_and_write_nothing(parent_dir, tmp_path, capsys, argv, message):
    out = tmp_path / "rec"
    code, text = run(capsys, "retrofit", "--model", parent_dir, *argv, "--out", out)
    assert code == 2 and message in text and "Traceback" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parent"]  # no output, no leftover staging folder


def test_missing_folder_and_unknown_family_are_clear_errors(tmp_path, capsys):
    code, text = run(capsys, "retrofit", "--model", tmp_path / "nope", "--out", tmp_path / "o")
    assert code == 2 and "No such model folder" in text
    gpt2 = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(
        CONFIG_MAPPING["gpt2"](n_layer=2, n_embd=32, n_head=2, vocab_size=50)
    ).save_pretrained(gpt2)
    code, text = run(capsys, "retrofit", "--model", gpt2, "--shape", "0,1,1", "--out", tmp_path / "o")
    assert code == 2 and "supported families are llama" in text
    assert not (tmp_path / "o").exists()


def test_bad_steps_are_rejected_by_the_parser(parent_dir):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(parent_dir), "--recurrence", "0,4"])
    assert exit_info.value.code == 2


def test_console_script_reports_an_unreachable_hub_id_without_a_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RECURFIT_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "recurfit", "inspect", "someone/not-a-local-model"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        "Cannot load 'someone/not-a-local-model'" in result.stderr and "Traceback" not in result.stdout + result.stderr
    )


def test_data_and_train_errors_exit_2_and_write_nothing(workspace, tmp_path, capsys):
    code, text = run(
        capsys,
        "data",
        "prepare",
        "--tokenizer",
        workspace / "parent",
        "--source",
        tmp_path / "nope.jsonl",
        "--out",
        tmp_path / "d",
    )
    assert code == 2 and "is not a file, a folder" in text and not (tmp_path / "d").exists()
    assert list(tmp_path.iterdir()) == []  # not even a staging folder
    code, text = run(capsys, "train", tmp_path / "missing.yaml")
    assert code == 2 and "Config file not found" in text
    (tmp_path / "c.yaml").write_text("out: x\nsteps: 3\nbatchh: {micro: 1}\n")
    code, text = run(capsys, "train", tmp_path / "c.yaml")
    assert code == 2 and "did you mean 'batch'" in text


@pytest.mark.parametrize("command", ["retrofit", "inspect", "generate", "generate-own-tokenizer", "eval", "train"])
def test_commands_refuse_a_folder_that_needs_its_own_code_in_one_line(folders, tmp_path, command):
    out = tmp_path / "out"
    argv = refusal_commands(folders, out)[command]
    result = run_in_terminal(tmp_path, *argv)
    assert_never_asked(folders, result)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = error_lines(result)
    named = "tokenizer_config.json" if command == "generate-own-tokenizer" else "config.json"
    assert f"/{named} " in line and "own code" in line and "auto_map" in line, line
    assert not out.exists(), "a refused command left its output behind"


@pytest.mark.parametrize(
    "command",
    [
        ["retrofit", "--shape", "1,2,1", "--out", "{out}"],
        ["import-raven", "somewhere", "--out", "{out}"],
        ["eval", "loss", "--data", "nowhere", "--out", "{out}"],
        ["demo", "--out", "{out}"],
    ],
)
def test_a_taken_out_is_refused_before_any_work_or_heavy_import(tmp_path, command):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    text = recurfit_in_fresh_process(*(part.format(out=out) for part in command))
    assert f"error: {out} already exists; pass --force" in text
    assert text.endswith("status 2 torch imported False")


def test_a_missing_config_is_refused_before_heavy_imports(tmp_path):
    text = recurfit_in_fresh_process("train", tmp_path / "nowhere.yaml")
    assert f"error: Config file not found: {tmp_path / 'nowhere.yaml'}." in text and text.endswith("False")


def test_usage_errors_are_one_line_with_the_same_prefix(capsys):
    from recurfit.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["retrofit", "--shape", "1,2", "--out", "x"])
    assert stop.value.code == 2
    said = capsys.readouterr()
    assert said.err.splitlines() == [
        "error: argument --shape: expected three integers P,R,C such as 4,8,4, got '1,2' "
        "(see `recurfit retrofit --help`)"
    ]
