"""What every command module uses: the two consoles (results on stdout, progress on stderr), argument types,
shared options (recurrences, calibration text, placement), the model a command runs when --model is a saved one or
left out, the help formatter and the parser class."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from .. import defaults

# Every command writes its results on stdout (`console`: generated text, tables, what it wrote) and its progress,
# statistics, notices, warnings and errors on stderr (`status`), so that `recurfit generate … > out.txt` holds the
# text alone. Piped or redirected output is not wrapped at all (a terminal's width is unknown there, and a wrap at
# 80 columns splits paths and numbers); in a terminal, rich wraps at word boundaries.
console = Console(soft_wrap=not sys.stdout.isatty())
status = Console(stderr=True, soft_wrap=not sys.stderr.isatty())


# ---------------------------------------------------------------- argument types


def int_list(text: str) -> list[int]:
    """ "0,1,2" or "0-3,10-17" → [0, 1, 2, ...]."""
    values: list[int] = []
    try:
        for item in filter(None, (part.strip() for part in text.split(","))):
            first, _, last = item.partition("-")
            values.extend(range(int(first), int(last) + 1) if last else [int(first)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 0,1,2 or 10-17, got {text!r}") from None
    return values


def shape_arg(text: str) -> tuple[int, int, int]:
    values = int_list(text)
    if len(values) != 3 or "-" in text:
        raise argparse.ArgumentTypeError(f"expected three integers P,R,C such as 4,8,4, got {text!r}")
    return tuple(values)


def positive_ints(text: str) -> list[int]:
    values = int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected recurrences >= 1 such as 1,4,32, got {text!r}")
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0 such as 5e-3, got {text!r}")
    return value


def add_recurrences(parser: argparse.ArgumentParser, default: tuple[int, ...]) -> None:
    """-r/--recurrence: the test-time recurrences r to run (the paper's r)."""
    parser.add_argument(
        "-r",
        "--recurrence",
        dest="recurrence",
        type=positive_ints,
        default=list(default),
        metavar="R,R,…",
        help="test-time recurrences, e.g. 1,4,32",
    )


def add_calibration_arguments(parser: argparse.ArgumentParser, help: str) -> None:
    """--calibration and --calibration-tokens: the text layer scores are computed on."""
    parser.add_argument("--calibration", metavar="FILE", help=help)
    parser.add_argument(
        "--calibration-tokens", type=int, default=2048, help="tokens of --calibration to score layers on"
    )


DTYPE_HELP = "weights' precision; auto: bfloat16 on a GPU, float32 on a CPU"
MODEL_HELP = "parent model folder or Hub id (default: the embedded SmolLM2-135M-Instruct)"


def add_placement_arguments(p, dtype_help: str = DTYPE_HELP) -> None:
    """--device, --dtype and --threads, the same for every command that runs a model."""
    p.add_argument("--device", help="cpu, cuda, cuda:N or mps (default: cuda if a GPU is visible, else cpu)")
    p.add_argument("--dtype", choices=defaults.DTYPES, default="auto", help=f"{dtype_help} (default: auto)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's own choice)")


def _placement(args, dtype=None):
    """The device and precision the arguments ask for (`dtype` overrides --dtype, e.g. a resolved `auto`)."""
    from ..model.loading import resolve_placement

    return resolve_placement(args.device, dtype or args.dtype, args.threads)


def load_recurrent_model(name_or_path: str | None, dtype="float32", device=None):
    """A model to generate with or evaluate: a folder or Hub id (`--model`), or without one the embedded
    SmolLM2-135M retrofitted to `DEFAULT_SHAPE` on the spot (untrained: it shows the mechanics, not the quality).
    Surgery is imported only for that default."""
    from ..model.loading import load_model

    if name_or_path is not None:
        return load_model(name_or_path, dtype, device)
    from ..surgery.retrofit import retrofit

    model = retrofit(load_model(None, dtype), defaults.DEFAULT_SHAPE).eval()  # surgery on the CPU, then moved whole
    return model if device is None else model.to(device)


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (lists as typed: 1,4,32), unless it says it already."""

    def _get_help_string(self, action) -> str:
        text, default = action.help or "", action.default
        shown_already = "default" in text or default is argparse.SUPPRESS  # --help, --version
        if not action.option_strings or default is None or default is False or shown_already:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class Subcommands(argparse._SubParsersAction):
    """Subcommands whose own --help opens with the line the parent's --help lists them with."""

    def add_parser(self, name, **kwargs):
        if kwargs.get("help") and "description" not in kwargs:
            kwargs["description"] = kwargs["help"][0].upper() + kwargs["help"][1:] + "."
        return super().add_parser(name, **kwargs)


class Parser(argparse.ArgumentParser):
    """argparse with HelpFormatter; subcommands inherit it. A usage error is one line, like every other error."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", Subcommands)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")
