"""recurfit: retrofit depth-recurrence into pretrained language models.

Importing recurfit registers `RecurrentConfig` / `RecurrentForCausalLM` (model_type "recurfit") with the
transformers Auto classes, so `AutoModelForCausalLM.from_pretrained(dir)` loads a saved recurrent model. The
public names below are imported on first use. The `recurfit` command registers after parsing its arguments, so
that `recurfit --help` answers without importing torch.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

__version__ = "0.1.0"
_EXPORTS = {
    "LayerSelection": "surgery.selection",
    "RecurrentCache": "model.cache",
    "RecurrentConfig": "model.config",
    "RecurrentForCausalLM": "model.modeling",
    "RecurrentModel": "model.modeling",
    "count_parameters": "model.accounting",
    "effective_parameters": "model.accounting",
    "inference_flops_per_token": "model.accounting",
    "retrofit": "surgery.retrofit",
    "sample_depth": "model.sampling",
    "training_flops": "model.accounting",
}
__all__ = [  # noqa: RUF022 (as _EXPORTS lists them)
    "LayerSelection",
    "RecurrentCache",
    "RecurrentConfig",
    "RecurrentForCausalLM",
    "RecurrentModel",
    "count_parameters",
    "effective_parameters",
    "inference_flops_per_token",
    "retrofit",
    "sample_depth",
    "training_flops",
    "register_auto_classes",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recurfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def register_auto_classes() -> None:
    """Make model_type "recurfit" loadable by transformers' Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .model.config import RecurrentConfig
    from .model.modeling import RecurrentForCausalLM, RecurrentModel

    AutoConfig.register(RecurrentConfig.model_type, RecurrentConfig, exist_ok=True)
    AutoModel.register(RecurrentConfig, RecurrentModel, exist_ok=True)
    AutoModelForCausalLM.register(RecurrentConfig, RecurrentForCausalLM, exist_ok=True)


def _started_as_the_command() -> bool:
    """This process is `recurfit …` (the console script or `python -m recurfit`), whose main registers."""
    return Path(sys.argv[0]).name == "recurfit" or list(getattr(sys, "orig_argv", []))[1:3] == ["-m", "recurfit"]


if not _started_as_the_command():
    register_auto_classes()
