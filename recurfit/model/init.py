"""The scaled random initialisation the paper's random-init baseline uses (Takase et al. 2023, as in Huginn).

Every matrix and the embeddings are drawn from a truncated normal (±3σ) with σ = sqrt(2 / (5h)) ("small
init"); the projections that write into the residual stream (attention output, MLP down) are further
divided by sqrt(2 · L_eff), with L_eff the effective depth prelude + r̄·core + coda, so the residual stream
does not grow with depth. Huginn's init gives the linear half of the gated MLP (`up`, the second half of its
fused `fc`) that smaller σ too. Norm weights are 1, biases 0, and a linear adapter is a random matrix too.
Huginn also multiplies token embeddings by `emb_scale` in the forward: that is `model.embedding_scale`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .modeling import RecurrentForCausalLM

# Drawn with the depth-scaled σ: the residual writers, and the GLU's linear half as Huginn's `init_glu` does.
DEPTH_SCALED = ("o_proj", "down_proj", "up_proj")


def effective_depth(model: nn.Module) -> int:
    if isinstance(model, RecurrentForCausalLM):
        P, R, C = model.config.shape
        return P + model.config.mean_recurrence * R + C
    return model.config.num_hidden_layers


@torch.no_grad()
def scaled_init_(model: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
    """Re-initialise every weight of `model` in place with the scaled init; returns the model."""
    hidden = model.config.hidden_size
    std = math.sqrt(2 / (5 * hidden))
    residual_std = std / math.sqrt(2 * effective_depth(model))
    for name, parameter in model.named_parameters():
        leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
        if parameter.ndim >= 2:
            scale = residual_std if leaf in DEPTH_SCALED else std
            values = torch.empty(parameter.shape, dtype=torch.float32)
            nn.init.trunc_normal_(values, std=scale, a=-3 * scale, b=3 * scale, generator=generator)
            parameter.copy_(values)
        elif name.endswith("bias"):
            parameter.zero_()
        else:  # norm weights: neutral, i.e. 1 (0 for Gemma's zero-centred RMSNorm, which computes x·(1 + w))
            parameter.fill_(0.0 if _zero_centred_norm(model) else 1.0)
    return model


def _zero_centred_norm(model: nn.Module) -> bool:
    return (
        getattr(model.config, "model_type", "") == "gemma"
        or getattr(getattr(model.config, "text_config", None), "model_type", "") == "gemma"
    )
