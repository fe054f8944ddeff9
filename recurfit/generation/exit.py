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
each decoding forward and gets an `ExitTracker`, which holds that forward's per-row bookkeeping. Compiled decoding
(`recurfit.model.compiled`) keeps the same bookkeeping in a `StaticExitTracker` (`rule.start_static`): buffers of
fixed shape and address, updated in place by the compiled step, with the rule's numbers as tensors, so that one
graph serves every threshold and a CUDA graph replays it.
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

    def start_static(self, batch: int, vocabulary: int, device) -> StaticExitTracker:
        """Device buffers for compiled decoding's bookkeeping of `batch` rows (kept with the static cache, bound to
        a rule and reset at each token)."""
        return StaticExitTracker(batch, vocabulary, device)


def step_kl(log_p: torch.Tensor, log_p_before: torch.Tensor) -> torch.Tensor:
    """KL(p_s ‖ p_{s-1}) over the last axis, from the log-probabilities of a step and of the step before: what the
    `kl` criterion compares with its threshold."""
    return (log_p.exp() * (log_p - log_p_before)).sum(-1)


def relative_change(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """‖now - before‖ / ‖now‖ per row, of the last position's states: what the `state` criterion compares."""
    now, before = now[:, -1].float(), before[:, -1].float()
    return (now - before).norm(dim=-1) / now.norm(dim=-1).clamp_min(1e-12)


def held(token: torch.Tensor, previous: torch.Tensor, stable: torch.Tensor) -> torch.Tensor:
    """The `argmax` criterion's count of steps each row's most likely token has held, after a step predicting
    `token` (`previous` the step before's prediction)."""
    return torch.where(token == previous, stable + 1, torch.zeros_like(stable))


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
            return self._scatter(relative_change(pick(state), pick(previous)) < self.rule.threshold, rows)
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
            self._stable = held(token, self._previous, self._stable)
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


class StaticExitTracker:
    """`ExitTracker`'s bookkeeping for compiled decoding: every row stays in the batch (settled rows frozen, as
    `ExitTracker` keeps them with `check_every` > 1), and every value lives in a buffer of fixed shape and address
    that `check` updates in place, so a compiled step holds the whole check without a host value (the step number
    included) and a CUDA graph of it replays. The rule's numbers are tensors (a new threshold is no new graph);
    its criterion is the step's Python (one graph per criterion). `done` doubles as the cache's mask of frozen
    rows: read by a step's key and value writes before its check updates it."""

    def __init__(self, batch: int, vocabulary: int, device):
        def buffer(dtype, *shape):
            tensor = torch.zeros(shape, dtype=dtype, device=device)
            torch._dynamo.mark_static_address(tensor)  # read in place by compiled steps and captured graphs
            return tensor

        self.rule: ExitRule | None = None
        self.criterion: str | None = None
        self.done, self.steps = buffer(torch.bool, batch), buffer(torch.long, batch)
        self.step, self.stable = buffer(torch.long), buffer(torch.long, batch)
        self.previous_log_p, self.previous_token = buffer(torch.float32, batch, vocabulary), buffer(torch.long, batch)
        self.threshold, self.patience, self.min_steps = buffer(torch.float32), buffer(torch.long), buffer(torch.long)

    def bind(self, rule: ExitRule) -> None:
        """Decode the next tokens under `rule` (its numbers written into the buffers when it changed)."""
        if rule != self.rule:
            self.threshold.fill_(rule.threshold)
            self.patience.fill_(rule.patience)
            self.min_steps.fill_(rule.min_steps)
            self.rule, self.criterion = rule, rule.criterion  # the compiled step reads the criterion alone

    def reset(self) -> None:
        """A new token: no row settled, no step run."""
        for tensor in (self.done, self.steps, self.step, self.stable):
            tensor.zero_()

    def check(self, previous: torch.Tensor, state: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor]):
        """After a core step from `previous` to `state` (settled rows' already kept): count the step for the rows
        that ran it, and stop those that settled, as `ExitTracker.check` does. `logits(state)` reads the next-token
        logits of every row at `state`."""
        self.step.add_(1)
        self.steps.copy_(torch.where(self.done, self.steps, self.step))
        settled = self._settled(previous, state, logits) & (self.step >= self.min_steps)
        self.done.logical_or_(settled)

    def _settled(self, previous, state, logits) -> torch.Tensor:
        if self.criterion == "state":
            return relative_change(state, previous) < self.threshold
        read = logits(state)[:, -1].float()
        compared = self.step > 1  # the first step has nothing to compare with (ExitTracker's `_previous` is None)
        if self.criterion == "kl":
            log_p = F.log_softmax(read, dim=-1)
            settled = compared & (step_kl(log_p, self.previous_log_p) < self.threshold)
            self.previous_log_p.copy_(log_p)
            return settled
        token = read.argmax(-1)
        self.stable.copy_(torch.where(compared, held(token, self.previous_token, self.stable), self.stable))
        self.previous_token.copy_(token)
        return self.stable >= self.patience
