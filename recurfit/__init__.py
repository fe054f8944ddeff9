"""recurfit: retrofit depth-recurrence into pretrained language models.

The public names below are imported on first use, so `import recurfit` (and `recurfit --help`) stays torch-free.
`import recurfit` registers `RecurrentConfig` / `RecurrentForCausalLM` (model_type "recurfit") with the
transformers Auto classes as soon as transformers loads its Auto classes (at once if it already has), so
`import recurfit` then `AutoModelForCausalLM.from_pretrained(dir)` loads a saved recurrent model.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

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


# The transformers modules whose import means the user is about to load through the Auto classes, and the
# recurfit module whose import registers recurfit's classes with them.
_AUTO_REGISTRATION = {
    "transformers.models.auto.configuration_auto": "recurfit.model.config",
    "transformers.models.auto.modeling_auto": "recurfit.model.modeling",
}


class _RegisterWithAutoClasses(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs after transformers imports one of its Auto modules, then imports the recurfit module that registers
    with it. A post-import hook, so that `import recurfit` itself imports neither torch nor transformers."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _AUTO_REGISTRATION:
            return None
        sys.meta_path.remove(self)  # the real spec, found by the other finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._loaders = {**getattr(self, "_loaders", {}), fullname: spec.loader}
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module):
        self._loaders[module.__name__].exec_module(module)
        importlib.import_module(_AUTO_REGISTRATION[module.__name__])


def _register_with_auto_classes() -> None:
    if any(isinstance(finder, _RegisterWithAutoClasses) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _RegisterWithAutoClasses())
    for transformers_module, recurfit_module in _AUTO_REGISTRATION.items():
        if transformers_module in sys.modules:  # transformers came first
            importlib.import_module(recurfit_module)


_register_with_auto_classes()
