"""recurfit: retrofit depth-recurrence into pretrained language models.

The public names below are imported on first use, so `import recurfit` (and `recurfit --help`) stays torch-free.
Importing the model (`recurfit.RecurrentForCausalLM`, `recurfit.retrofit`, or `recurfit.model.modeling` itself)
registers `RecurrentConfig` / `RecurrentForCausalLM` (model_type "recurfit") with the transformers Auto classes,
so `AutoModelForCausalLM.from_pretrained(dir)` then loads a saved recurrent model.
"""

from __future__ import annotations

import importlib

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
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recurfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
