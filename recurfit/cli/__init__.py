"""`recurfit …`: the command line. Each subcommand is a thin layer over the Python API.

User errors (bad specs, missing files, offline Hub ids) print one message on stderr and exit with status 2;
set RECURFIT_DEBUG=1 to see the traceback instead. Results go to stdout, progress and statistics to stderr
(common.console and common.status).

Here: main(), the top parser, error reporting and the checks made before the heavy imports. Each command's
options and implementation live in its own module (surgery, data, train, generate, evaluate, external, demo);
what they share is in common.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import RecurfitError
from . import data, demo, evaluate, external, generate, surgery, train
from .common import Parser, console, status
from .external import cmd_lm_eval

__all__ = ["build_parser", "console", "main", "status"]

DESCRIPTION = "Retrofit depth-recurrence into pretrained language models: surgery, training, evaluation, serving."
# In the order `recurfit --help` lists their commands
COMMAND_MODULES = (surgery, data, train, generate, evaluate, external, demo)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(prog="recurfit", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"recurfit {__version__}")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show the libraries' own progress bars and notices (transformers, datasets, lm-eval)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.add_parsers(commands)
    return parser


def _library_output(verbose: bool) -> None:
    """By default recurfit's own progress bars only: no "Loading weights" bar per model, no download or split
    bars, no library notices (warnings and errors still show). --verbose: the libraries' own output too."""
    if not verbose:  # tqdm reads it once, on import: the GGUF conversion's and lm-eval's bars
        os.environ.setdefault("TQDM_DISABLE", "1")
    from transformers.utils import logging as transformers_logging

    if verbose:
        transformers_logging.enable_progress_bar()
        transformers_logging.set_verbosity_info()
        return
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_warning()


def _report_error(error: Exception) -> int:
    from rich.markup import escape

    status.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)  # a message's [x] is text
    return 2


def _check_before_imports(args) -> None:
    """Checks that need neither torch nor transformers: a taken output folder or a missing config fails in a
    fraction of a second, not after the imports (or the work)."""
    from ..demo.settings import DEPTH_TASK_FOLDER
    from ..evaluate.over_training import is_run
    from ..io.files import check_output

    command = getattr(args, "command", None)  # none for `lm-eval`, which parses its own arguments
    continues = command == "eval" and is_run(args.model)  # an evaluation of a run continues in its --out
    if command == "demo" and args.depth_task:  # the act adds OUT/depth-task to a demo's folder, finished or not
        check_output(Path(args.out) / DEPTH_TASK_FOLDER, args.force)
    elif command in ("retrofit", "import-raven", "eval", "demo") and not continues:
        check_output(args.out, args.force)
    if command == "train" and not Path(args.config).is_file():
        raise RecurfitError(f"Config file not found: {args.config}.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["lm-eval"] and not {"-h", "--help"} & set(argv[1:2]):
        args = argparse.Namespace(run=cmd_lm_eval, arguments=argv[1:], verbose=False)  # lm-eval parses its own
    else:
        args, extra = parser.parse_known_args(argv)
        if getattr(args, "command", None) == "train":  # overrides may follow --resume or --force too
            args.overrides += [item for item in extra if "=" in item and not item.startswith("-")]
            extra = [item for item in extra if item not in args.overrides]
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        _check_before_imports(args)
    except RecurfitError as error:
        return _report_error(error)
    _library_output(args.verbose)
    if getattr(args, "state_std", 0) is None:
        from ..model.config import DEFAULT_STATE_INIT_STD

        args.state_std = DEFAULT_STATE_INIT_STD
    try:
        args.run(args)
    except (RecurfitError, ValueError, FileNotFoundError) as error:
        if os.environ.get("RECURFIT_DEBUG"):
            raise
        return _report_error(error)
    except KeyboardInterrupt:
        return 130
    return 0
