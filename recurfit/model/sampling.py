"""How many recurrences a forward pass runs: the training depth sampler, the curricula, `num_steps` parsing.

The formulas, with the paper's sections: docs/reference/method.md ("The depth sampler", "Curricula").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..defaults import CURRICULA

# `num_steps` as users write it: r (all steps), or (n, k): n steps without gradient, then k with.
NumSteps = int | tuple[int, int]


def parse_num_steps(num_steps) -> tuple[int, int]:
    """Normalise `r` or `(n, k)` to `(n, k)`; a ValueError names the problem for anything else."""
    if isinstance(num_steps, torch.Tensor) and num_steps.numel() in (1, 2):
        num_steps = num_steps.tolist()
    if isinstance(num_steps, int) and not isinstance(num_steps, bool):
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1 recurrence, got {num_steps}.")
        return 0, num_steps
    if isinstance(num_steps, (tuple, list)) and len(num_steps) == 2:
        n, k = num_steps
        if all(isinstance(x, int) and not isinstance(x, bool) for x in (n, k)) and n >= 0 and k >= 0 and n + k >= 1:
            return n, k
    raise ValueError(
        f"num_steps must be an int r >= 1 or a pair (n, k) of non-negative ints with n + k >= 1 "
        f"(n steps without gradient, then k with), got {num_steps!r}."
    )


def sample_depth(
    mean_recurrence: float, backprop_depth: int, generator: torch.Generator | None = None, sigma: float = 0.5
) -> tuple[int, int]:
    """Draw `(n, k)` from the Poisson-lognormal depth distribution of Geiping et al. (Geiping et al.; the paper's §3).

    T = Poisson(LogNormal(μ, σ)) + 1 with μ = ln(r̄) - σ²/2, so E[T] = r̄ + 1 when r̄ ≥ k̄; the last
    `k = min(k̄, T)` steps get gradient, the `n = T - k` before them do not. Pass a generator seeded by
    the optimizer step so every rank, and a resumed run, draws the same depth.
    """
    t = max(mean_recurrence - backprop_depth, 0)
    s = backprop_depth
    mu = math.log(t + s) - sigma**2 / 2
    tau = torch.exp(mu + sigma * torch.randn((), generator=generator, dtype=torch.float64))
    total = int(torch.poisson(tau, generator=generator).item()) + 1
    return max(total - s, 0), min(s, total)


@dataclass(frozen=True)
class Curriculum:
    """A depth that ramps from `start` to `target` over the first `ramp_steps` optimizer steps, then stays there.

        linear:  d(t) = ceil(s + (D - s) · p)                p = (t + lead) / W
        1-sqrt:  d(t) = ceil(s + (D - s) · (1 - sqrt(1 - p)))   (climbs slowly at first: cheaper early steps)

    a staircase of integers, never below 1. `constant` is D from the start. With the defaults (s = 0,
    lead = 0) this is the paper's mean-recurrence curriculum, ceil(D · t/W). The paper authors' backprop-depth
    curriculum is `start=1, lead=1`: their scheduler starts at 1/k̄ of k̄ and is stepped once before training.
    """

    target: int
    kind: str = "constant"
    ramp_steps: int = 0
    start: int = 0
    lead: int = 0

    def __post_init__(self):
        if self.kind not in CURRICULA:
            raise ValueError(f"curriculum must be one of {CURRICULA}, got {self.kind!r}.")
        if self.target < 1 or self.ramp_steps < 0 or not 0 <= self.start <= self.target:
            raise ValueError(
                f"curriculum needs target >= 1, ramp_steps >= 0 and 0 <= start <= target, got "
                f"{self.target}, {self.ramp_steps}, {self.start}."
            )

    def at(self, step: int) -> int:
        progress = step + self.lead
        if self.kind == "constant" or progress >= self.ramp_steps:
            return self.target
        fraction = progress / self.ramp_steps
        if self.kind == "1-sqrt":
            fraction = 1 - math.sqrt(1 - fraction)
        return max(1, math.ceil(self.start + (self.target - self.start) * fraction))


def split_depth(mean_recurrence: int, backprop_depth: int) -> tuple[int, int]:
    """A mean depth as `(n, k)`: k = min(k̄, r̄) final steps with gradient, n = r̄ - k before them without.

    The cap matters early in a curriculum (r̄ = 1, k̄ = 8): uncapped, the sampler would draw about k̄ + 1
    steps and undo the cheap start, and the FLOPs rule would count steps that never run."""
    k = min(backprop_depth, mean_recurrence)
    return mean_recurrence - k, k


def mixed_seed(seed: int, position: int) -> int:
    """One generator seed from a run's `seed` and a position in it (a step, a row): distinct for the positions of
    one run, and for the first million positions of different seeds."""
    return seed * 1_000_003 + position


@dataclass(frozen=True)
class DepthSchedule:
    """The depth of every training step, decided in one place: curricula for the mean recurrence r̄ and the
    backprop depth k̄, and a draw seeded by (seed, step), so every rank and a resumed run get the same (n, k)
    at the same step. `fixed` runs each step at its mean depth instead of drawing."""

    mean_recurrence: Curriculum
    backprop_depth: Curriculum
    seed: int = 0
    fixed: bool = False

    def mean_depth(self, step: int) -> tuple[int, int]:
        """`(n, k)` of the step's mean depth r̄ (what the paper's FLOPs rule counts)."""
        return split_depth(self.mean_recurrence.at(step), self.backprop_depth.at(step))

    def at(self, step: int, row: int | None = None) -> tuple[int, int]:
        """`(n, k)` that optimizer step `step` runs; with `row`, that the step's micro-batch starting at this row
        of the global batch runs (one draw per micro-batch, as the paper authors' loop drew)."""
        n, k = self.mean_depth(step)
        if self.fixed:
            return n, k
        seed = mixed_seed(self.seed, step) if row is None else hash((self.seed, step, row)) % 2**63
        return sample_depth(n + k, k, torch.Generator().manual_seed(seed))
