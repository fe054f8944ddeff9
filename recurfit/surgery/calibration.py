"""Calibration text: the tokens layer scores (ShortGPT's Block Influence, the angular distance) are read on."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import RecurfitError

EMBEDDED_PROSE = "embedded:prose"  # calibration text without a file: the English passages recurfit bundles


@torch.no_grad()
def calibration_ids(tokenizer, path: Path | str, max_tokens: int = 2048) -> torch.Tensor:
    """The first `max_tokens` tokens of a plain-text file (or of the embedded prose, `embedded:prose`), as
    ShortGPT's and the angular distance's layer scores read them (1 × tokens)."""
    if str(path) == EMBEDDED_PROSE:
        text = _embedded_prose(chars=8 * max_tokens)  # English runs about 4 characters a token
    elif Path(path).is_file():
        text = Path(path).read_text()
    else:
        raise RecurfitError(f"Calibration file not found: {path}; give a plain-text file or {EMBEDDED_PROSE}.")
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
    if ids.numel() < 16:
        raise RecurfitError(f"{path} holds only {ids.numel()} tokens; give at least a paragraph of text.")
    return ids


def _embedded_prose(chars: int) -> str:
    """The first passages of `embedded:prose`, joined by blank lines, up to about `chars` characters."""
    from ..data.sources import embedded_prose

    passages, size = [], 0
    for passage in embedded_prose():
        passages.append(passage)
        size += len(passage) + 2
        if size >= chars:
            break
    return "\n\n".join(passages)
