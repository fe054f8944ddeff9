"""The adapter A([s; e]) that mixes the recurrent state s with the prelude's output e before each core step."""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init


class LinearAdapter(nn.Linear):
    """`A([s; e]) = W [s; e]` with W: 2h → h, no bias. `reset_to_identity` gives W = [0 | I], i.e. A = e."""

    def __init__(self, hidden_size: int):
        super().__init__(2 * hidden_size, hidden_size, bias=False)

    def forward(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.cat([state, embedded], dim=-1))

    def reset_to_identity(self) -> None:
        hidden, like = self.out_features, dict(dtype=self.weight.dtype, device=self.weight.device)
        identity = torch.cat([torch.zeros(hidden, hidden, **like), torch.eye(hidden, **like)], dim=1)
        init.copy_(self.weight, identity)  # transformers' guarded copy: leaves weights loaded from disk alone


class AddAdapter(nn.Module):
    """The paper's "Add" ablation: `A([s; e]) = s + e`, no parameters."""

    def forward(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return state + embedded

    def reset_to_identity(self) -> None:  # nothing to reset: s + e has no weights
        pass
