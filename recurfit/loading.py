"""Loading models and tokenizers by path or Hub id, with errors that say what to do offline."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedModel

from .assets import embedded_model_dir
from .errors import RecurfitError


def resolve(name_or_path: str | None) -> str:
    """A local folder or Hub id; None means the embedded SmolLM2-135M."""
    if name_or_path is None:
        return str(embedded_model_dir())
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise RecurfitError(f"{path} is not a model folder: it has no config.json.")
        return str(path)
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise RecurfitError(f"No such model folder: {path}.")
    return name_or_path


def _from_hub(loader, name: str, **kwargs):
    try:
        return loader(name, **kwargs)
    except OSError as problem:
        raise RecurfitError(
            f"Cannot load {name!r}: it is not a local folder, and the Hugging Face Hub could not provide it "
            f"({str(problem).splitlines()[0]}). Offline, download it elsewhere and pass its folder, or leave "
            f"--model out to use the embedded SmolLM2-135M."
        ) from None


def load_config(name_or_path: str | None) -> PreTrainedConfig:
    return _from_hub(AutoConfig.from_pretrained, resolve(name_or_path))


def load_model(name_or_path: str | None, dtype: torch.dtype | str = "auto") -> PreTrainedModel:
    """A causal LM (a parent, or a saved recurfit model: `import recurfit` registered the class)."""
    return _from_hub(AutoModelForCausalLM.from_pretrained, resolve(name_or_path), dtype=dtype).eval()


def load_tokenizer(name_or_path: str | None):
    return _from_hub(AutoTokenizer.from_pretrained, resolve(name_or_path))


def optional_tokenizer(name_or_path: str | None):
    """The tokenizer saved with a model, or None for a folder that has none (a bare checkpoint)."""
    try:
        return load_tokenizer(name_or_path)
    except (RecurfitError, OSError, ValueError):
        return None


def load_recurrent_model(name_or_path: str | None, dtype: torch.dtype | str = torch.float32) -> PreTrainedModel:
    """A model to generate with or evaluate: a folder or Hub id, or by default the embedded SmolLM2-135M
    retrofitted to `DEFAULT_SHAPE` on the spot (untrained: it shows the mechanics, not the quality)."""
    from .surgery import DEFAULT_SHAPE, retrofit

    model = load_model(name_or_path, dtype=dtype)
    return model if name_or_path is not None else retrofit(model, DEFAULT_SHAPE).eval()


def meta_model(config: PreTrainedConfig) -> PreTrainedModel:
    """The model a config describes, on the meta device: shapes and counts without weights."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
