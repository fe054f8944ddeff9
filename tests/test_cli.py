"""The command line on tiny parents saved to disk: outputs, refusals, and errors that write nothing."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

import recurfit
from recurfit.cli import build_parser

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


def help_text(capsys, *command) -> str:
    from recurfit.cli import main

    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())


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


def test_piped_output_is_not_wrapped(tmp_path):
    missing = tmp_path / ("a-long-folder-name-" * 5) / "model"
    done = recurfit_command("inspect", missing)
    assert done.returncode == 2 and done.stdout == ""  # an error goes to stderr
    assert done.stderr.strip() == f"error: No such model folder: {missing}.", done.stderr


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


def test_every_help_reads_as_a_users_with_a_one_line_description():
    for name, parser in subparsers(build_parser()):
        text = parser.format_help()
        assert "SUPPRESS" not in text, f"{name} --help: {text}"
        description = parser.description or ""
        assert description and "\n" not in description and "`" not in description, f"{name}: {description!r}"
        assert description[0].isupper() and description.endswith("."), f"{name}: {description!r}"
