"""The adapter A([s; e]) that mixes the recurrent state s with the prelude's output e before each core step.

`A([s; e])` is linear in each input, `W [s; e] = W_s s + W_e e`, and e is the same at every one of a token's r
steps, so inference computes `embedded_part(e)` (W_e e) once per forward and `mix(state, part)` (W_s s + part) at
each step: r products of width h and one more, instead of r of width 2h. A forward with gradient (training) keeps
the one product over [s; e] per step (`forward`): its rounding, and the saved tensors the memory plan counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init


class LinearAdapter(nn.Linear):
    """`A([s; e]) = W [s; e]` with W: 2h → h, no bias. `reset_to_identity` gives W = [0 | I], i.e. A = e."""

    def __init__(self, hidden_size: int):
        super().__init__(2 * hidden_size, hidden_size, bias=False)

    def forward(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.cat([state, embedded], dim=-1))

    def embedded_part(self, embedded: torch.Tensor) -> torch.Tensor:
        """W_e e: the part of A([s; e]) that does not change across a token's steps (e is fixed), computed once."""
        return F.linear(embedded, self.weight[:, self.out_features :])

    def mix(self, state: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """A([s; e]) = W_s s + W_e e from `part` = `embedded_part(e)`: the one product a step still needs (the sum
        in float32 when `part` is: each half rounds to the product's dtype once, the sum does not)."""
        return F.linear(state, self.weight[:, : self.out_features]) + part

    def reset_to_identity(self) -> None:
        hidden, like = self.out_features, dict(dtype=self.weight.dtype, device=self.weight.device)
        identity = torch.cat([torch.zeros(hidden, hidden, **like), torch.eye(hidden, **like)], dim=1)
        init.copy_(self.weight, identity)  # transformers' guarded copy: leaves weights loaded from disk alone


class AddAdapter(nn.Module):
    """The paper's "Add" ablation: `A([s; e]) = s + e`, no parameters."""

    def forward(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return state + embedded

    def embedded_part(self, embedded: torch.Tensor) -> torch.Tensor:
        return embedded

    def mix(self, state: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        return state + part

    def reset_to_identity(self) -> None:  # nothing to reset: s + e has no weights
        pass
