"""The rough edges a new user hit: what `train` says when it stops or resumes, what --dry-run checks, errors
that come before the work (and before the heavy imports), and --help lines that give their defaults."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
import time

import pytest
import yaml
from conftest import run_cli
from test_train import tiny_config

from recurfit.train import loop


@pytest.fixture
def config_file(workspace, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(workspace, tmp_path / "run")))
    return path


def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(config_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real_step = loop.Trainer.train_step

    def interrupted_at_step_3(trainer):
        if trainer.counters.step == 2:
            raise KeyboardInterrupt
        return real_step(trainer)

    monkeypatch.setattr(loop.Trainer, "train_step", interrupted_at_step_3)
    code, text = run_cli(capsys, "train", config_file, "checkpoint.every=1")
    assert code == 130
    assert (
        f"Stopped by Ctrl-C at step 2: its last checkpoint is {out / 'checkpoints' / 'step-000002'} (step 2); "
        f"continue with `recurfit train {out / 'config.yaml'} --resume`." in text
    )
    monkeypatch.setattr(loop.Trainer, "train_step", real_step)
    code, text = run_cli(capsys, "train", out / "config.yaml", "--resume")
    assert code == 0 and f"Resuming {out} from step 2 ({out / 'checkpoints' / 'step-000002'})." in text


def test_ctrl_c_before_the_first_checkpoint_says_resume_starts_over(config_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(loop.Trainer, "train_step", lambda trainer: (_ for _ in ()).throw(KeyboardInterrupt))
    code, text = run_cli(capsys, "train", config_file)
    assert code == 130 and "Stopped by Ctrl-C at step 0: it has no checkpoint yet, so --resume starts" in text


def test_resuming_with_other_settings_suggests_the_runs_own_config(config_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert run_cli(capsys, "train", config_file, "steps=4", "checkpoint.every=2", "--out", out)[0] == 0
    (out / "final").rename(tmp_path / "unfinished")  # as if stopped after its last checkpoint
    code, text = run_cli(capsys, "train", config_file, "--resume", "--out", out)  # the recipe: steps=12, not 4
    assert code == 2 and f"`recurfit train {out / 'config.yaml'} --resume`" in text


def test_a_run_that_cannot_start_prints_one_line_and_no_config(config_file, tmp_path, capsys):
    code, text = run_cli(capsys, "train", config_file, f"data.validation=[{tmp_path / 'nowhere'}]")
    assert code == 2 and "not a token store" in text
    assert "Config" not in text and "saved as" not in text and not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.phases.0.sources=[/nowhere/store]", "/nowhere/store"),
        ("data.validation=[/nowhere/val]", "/nowhere/val"),
        ("model.shape=[20,20,20]", "model: "),
    ],
)
def test_dry_run_fails_as_the_run_would(config_file, capsys, override, message):
    code, text = run_cli(capsys, "train", config_file, override, "--dry-run")
    assert code == 2 and message in text and "Config" not in text


# ---------------------------------------------------------------- the command line, before any work


def recurfit_in_fresh_process(*argv) -> str:
    """`python -m recurfit ARGV` in a new interpreter: its output, then its exit status and whether it imported
    torch (from Python's list of imports, PYTHONPROFILEIMPORTTIME)."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run([sys.executable, "-m", "recurfit", *map(str, argv)], capture_output=True, text=True, env=env)
    imports = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")]
    said = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("import time")]
    return " ".join(" ".join(said).split()) + f" status {done.returncode} torch imported {'torch' in imports}"


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


def help_text(capsys, *command) -> str:
    from recurfit.cli import main

    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_lines_give_their_defaults_and_distinct_examples(capsys):
    text = help_text(capsys, "generate")
    assert "0: greedy (default: 0.0)" in text and "greedy (default: off)" in text
    text = help_text(capsys, "retrofit")
    assert "σ of the initial state, 0: zeros (default: 0.00870388, Huginn-0125's)" in text
    assert "prelude, e.g. 0-3" in text and "core, e.g. 10-17" in text and "coda, e.g. 18-21" in text
    for command in ("loss", "tasks"):
        text = help_text(capsys, "eval", command)
        assert (
            "(default: none)" in text
            and "(default: all)" in text
            and "seed of the initial states s_0 (default: 0)" in text
        )


# ---------------------------------------------------------------- data files that cannot be read


def bad_data_files(folder):
    """Files a user might pass by mistake, and the start of the one line each must give."""
    plain = folder / "plain.jsonl.gz"
    plain.write_text('{"text": "not gzipped"}\n')
    latin = folder / "latin.jsonl"
    latin.write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "caf\xe9"}\n')
    cut = folder / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:60])
    damaged = folder / "damaged.parquet"
    damaged.write_bytes(b"PAR1 this is not really parquet")
    return {
        plain: f"{plain}: cannot read it as gzip (Not a gzipped file",
        latin: f"{latin}:3: byte 0xe9 (byte 14 of the line) is not UTF-8; convert the file to UTF-8",
        cut: f"{cut}: cannot read it as gzip (",
        damaged: f"{damaged}: not a readable parquet file (",
    }


def test_unreadable_data_files_are_named_in_one_line(tmp_path):
    from recurfit.data.sources import iter_documents
    from recurfit.errors import RecurfitError

    for path, message in bad_data_files(tmp_path).items():
        with pytest.raises(RecurfitError) as problem:
            list(iter_documents(str(path)))
        assert str(problem.value).startswith(message) and "\n" not in str(problem.value)


def test_data_prepare_names_the_bad_file_and_writes_nothing(workspace, tmp_path, capsys):
    path, message = next(iter(bad_data_files(tmp_path).items()))
    argv = ["data", "prepare", "--tokenizer", workspace / "parent", "--source", path, "--out", tmp_path / "store"]
    code, text = run_cli(capsys, *argv)
    error = text[text.find("error: ") :]  # after what prepare says first (the expected size on disk)
    assert code == 2 and error.startswith(f"error: {message}") and "Traceback" not in text
    assert not (tmp_path / "store").exists()


# ---------------------------------------------------------------- the Hub, offline


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_is_refused_at_once_when_the_hub_is_off_or_unreachable(monkeypatch, offline):
    import socket

    from recurfit.data.sources import iter_documents
    from recurfit.errors import RecurfitError
    from recurfit.io import hub
    from recurfit.model import loading

    for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    hub.hub_unavailable.cache_clear()
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        expected = "HF_HUB_OFFLINE is set"
    else:
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "https://huggingface.co")

        def no_route(address, timeout):
            raise OSError(101, "Network is unreachable")

        monkeypatch.setattr(socket, "create_connection", no_route)
        expected = "the Hub (huggingface.co) cannot be reached (Network is unreachable)"
    started = time.monotonic()
    with pytest.raises(
        RecurfitError, match=re.escape(f"Cannot load 'someone/some-model': it is not a local folder, and {expected}.")
    ):
        loading.load_config("someone/some-model")
    with pytest.raises(RecurfitError, match=re.escape(f"Cannot load the dataset 'someone/some-data': {expected}.")):
        list(iter_documents("hf:someone/some-data"))
    assert time.monotonic() - started < 2
    hub.hub_unavailable.cache_clear()


# ---------------------------------------------------------------- what a saved model says about its parent


def test_a_saved_retrofit_names_no_local_folder_as_its_parent(workspace, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from recurfit import retrofit
    from recurfit.io.assets import EMBEDDED_HUB_ID

    local = AutoModelForCausalLM.from_pretrained(workspace / "parent")
    assert retrofit(local, (2, 2, 2)).config.parent_name_or_path is None
    monkeypatch.setenv("RECURFIT_CACHE", str(tmp_path / "cache"))
    local.save_pretrained(tmp_path / "cache" / "smollm2-135m-instruct")  # where the embedded model is converted
    embedded = AutoModelForCausalLM.from_pretrained(tmp_path / "cache" / "smollm2-135m-instruct")
    model = retrofit(embedded, (2, 2, 2))
    assert model.config.parent_name_or_path == EMBEDDED_HUB_ID
    model.save_pretrained(tmp_path / "saved")
    assert str(tmp_path) not in (tmp_path / "saved" / "config.json").read_text()
    local.config.name_or_path = "someone/some-model"
    assert retrofit(local, (2, 2, 2)).config.parent_name_or_path == "someone/some-model"


def test_the_cpu_recipe_trains_from_its_first_step():
    import torch
    from test_train import REPO

    from recurfit.train import load_config
    from recurfit.train.optim import build_schedulers

    config = load_config(REPO / "recipes" / "smollm2-cpu.yaml")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.optimizer.lr)
    (schedule,) = build_schedulers([optimizer], config.optimizer, config.steps)
    first = schedule.get_last_lr()[0]
    assert first >= 0.1 * config.optimizer.lr > 0
