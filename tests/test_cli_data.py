"""Tests of `recurfit/cli/data.py`."""

from __future__ import annotations

import json

import pytest
from conftest import (
    ROWS,
    bad_data_files,
    conversations,
    run_cli,
    write_conversations,
    write_documents,
    write_jsonl,
)
from conftest import run_cli as run


def test_data_prepare_with_the_filter_from_the_command_line(workspace, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "general.jsonl")
    pq.write_table(
        pa.table({"text": [t for _, t, _ in ROWS], "metadata": [{"models_used": g} for g, _, _ in ROWS]}),
        tmp_path / "math.parquet",
    )
    args = [
        "data",
        "prepare",
        "--tokenizer",
        workspace / "parent",
        "--source",
        tmp_path / "general.jsonl",
        "--source",
        tmp_path / "math.parquet",
        "--seq-len",
        "8",
        "--filter",
        "nemotron-sft",
        "--val-fraction",
        "0",
    ]
    code, text = run(capsys, *args, "--out", tmp_path / "data")
    assert code == 0, text
    assert "nemotron-sft filter: 22 rows read, 12 dropped as written by reasoning models (DeepSeek-R1: 2," in text
    assert "10 kept, role tags removed from 4, 2 with no generator (kept). Generators seen: DeepSeek-R1," in text
    assert "10 documents" in text
    assert json.loads((tmp_path / "data" / "meta.json").read_text())["filter"]["dropped"] == 12
    code, text = run(capsys, *args, "--out", tmp_path / "data")
    assert code == 0 and "nothing to do" in text and "12 dropped" in text

    (tmp_path / "plain.jsonl").write_text('{"text": "no generator here"}\n')
    code, text = run(
        capsys,
        "data",
        "prepare",
        "--tokenizer",
        workspace / "parent",
        "--source",
        tmp_path / "plain.jsonl",
        "--filter",
        "nemotron-sft",
        "--out",
        tmp_path / "bad",
    )
    assert code == 2 and "plain.jsonl:1 has none of the fields 'generator'" in text and "--generator-field" in text
    assert "Traceback" not in text and not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bad")]
    code, text = run(
        capsys,
        "data",
        "prepare",
        "--source",
        tmp_path / "plain.jsonl",
        "--exclude-generator",
        "x",
        "--out",
        tmp_path / "bad",
    )
    assert code == 2 and "only apply with --filter" in text


def test_command_line_budget_workers_and_tasks(tmp_path, documents, workspace, capsys):
    args = ["data", "prepare", "--tokenizer", workspace / "parent", "--source", documents[0], "--seq-len", "16"]
    args += ["--val-fraction", "0.1"]
    code, said = run_cli(
        capsys, *args, "--max-tokens", "2k", "--workers", "2", "--shard-documents", "64", "--out", tmp_path / "cli"
    )
    assert code == 0, said
    meta = json.loads((tmp_path / "cli" / "meta.json").read_text())
    assert meta["max_tokens"] == 2000 and meta["shard_documents"] == 64 and meta["packing"] == "bos-eos"
    assert "Expected size on disk: 4.4 kB" in said and "The tokenizer adds no BOS token" in said
    for bad, message in (
        (["--workers", "0"], "--workers must be at least 1"),
        (["--shard-documents", "2000"], "must be a multiple of 1024"),
    ):
        code, said = run_cli(capsys, *args, *bad, "--out", tmp_path / "bad")
        assert code == 2 and message in said, said
    for bad, message in (
        (["--task", "2/2"], "expected I/N with 0 <= I < N"),
        (["--max-tokens", "lots"], "expected a token count such as 26.2B"),
    ):
        with pytest.raises(SystemExit) as stopped:
            run_cli(capsys, *args, *bad, "--out", tmp_path / "bad")
        assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_data_prepare_names_the_bad_file_and_writes_nothing(workspace, tmp_path, capsys):
    path, message = next(iter(bad_data_files(tmp_path).items()))
    argv = ["data", "prepare", "--tokenizer", workspace / "parent", "--source", path, "--out", tmp_path / "store"]
    code, text = run_cli(capsys, *argv)
    error = text[text.find("error: ") :]  # after what prepare says first (the expected size on disk)
    assert code == 2 and error.startswith(f"error: {message}") and "Traceback" not in text
    assert not (tmp_path / "store").exists()


def test_data_prepare_without_tokenizer_says_which_it_used(tmp_path, capsys):
    write_documents(tmp_path / "docs.jsonl", 200)
    code, text = run(capsys, "data", "prepare", "--source", tmp_path / "docs.jsonl", "--seq-len", "32",
                     "--val-fraction", "0.1", "--decontaminate", "none", "--out", tmp_path / "data")  # fmt: skip
    assert code == 0, text
    assert "Tokenising with the tokenizer of the embedded SmolLM2-135M-Instruct (no --tokenizer)" in text
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "embedded SmolLM2-135M-Instruct" and len(meta["tokenizer_vocabulary"]) == 16


def test_data_prepare_of_conversations_with_the_embedded_tokenizer_keeps_the_assistants_tokens(tmp_path, capsys):
    """The embedded SmolLM2-135M-Instruct's chat template renders a `messages` source, and the command says how to
    train on the assistant's tokens; its masks mark tokens of the replies only (the rest: test_data_chat.py)."""
    from recurfit.data import TokenStore
    from recurfit.model.loading import load_tokenizer

    write_conversations(tmp_path / "chat.jsonl", conversations(100))
    code, text = run(capsys, "data", "prepare", "--source", tmp_path / "chat.jsonl", "--seq-len", "64",
                     "--val-fraction", "0", "--decontaminate", "none", "--out", tmp_path / "chat")  # fmt: skip
    assert code == 0, text
    assert "found by prefixes): train on them alone with data.assistant_only_loss=true" in text
    tokens, masks = TokenStore(tmp_path / "chat")[:].reshape(-1), TokenStore(tmp_path / "chat", masks=True)[:]
    marked = load_tokenizer(None).decode(tokens[masks.reshape(-1).astype(bool)])
    assert " plus " in marked and "what is" not in marked and "assistant" not in marked and "system" not in marked
