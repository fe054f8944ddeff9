"""No recurfit command prompts for or runs a model folder's own code (`auto_map` in its config.json or
tokenizer_config.json): each command is run in a subprocess whose standard input is a terminal that answers "y"
to any question, on a folder whose code writes a marker file when it runs."""

import json
import os
import pty
import subprocess
import sys

import pytest
from conftest import char_tokenizer, tiny_parent, write_documents
from test_raven import write_raven_checkpoint

import recurfit
from recurfit.errors import RecurfitError
from recurfit.model.loading import load_config, load_model, load_tokenizer

PROMPT = "Do you wish to run the custom code"
CODE_MODULE = "raven_code"  # what the auto_map entries name: raven_code.py beside the weights


def write_code(folder, marker) -> None:
    """raven_code.py, which writes `marker` as soon as Python imports it."""
    (folder / f"{CODE_MODULE}.py").write_text(f"from pathlib import Path\n\nPath({str(marker)!r}).write_text('ran')\n")


def add_auto_map(file, entries: dict, **fields) -> None:
    settings = json.loads(file.read_text())
    file.write_text(json.dumps({**settings, **fields, "auto_map": entries}))


def point_at_code(folder, marker, tokenizer_class: str | None = None) -> None:
    """The authors' folders' `auto_map`: config.json's and tokenizer_config.json's classes in the folder's code;
    `tokenizer_class`: one transformers does not have, so the tokenizer cannot be read without the code."""
    write_code(folder, marker)
    classes = {
        name: f"{CODE_MODULE}.Raven{name.removeprefix('Auto')}" for name in ("AutoConfig", "AutoModelForCausalLM")
    }
    add_auto_map(folder / "config.json", classes)
    tokenizer = {"AutoTokenizer": [f"{CODE_MODULE}.RavenTokenizer", f"{CODE_MODULE}.RavenTokenizerFast"]}
    add_auto_map(
        folder / "tokenizer_config.json", tokenizer, **({"tokenizer_class": tokenizer_class} if tokenizer_class else {})
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two raven checkpoints carrying code (a tokenizer transformers reads without it, and one it cannot read),
    a recurfit model whose tokenizer needs its code, and a token store to train and evaluate on."""
    from recurfit.data import prepare

    root = tmp_path_factory.mktemp("remote-code")
    original = recurfit.retrofit(tiny_parent("llama", place=False), shape=(1, 2, 1), adapter_init="random")
    tokenizer = char_tokenizer()
    for name, tokenizer_class in (("raven", None), ("raven-own-tokenizer", "RavenTokenizer")):
        (root / name).mkdir()
        write_raven_checkpoint(original, root / name, "llama", padded_vocab=97)
        tokenizer.save_pretrained(root / name)
        point_at_code(root / name, root / "marker", tokenizer_class)
    original.save_pretrained(root / "recurrent")
    tokenizer.save_pretrained(root / "recurrent")
    write_code(root / "recurrent", root / "marker")
    add_auto_map(
        root / "recurrent" / "tokenizer_config.json",
        {"AutoTokenizer": [f"{CODE_MODULE}.RavenTokenizer", None]},
        tokenizer_class="RavenTokenizer",
    )
    write_documents(root / "docs.jsonl", 60)
    prepare(tokenizer, [str(root / "docs.jsonl")], 16, root / "data", show_progress=False, val_fraction=0.2)
    return root


def run_in_terminal(tmp_path, *argv) -> subprocess.CompletedProcess:
    """`recurfit ARGV…` with a terminal as standard input that has already answered "y" to any question."""
    terminal, device = pty.openpty()
    os.write(terminal, b"y\n" * 8)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),  # where transformers would copy the folder's code to run it
        "RECURFIT_CACHE": str(tmp_path / "cache"),
    }
    try:
        return subprocess.run(
            [sys.executable, "-m", "recurfit", *map(str, argv)],
            stdin=device,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.close(terminal)
        os.close(device)


def error_lines(result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("error:")]


def assert_never_asked(folders, result) -> None:
    output = result.stdout + result.stderr
    ran = (folders / "marker").exists()
    (folders / "marker").unlink(missing_ok=True)  # the next test starts clean
    assert not ran, f"the folder's own code ran: {output}"
    assert PROMPT not in output and "Traceback" not in output, output


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


def test_import_raven_copies_a_tokenizer_that_needs_no_code(folders, tmp_path):
    out = tmp_path / "out"
    result = run_in_terminal(tmp_path, "import-raven", folders / "raven", "--out", out)
    assert_never_asked(folders, result)
    assert result.returncode == 0 and "Tokenizer copied" in result.stdout, result.stdout + result.stderr
    assert "auto_map" not in (out / "tokenizer_config.json").read_text()
    assert load_tokenizer(str(out))("cat").input_ids == char_tokenizer()("cat").input_ids


def test_import_raven_says_so_when_the_tokenizer_needs_its_code(folders, tmp_path):
    out = tmp_path / "out"
    raven = folders / "raven-own-tokenizer"
    result = run_in_terminal(tmp_path, "import-raven", raven, "--out", out)
    assert_never_asked(folders, result)
    assert result.returncode == 0, result.stdout + result.stderr
    said = " ".join(result.stdout.split())
    assert "No tokenizer saved" in said and f"{raven}/tokenizer_config.json" in said and "--tokenizer" in said, said
    assert (out / "config.json").is_file() and not (out / "tokenizer_config.json").exists()
    # what it suggests works: a tokenizer from a folder that has one readable without code
    result = run_in_terminal(tmp_path, "import-raven", raven, "--tokenizer", folders / "raven", "--out", out, "--force")
    assert_never_asked(folders, result)
    assert result.returncode == 0 and "Tokenizer copied" in result.stdout, result.stdout + result.stderr
    assert (out / "tokenizer_config.json").is_file()


def test_import_raven_with_a_tokenizer_that_needs_code_writes_nothing(folders, tmp_path):
    out = tmp_path / "out"
    result = run_in_terminal(
        tmp_path, "import-raven", folders / "raven", "--tokenizer", folders / "raven-own-tokenizer", "--out", out
    )
    assert_never_asked(folders, result)
    assert result.returncode == 2 and len(error_lines(result)) == 1, result.stdout + result.stderr
    assert not out.exists()


def test_the_loaders_refuse_in_one_line_without_asking(folders, monkeypatch):
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "n")
    for load, folder, named in (
        (load_config, "raven", "config.json"),
        (load_model, "raven", "config.json"),
        (load_tokenizer, "raven-own-tokenizer", "tokenizer_config.json"),
        (load_tokenizer, "recurrent", "tokenizer_config.json"),
    ):
        with pytest.raises(RecurfitError, match=f"/{named} ") as refused:
            load(str(folders / folder))
        assert "\n" not in str(refused.value)
    assert load_tokenizer(str(folders / "raven"))("cat").input_ids == char_tokenizer()("cat").input_ids
    assert not asked and not (folders / "marker").exists()


def test_lm_eval_model_type_refuses_to_run_a_folders_code(folders):
    from recurfit.evaluate.lm import RecurfitLM

    with pytest.raises(ValueError, match="own code"):
        RecurfitLM(pretrained=str(folders / "raven"), trust_remote_code=True)
    assert not (folders / "marker").exists()
