"""Loading models and tokenizers by path or Hub id, with errors that say what to do offline; where and in
what precision to run them (`resolve_placement`, behind every command's --device, --dtype and --threads)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedModel

from .. import defaults
from ..errors import RecurfitError
from ..io.assets import embedded_model_dir
from ..io.hub import hub_unavailable
from . import modeling  # noqa: F401  (importing the model registers model_type "recurfit" with the Auto classes)


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
    _check_hub(name_or_path)
    return name_or_path


def _check_hub(name: str) -> None:
    """A Hub id that is not in the local Hub cache needs the Hub: say so at once when it is switched off or cannot
    be reached, not after the download's retries."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # downloaded before: transformers loads it offline
    why = hub_unavailable()
    if why:
        raise RecurfitError(
            f"Cannot load {name!r}: it is not a local folder, and {why}. Download it where the Hub is reachable and "
            "pass its folder, or leave --model out to use the embedded SmolLM2-135M."
        )


class NeedsOwnCode(RecurfitError):
    """A model or tokenizer that transformers can read only by running the folder's own code."""


def _from_hub(loader, name: str, settings: str = "config.json", **kwargs):
    """`loader(name)` without ever running the folder's own code: transformers would otherwise ask on a terminal
    (and run it on "y") when `settings` (config.json, tokenizer_config.json) names classes in it (`auto_map`)."""
    try:
        return loader(name, trust_remote_code=False, **kwargs)
    except OSError as problem:
        raise RecurfitError(
            f"Cannot load {name!r}: it is not a local folder, and the Hugging Face Hub could not provide it "
            f"({str(problem).splitlines()[0]}). Offline, download it elsewhere and pass its folder, or leave "
            f"--model out to use the embedded SmolLM2-135M."
        ) from None
    except ValueError as problem:
        if "trust_remote_code" not in str(problem):  # transformers' refusal of the code, worded for its own API
            raise
        raise NeedsOwnCode(_own_code_message(name, settings)) from None


def _own_code_message(name: str, settings: str) -> str:
    where = f"{name.rstrip('/')}/{settings}"
    if settings == "tokenizer_config.json":
        fix = (
            "Save a tokenizer transformers reads without code in its place, e.g. the parent model's: "
            f"AutoTokenizer.from_pretrained(PARENT).save_pretrained({name!r})."
        )
    elif _model_type(name) == "huginn_raven":
        fix = (
            f"It is a huginn_raven checkpoint: convert it with `recurfit import-raven {name} --out DIR`, then use DIR."
        )
    else:
        fix = "Use a model whose model_type transformers or recurfit provides."
    return (
        f"{where} names classes in the folder's own code (auto_map), and recurfit never runs a model's own code. {fix}"
    )


def _model_type(name: str) -> str | None:
    """config.json's model_type, for a local folder."""
    try:
        return json.loads((Path(name) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def load_config(name_or_path: str | None) -> PreTrainedConfig:
    return _from_hub(AutoConfig.from_pretrained, resolve(name_or_path))


def load_model(
    name_or_path: str | None,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str | None = None,
    revision: str | None = None,
) -> PreTrainedModel:
    """A causal LM (a parent, or a saved recurfit model: importing `.modeling` registered its class), in `dtype`
    ("auto": as stored) and on `device` (None: the CPU); `revision`: a Hub branch, tag or commit."""
    pinned = {} if revision is None else {"revision": revision}
    model = _from_hub(AutoModelForCausalLM.from_pretrained, resolve(name_or_path), dtype=dtype, **pinned).eval()
    return model if device is None else model.to(device)


def load_tokenizer(name_or_path: str | None):
    return _from_hub(AutoTokenizer.from_pretrained, resolve(name_or_path), "tokenizer_config.json")


def optional_tokenizer(name_or_path: str | None):
    """The tokenizer saved with a model, or None for a folder that has none (a bare checkpoint). One that needs
    the folder's own code is refused (NeedsOwnCode), not taken for none."""
    try:
        return load_tokenizer(name_or_path)
    except NeedsOwnCode:
        raise
    except (RecurfitError, OSError, ValueError):
        return None


def save_tokenizer(tokenizer, folder: Path) -> None:
    """`tokenizer.save_pretrained(folder)`, without the `auto_map` a source folder's tokenizer_config.json may
    carry: the code it names is not copied, and a recurfit folder names no code to run."""
    tokenizer.save_pretrained(folder)
    settings_file = Path(folder) / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    if settings.pop("auto_map", None) is not None:
        settings_file.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def meta_model(config: PreTrainedConfig) -> PreTrainedModel:
    """The model a config describes, on the meta device: shapes and counts without weights."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# ---------------------------------------------------------------- devices and precision

DTYPES = {name: getattr(torch, name) for name in defaults.DTYPES if name != "auto"}  # the --dtype names


@dataclass(frozen=True)
class Placement:
    """Where a command runs its model and in which precision."""

    device: torch.device
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.device} {str(self.dtype).removeprefix('torch.')}"


def resolve_placement(
    device: str | None = None, dtype: str | torch.dtype = "auto", threads: int | None = None
) -> Placement:
    """`device` None: cuda if a GPU is visible, else cpu. `dtype` "auto": bfloat16 on a GPU (its fast path),
    float32 on a CPU (where bfloat16 is slower and less accurate). `threads`: torch's CPU threads."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise RecurfitError(f"Unknown device {device!r}: use cpu, cuda, cuda:N or mps.") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RecurfitError(
            f"--device {device}: torch sees no CUDA GPU here (a CPU build of torch, or no driver); use --device cpu."
        )
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise RecurfitError(f"--device {device}: torch sees no Apple GPU here; use --device cpu.")
    if isinstance(dtype, str):
        if dtype != "auto" and dtype not in DTYPES:
            raise RecurfitError(f"Unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}.")
        dtype = DTYPES.get(dtype) or (torch.bfloat16 if resolved.type == "cuda" else torch.float32)
    if threads is not None:
        if threads < 1:
            raise RecurfitError(f"--threads must be at least 1, got {threads}.")
        torch.set_num_threads(threads)
    return Placement(resolved, dtype)


def stored_dtype(config: PreTrainedConfig) -> torch.dtype:
    """The precision a model's weights are stored in (its config's `dtype`), float32 if it does not say."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
