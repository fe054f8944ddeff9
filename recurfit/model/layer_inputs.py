"""What the decoder layers receive besides the hidden states: position ids from the attention mask, and a
batch's layer inputs cut to some of its rows (adaptive depth runs the core only on the rows still recurring)."""

from __future__ import annotations

import torch


def select_rows(inputs, rows: torch.LongTensor, batch: int):
    """`inputs` (a layer's keyword arguments: masks, rotary embeddings, position ids) for `rows` of a `batch` only:
    every tensor whose first dimension is the batch is indexed; broadcast ones and the rest pass as they are.
    (Rows are only ever dropped from a batch of two or more, so a broadcast dimension of 1 is never mistaken.)"""
    if isinstance(inputs, dict):
        return {key: select_rows(value, rows, batch) for key, value in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(select_rows(value, rows, batch) for value in inputs)
    if isinstance(inputs, torch.Tensor) and inputs.dim() > 0 and inputs.shape[0] == batch > 1:
        return inputs[rows]
    return inputs


def positions_from_mask(attention_mask: torch.Tensor | None, length: int, device, past: int = 0) -> torch.LongTensor:
    """Position ids that start at 0 on each row's first real token, so left padding does not shift RoPE.

    `attention_mask` covers the `past` cached tokens and the `length` new ones; the new ones' ids come back."""
    if attention_mask is None or attention_mask.dim() != 2:
        return torch.arange(past, past + length, device=device).unsqueeze(0)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]
