"""Adaptive depth: each sequence in a batch stops recurring on its new token once successive steps agree.

Criteria, checked after every core step from `min_steps` on:
    kl        KL(p_s ‖ p_{s-1}) between the next-token distributions of consecutive steps < threshold
    state     ‖s_s - s_{s-1}‖ / ‖s_s‖, the relative change of the recurrent state, < threshold
    argmax    the most likely next token has not changed for `patience` steps
A stopped row keeps its state (the coda reads its last computed step), its keys and values at deeper steps
are those of that step (the cache's latest-step rule), and the core no longer runs on it: the next steps
compute only the rows still recurring. `kl` and `argmax` run the coda and head at each step to read the
distribution, without keeping what the coda caches. Adaptive depth applies when decoding one token at a
time; a prompt (prefill) runs all its steps.

`ExitRule` is the setting (what users write: "kl:5e-4", "argmax:3"); the model calls `rule.start(batch)` at
each decoding forward and gets an `ExitTracker`, which holds that forward's per-row bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..defaults import EXIT_CRITERIA
from ..errors import RecurfitError

DEFAULT_THRESHOLD = 5e-4
DEFAULT_PATIENCE = 2


@dataclass(frozen=True)
class ExitRule:
    criterion: str
    threshold: float = DEFAULT_THRESHOLD  # kl, state
    min_steps: int = 2
    patience: int = DEFAULT_PATIENCE  # argmax: steps the prediction must hold
    # The host asks whether rows settled once every `check_every` steps. 1: settled rows leave the core's batch at
    # once (least compute; a wait on the device at every step). m > 1: every row stays in the batch, settled rows
    # frozen (their state and cache entries kept), and nothing waits on the device between checks.
    check_every: int = 1

    def __post_init__(self):
        if self.criterion not in EXIT_CRITERIA:
            raise RecurfitError(f"exit criterion must be one of {', '.join(EXIT_CRITERIA)}, got {self.criterion!r}.")
        if self.min_steps < 1:
            raise RecurfitError(f"min_steps must be >= 1, got {self.min_steps}.")
        if self.patience < 1:
            raise RecurfitError(f"argmax patience must be >= 1 step, got {self.patience}.")
        if self.check_every < 1:
            raise RecurfitError(f"exit check_every must be >= 1 step, got {self.check_every}.")

    @classmethod
    def parse(cls, spec: str | None, min_steps: int = 2, check_every: int = 1) -> ExitRule | None:
        """'kl:5e-4', 'state:0.01', 'argmax:3': the number is the threshold, or the patience for argmax.
        The one parser of exit specs, for the CLI, `generate_text` and lm-eval's `model_args`; None stays None."""
        if spec is None:
            return None
        criterion, _, value = spec.partition(":")
        if criterion not in EXIT_CRITERIA:
            raise RecurfitError(
                f"--exit takes CRITERION[:VALUE] with CRITERION one of {', '.join(EXIT_CRITERIA)}, got {spec!r}."
            )
        kind, field = (int, "patience") if criterion == "argmax" else (float, "threshold")
        try:
            number = kind(value) if value else None
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise RecurfitError(f"--exit {spec!r}: {value!r} is not {expected}.") from None
        number = {} if number is None else {field: number}
        return cls(criterion, min_steps=min_steps, check_every=check_every, **number)

    def start(self, batch: int, device) -> ExitTracker:
        """The bookkeeping of one decoding forward over `batch` rows."""
        return ExitTracker(self, batch, device)


def step_kl(log_p: torch.Tensor, log_p_before: torch.Tensor) -> torch.Tensor:
    """KL(p_s ‖ p_{s-1}) over the last axis, from the log-probabilities of a step and of the step before: what the
    `kl` criterion compares with its threshold."""
    return (log_p.exp() * (log_p - log_p_before)).sum(-1)


class ExitTracker:
    """Which rows still recur, and at which step each one stopped, during one forward."""

    def __init__(self, rule: ExitRule, batch: int, device):
        self.rule = rule
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.steps = torch.zeros(batch, dtype=torch.long, device=device)  # steps each row ran so far
        self._previous: torch.Tensor | None = None  # kl: log-probs, argmax: tokens, of the previous step
        self._stable = torch.zeros(batch, dtype=torch.long, device=device)  # argmax: steps the token held

    @property
    def masked(self) -> bool:
        """Whether settled rows stay in the batch, frozen, instead of leaving it (no host waits between checks)."""
        return self.rule.check_every > 1

    @property
    def active(self) -> torch.LongTensor | None:
        """Indices of the rows still recurring, or None while all are (so callers skip the gather); always None
        when settled rows are frozen in place."""
        if self.masked or not self.done.any():
            return None
        return (~self.done).nonzero().squeeze(1)

    @property
    def frozen(self) -> torch.Tensor | None:
        """When settled rows stay in the batch: a bool per row, True for those that keep their state."""
        return self.done if self.masked else None

    def finished(self, step: int) -> bool:
        """Whether every row has settled, asked of the device only every `check_every` steps."""
        return step % self.rule.check_every == 0 and bool(self.done.all())

    def check(
        self,
        step: int,
        previous: torch.Tensor,
        state: torch.Tensor,
        logits: Callable[[torch.Tensor, torch.LongTensor | None], torch.Tensor],
    ) -> None:
        """After core step `step`: count it for the rows that ran it, and stop those that settled.
        `logits(state, rows)` reads the next-token logits of `rows` (None: all) at `state` (only those rows)."""
        rows = self.active
        self.steps = torch.where(self.done, self.steps, step)
        settled = self._settled(previous, state, rows, logits)
        if step >= self.rule.min_steps:
            self.done = self.done | settled  # a new tensor: `frozen` of this step stays as it was

    def _settled(self, previous, state, rows, logits) -> torch.Tensor:
        """A bool per row of the batch (rows already stopped are don't-cares)."""
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        if self.rule.criterion == "state":
            now, before = pick(state)[:, -1].float(), pick(previous)[:, -1].float()
            change = (now - before).norm(dim=-1) / now.norm(dim=-1).clamp_min(1e-12)
            return self._scatter(change < self.rule.threshold, rows)
        read = logits(pick(state), rows)[:, -1].float()
        if self.rule.criterion == "kl":
            log_p = self._scatter(F.log_softmax(read, dim=-1), rows, self._previous)
            settled = torch.zeros_like(self.done)
            if self._previous is not None:
                settled = step_kl(log_p, self._previous) < self.rule.threshold
            self._previous = log_p
            return settled
        token = self._scatter(read.argmax(-1), rows, self._previous)
        if self._previous is not None:
            self._stable = torch.where(token == self._previous, self._stable + 1, torch.zeros_like(self._stable))
        self._previous = token
        return self._stable >= self.rule.patience

    def _scatter(self, values: torch.Tensor, rows, into: torch.Tensor | None = None) -> torch.Tensor:
        """`values` of `rows` placed in a full-batch tensor (`into`'s other rows, or zeros)."""
        if rows is None:
            return values
        full = torch.zeros((len(self.done), *values.shape[1:]), dtype=values.dtype, device=values.device)
        if into is not None:
            full.copy_(into)
        return full.index_copy(0, rows, values)
