"""The model a training config describes: a saved model, a parent retrofitted on the fly, or a random init."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import RecurfitError
from ..init import scaled_init_
from ..loading import load_model, load_tokenizer
from ..modeling import RecurrentForCausalLM
from ..surgery import retrofit
from .config import DepthConfig, ModelConfig


def build_model(config: ModelConfig, depth: DepthConfig, seed: int) -> nn.Module:
    """fp32 master weights on the CPU; the trainer moves them. Recurrent unless `path` is a plain parent with
    no `shape` (the non-recurrent baseline, continued-trained in the same engine)."""
    model = load_model(config.path, dtype=torch.float32)
    layers = {"prelude": config.prelude, "core": config.core, "coda": config.coda} if config.core is not None else {}
    if config.shape is not None or layers:
        if isinstance(model, RecurrentForCausalLM):
            raise RecurfitError("model.shape retrofits a parent model, but model.path is already recurrent; drop model.shape.")
        model = retrofit(
            model, tuple(config.shape) if config.shape else None, **layers, adapter=config.adapter,
            mean_recurrence=depth.mean_recurrence, mean_backprop_depth=depth.backprop_depth,
        )  # fmt: skip
    if isinstance(model, RecurrentForCausalLM):
        model.config.mean_recurrence = depth.mean_recurrence
        model.config.mean_backprop_depth = depth.backprop_depth
        if config.state_init_std is not None:
            model.config.state_init_std = config.state_init_std
    if config.init == "random":
        scaled_init_(model, torch.Generator().manual_seed(seed))
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def is_recurrent(model: nn.Module) -> bool:
    return isinstance(model, RecurrentForCausalLM)


def optional_tokenizer(path: str | None):
    try:
        return load_tokenizer(path)
    except (RecurfitError, OSError, ValueError):
        return None
