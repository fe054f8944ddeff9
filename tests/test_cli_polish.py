"""Command-line polish: --version, a help line with its default for every option, a fast --help (no torch
import), quiet by default, piped output not wrapped, and Ctrl-C in chat stopping the answer only."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from conftest import run_cli

import recurfit
import recurfit.generation
from recurfit.cli import build_parser, console

REPO = Path(__file__).resolve().parents[1]


def recurfit_command(*args, **kwargs) -> subprocess.CompletedProcess:
    """`python -m recurfit ARGS` as a user runs it, with stdout piped."""
    return subprocess.run(
        [sys.executable, "-m", "recurfit", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        **kwargs,
    )


def subparsers(parser, name="recurfit"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child, subparser in action.choices.items():
                yield from subparsers(subparser, f"{name} {child}")


def test_version_and_help_answer_without_importing_torch():
    done = recurfit_command("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"recurfit {recurfit.__version__}"
    code = "\n".join(
        [
            "import sys",
            "sys.argv = ['recurfit', 'eval', 'tasks', '--help']",
            "from recurfit.cli import main",
            "try:",
            "    main()",
            "except SystemExit:",
            "    pass",
            "print('torch loaded:', 'torch' in sys.modules)",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert "--tasks" in done.stdout and "torch loaded: False" in done.stdout, done.stderr
    start = time.perf_counter()
    assert recurfit_command("--help").returncode == 0
    print(f"recurfit --help: {time.perf_counter() - start:.2f} s")


def test_every_option_has_a_help_line_with_its_default():
    for name, parser in subparsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            text = formatter._get_help_string(action)
            assert text, f"{name} {action.option_strings or action.dest} has no help"
            if action.option_strings and action.default is not None and action.default is not False:  # 0 too
                assert "default" in text, f"{name} {action.option_strings}: {text!r}"
    inspect = dict(subparsers(build_parser()))["recurfit inspect"]
    assert "(default: 1,4,32)" in " ".join(inspect.format_help().split())


def test_commands_are_quiet_unless_verbose(workspace, capsys):
    code, text = run_cli(capsys, "inspect", workspace / "parent", "--load")
    assert code == 0 and "Loading weights" not in text
    code, text = run_cli(capsys, "--verbose", "inspect", workspace / "parent", "--load")
    assert code == 0 and "Loading weights" in text
    run_cli(capsys, "inspect", workspace / "parent")  # back to quiet for the tests after this one


def test_lm_eval_records_the_git_commit_without_printing_git_errors(tmp_path, monkeypatch, capfd):
    from lm_eval import evaluator

    from recurfit.evaluate.suite import quiet_git_hash

    monkeypatch.chdir(tmp_path)  # not a git repository
    evaluator.get_git_commit_hash()
    assert "not a git repository" in capfd.readouterr().err  # lm-eval's own call is noisy here
    with quiet_git_hash():
        assert evaluator.get_git_commit_hash() is None
    assert "fatal" not in capfd.readouterr().err


def test_piped_output_is_not_wrapped(tmp_path):
    missing = tmp_path / ("a-long-folder-name-" * 5) / "model"
    done = recurfit_command("inspect", missing)
    assert done.returncode == 2
    assert done.stdout.strip() == f"error: No such model folder: {missing}.", done.stdout


def test_ctrl_c_in_chat_stops_the_answer_and_the_chat_goes_on(workspace, capsys, monkeypatch):
    lines = iter(["first question", "second question", ""])
    monkeypatch.setattr(console, "input", lambda prompt="": next(lines))
    asked = []

    def generate_text(model, tokenizer, ids, settings, stream=False):
        asked.append(tokenizer.decode(ids[0]).replace(" ", ""))  # a character tokenizer: "s e c o n d"
        if len(asked) == 1:
            raise KeyboardInterrupt
        return SimpleNamespace(text="an answer", tokens=2, seconds=1.0, steps_per_token=[], acceptance_rate=None)

    monkeypatch.setattr(recurfit.generation, "generate_text", generate_text)
    code, text = run_cli(capsys, "chat", workspace / "parent")
    assert code == 0 and "stopped" in text and "2 tokens in 1.0 s" in text
    assert "secondquestion" in asked[1] and "firstquestion" not in asked[1]
