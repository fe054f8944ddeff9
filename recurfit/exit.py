"""Adaptive depth: each sequence in a batch stops recurring on its new token once successive steps agree.

Criteria, checked after every core step from `min_steps` on:
    kl        KL(p_s ‖ p_{s-1}) between the next-token distributions of consecutive steps < threshold
    state     ‖s_s - s_{s-1}‖ / ‖s_s‖, the relative change of the recurrent state, < threshold
    argmax    the most likely next token has not changed for `patience` steps
A stopped row keeps its state (the coda reads its last computed step), and its keys and values at deeper
steps are those of that step (the cache's latest-step rule). `kl` and `argmax` run the coda and head at each
step to read the distribution, without keeping what the coda caches. Adaptive depth applies when decoding
one token at a time; a prompt (prefill) runs all its steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .defaults import EXIT_CRITERIA

CRITERIA = EXIT_CRITERIA


@dataclass
class ExitRule:
    criterion: str
    threshold: float = 5e-4
    min_steps: int = 2
    patience: int = 2  # argmax: steps the prediction must hold
    _previous: torch.Tensor | None = field(default=None, repr=False)
    _stable: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.criterion not in CRITERIA:
            raise ValueError(f"exit_criterion must be one of {CRITERIA}, got {self.criterion!r}.")
        if self.min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {self.min_steps}.")

    @classmethod
    def parse(cls, spec: str, **kwargs) -> "ExitRule":
        """'kl:5e-4', 'state:0.01', 'argmax:3' (the number is the threshold, or the patience for argmax)."""
        criterion, _, value = spec.partition(":")
        if criterion == "argmax":
            return cls(criterion, patience=int(value) if value else 2, **kwargs)
        return cls(criterion, threshold=float(value) if value else 5e-4, **kwargs)

    def converged(self, step: int, previous_state: torch.Tensor, state: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A bool per row: has this row's last position settled at `step`? (Call once per step, in order.)"""
        batch = state.shape[0]
        if self.criterion == "state":
            change = (state - previous_state)[:, -1].float().norm(dim=-1) / state[:, -1].float().norm(dim=-1).clamp_min(1e-12)
            done = change < self.threshold
        elif self.criterion == "kl":
            log_p = F.log_softmax(logits(state)[:, -1].float(), dim=-1)
            done = torch.zeros(batch, dtype=torch.bool, device=state.device)
            if self._previous is not None:
                kl = (log_p.exp() * (log_p - self._previous)).sum(-1)
                done = kl < self.threshold
            self._previous = log_p
        else:
            token = logits(state)[:, -1].argmax(-1)
            if self._previous is None:
                self._stable = torch.zeros(batch, dtype=torch.long, device=state.device)
            else:
                self._stable = torch.where(token == self._previous, self._stable + 1, torch.zeros_like(self._stable))
            self._previous = token
            done = self._stable >= self.patience
        return done & (step >= self.min_steps)
