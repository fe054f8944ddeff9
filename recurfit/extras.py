"""The optional parts of recurfit and the pip extra that installs each.

`pip install recurfit` (the core) retrofits, inspects, trains on token stores, generates, chats and serves.
Evaluation, data read through `datasets` or pyarrow, figures and LoRA import libraries the core leaves out; every
use of one first calls `require`, which turns a missing library into one line naming the `pip install` that adds
it (a RecurfitError: the CLI prints it and exits with status 2).
"""

from __future__ import annotations

import importlib.util

from .errors import RecurfitError

# pyproject.toml's [project.optional-dependencies] (tests/test_extras.py holds the two equal): each extra and the
# packages it adds. `all` is every one of them; `dev` (the test tools) is not a part of recurfit.
EXTRAS: dict[str, tuple[str, ...]] = {
    "eval": ("lm-eval", "math-verify", "matplotlib"),  # lm-eval's tasks, MATH's scoring, the results' figures
    "data": ("datasets",),  # Hub datasets, parquet files (pyarrow), the bundled prose and evaluation sets
    "plots": ("matplotlib",),  # `recurfit plot`, `inspect --layers`, the figures of the Python API
    "peft": ("peft",),  # `lora:` in a training config
}
# The packages above whose module is named otherwise (pip's name: `import lm_eval` is lm-eval).
_PACKAGES = {package.replace("-", "_"): package for packages in EXTRAS.values() for package in packages}


def install_command(*extras: str) -> str:
    return f"pip install 'recurfit[{','.join(extras)}]'"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a finder that hides the module by raising (the GPU check's CPU smoke does)
        return False


def missing(*modules: str) -> list[str]:
    """Those top-level `modules` that cannot be imported here, by their pip names."""
    return list(dict.fromkeys(_PACKAGES.get(module, module) for module in modules if not _importable(module)))


def require(needed_for: str, *extras: str, modules: tuple[str, ...] = ()) -> None:
    """Raise a RecurfitError naming the `pip install` of `extras` if a module they add is missing: `modules`, or
    by default every package of those extras. `needed_for` starts the message: what the user asked for."""
    wanted = modules or tuple(dict.fromkeys(package.replace("-", "_") for e in extras for package in EXTRAS[e]))
    absent = missing(*wanted)
    if absent:
        raise RecurfitError(
            f"{needed_for} needs {', '.join(absent)}, which this install of recurfit leaves out: "
            f"{install_command(*extras)}."
        )
