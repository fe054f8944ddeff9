"""A draft folder for vLLM's speculative decoding: the same retrofit, served at a low depth.

    recurfit draft RUN/final --depth 1 --out RUN/draft-r1
    vllm serve RUN/final --speculative-config '{"method": "draft_model", "model": "RUN/draft-r1",
                                               "num_speculative_tokens": 4}'

vLLM's `draft_model` speculation loads its draft from a folder of its own. A retrofit drafts for itself: the draft
folder's config.json is the retrofit's with `mean_recurrence` and `max_recurrence` set to the draft's depth (so
its KV cache holds that many step caches per core layer, not the server's maximum), and every other file (the
weights, the tokenizer) is a relative symbolic link to the retrofit's own: nothing is copied. Torch-free and
vLLM-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import RecurfitError
from ..io.files import check_output, staged_directory

CONFIG = "config.json"
DRAFT_OF = "recurfit_draft_of"  # config.json key: the folder the draft links to (as given), for people reading it


def write_draft(folder: str | Path, depth: int, out: str | Path, replace: bool = False) -> Path:
    """Write the draft folder `out` for the recurfit folder `folder` at `depth`; returns `out`."""
    folder, out = Path(folder), Path(out)
    config = _recurfit_config(folder)
    if not (type(depth) is int and depth >= 1):
        raise RecurfitError(f"--depth must be an integer >= 1, got {depth!r}.")
    served = config["mean_recurrence"]
    if depth >= served:
        raise RecurfitError(
            f"--depth {depth} is not below the depth {folder} serves by default ({served}): a draft pays only when "
            "it is cheaper than the model it drafts for; choose a smaller depth (1 or 2 are typical)."
        )
    if out.resolve() == folder.resolve():
        raise RecurfitError(f"--out {out} is the retrofit's own folder: choose another folder for the draft.")
    check_output(out, replace)
    draft = {**config, "mean_recurrence": depth, "max_recurrence": depth, "depth_for_effort": None}
    draft[DRAFT_OF] = str(folder)
    with staged_directory(out, replace=replace) as staging:
        for source in sorted(folder.iterdir()):
            if source.name != CONFIG and source.is_file():
                (staging / source.name).symlink_to(os.path.relpath(source.resolve(), staging.resolve()))
        (staging / CONFIG).write_text(json.dumps(draft, indent=2) + "\n")
    return out


def _recurfit_config(folder: Path) -> dict:
    """`folder`'s config.json, checked to be a recurfit folder with weights."""
    path = folder / CONFIG
    if not path.is_file():
        raise RecurfitError(f"{folder} has no {CONFIG}: give the folder `recurfit train` or `surgery` saved.")
    config = json.loads(path.read_text())
    if config.get("model_type") != "recurfit":
        raise RecurfitError(
            f"{folder} holds a {config.get('model_type')!r} model, not a recurfit retrofit: a draft is made from a "
            "retrofit's own folder."
        )
    if DRAFT_OF in config:
        raise RecurfitError(f"{folder} is itself a draft (of {config[DRAFT_OF]}): give the retrofit's own folder.")
    if not any(folder.glob("*.safetensors")):
        raise RecurfitError(f"{folder} has no *.safetensors weights to share with a draft.")
    return config
