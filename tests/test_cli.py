"""The command line on tiny parents saved to disk: outputs, refusals, and errors that write nothing."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import run_cli as run
from conftest import tiny_parent, token_batch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import recurfit
from recurfit.cli import main


@pytest.fixture
def parent_dir(tmp_path):
    folder = tmp_path / "parent"
    tiny_parent("llama", num_layers=6).save_pretrained(folder)
    return folder


def test_retrofit_writes_a_loadable_model_equal_to_the_python_api(parent_dir, tmp_path, capsys):
    out = tmp_path / "rec"
    code, text = run(capsys, "retrofit", "--model", parent_dir, "--shape", "2,2,1", "--out", out)
    assert code == 0 and "✓ equal" in text and "3–4" in text  # core = parent layers 3-4
    loaded = AutoModelForCausalLM.from_pretrained(out)
    expected = recurfit.retrofit(AutoModelForCausalLM.from_pretrained(parent_dir), shape=(2, 2, 1))
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(loaded(ids, num_steps=3).logits, expected(ids, num_steps=3).logits)


def test_explicit_indices_and_ranges(parent_dir, tmp_path, capsys):
    out = tmp_path / "rec"
    code, _ = run(
        capsys, "retrofit", "--model", parent_dir, "--prelude", "0", "--core", "2-4", "--coda", "5", "--out", out
    )
    assert code == 0
    assert AutoModelForCausalLM.from_pretrained(out).config.source_layers == {
        "prelude": [0],
        "core": [2, 3, 4],
        "coda": [5],
    }


def test_existing_output_is_never_overwritten_without_force(parent_dir, tmp_path, capsys):
    out = tmp_path / "rec"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, text = run(capsys, "retrofit", "--model", parent_dir, "--shape", "1,2,1", "--out", out)
    assert code == 2 and "already exists" in text
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    code, _ = run(capsys, "retrofit", "--model", parent_dir, "--shape", "1,2,1", "--out", out, "--force")
    assert code == 0 and (out / "model.safetensors").exists() and not (out / "keep.txt").exists()


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


def test_inspect_plans_a_shape_from_the_config_alone(parent_dir, capsys):
    (parent_dir / "model.safetensors").unlink()  # no weights needed
    code, text = run(capsys, "inspect", parent_dir, "--shape", "2,2,1", "--recurrence", "1,4")
    assert code == 0 and "core (2 layers) ×r" in text and "3–4" in text
    counts = recurfit.count_parameters(recurfit.retrofit(tiny_parent("llama", num_layers=6), shape=(2, 2, 1)))
    assert f"{counts['body']:,}" in text


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
        "Cannot load 'someone/not-a-local-model'" in result.stdout and "Traceback" not in result.stdout + result.stderr
    )


def test_data_prepare_and_train_from_the_command_line(workspace, tmp_path, capsys):
    from conftest import write_documents

    write_documents(tmp_path / "docs.jsonl", 60)
    args = [
        "data",
        "prepare",
        "--tokenizer",
        workspace / "parent",
        "--source",
        tmp_path / "docs.jsonl",
        "--seq-len",
        "16",
        "--val-fraction",
        "0.2",
    ]
    code, text = run(capsys, *args, "--out", tmp_path / "data")
    assert code == 0 and "training rows" in text
    code, text = run(capsys, *args, "--out", tmp_path / "data")
    assert code == 0 and "nothing to do" in text

    config = tmp_path / "run.yaml"
    config.write_text(
        f"out: {tmp_path / 'run'}\nmodel: {{path: {workspace / 'parent'}, shape: [2, 2, 2]}}\n"
        f"data: {{phases: [{{sources: [{tmp_path / 'data'}]}}]}}\n"
        "depth: {mean_recurrence: 2, backprop_depth: 1}\nbatch: {micro: 2, global: 4}\nsteps: 3\n"
        "log: {progress: false}\n"
    )
    code, text = run(capsys, "train", config, "optimizer.name=adamw")
    assert code == 0 and "Trained 3 steps" in text and (tmp_path / "run" / "final" / "config.json").is_file()


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


def test_generate_streams_and_reports_depth(workspace, tmp_path, capsys):
    code, _ = run(capsys, "retrofit", "--model", workspace / "parent", "--shape", "2,2,2", "--out", tmp_path / "rec")
    assert code == 0
    code, text = run(
        capsys, "generate", tmp_path / "rec", "--prompt", "the cat", "-r", "3", "--max-new-tokens", "5", "--stream"
    )
    assert code == 0 and "5 tokens in" in text and "mean 3.0 (min 3, max 3)" in text
    with pytest.raises(SystemExit) as refused:  # the old name of --recurrence is gone (a usage error)
        main(["generate", str(tmp_path / "rec"), "--prompt", "the cat", "--steps", "3"])
    assert refused.value.code == 2 and "unrecognized arguments: --steps" in capsys.readouterr().err
    code, text = run(
        capsys,
        "generate",
        tmp_path / "rec",
        "--prompt",
        "the cat",
        "-r",
        "6",
        "--exit",
        "state:1e9",
        "--max-new-tokens",
        "4",
    )
    assert code == 0 and "(min 2, max 6)" in text  # the prompt runs 6 steps, each new token exits at min-steps 2
    code, text = run(capsys, "generate", tmp_path / "rec", "--prompt", "x", "--exit", "entropy:1")
    assert code == 2 and "--exit takes CRITERION" in text
