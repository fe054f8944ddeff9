"""What one optimizer step runs: its global batch as micro-batches, each with the depth (n, k) it is run at.

The depths come from the curricula and a sampler seeded by (seed, step[, row]), so every process, and a resumed
run, plans the same step; a micro-batch is named by its first row in the global batch, whatever the number of
processes. With one draw per micro-batch, the draws are either each process's own, seeded by the micro-batch's
first row in the global batch (two processes then run the depths that one does), or the same on every process,
seeded by its first row in its process's share: one draw per micro-batch slot, as the paper authors' loop, whose
draws were the same on every GPU (`draws_shared`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..model.sampling import Curriculum, DepthSchedule
from .config import TrainConfig


def depth_schedule(config: TrainConfig) -> DepthSchedule:
    """The curricula as the paper authors' scripts computed them: ramps of ceil(fraction · steps) steps; the
    mean recurrence climbs from 0 (at least 1), the backprop depth from 1, one step ahead."""
    depth, steps = config.depth, config.steps
    return DepthSchedule(
        Curriculum(depth.mean_recurrence, depth.curriculum, math.ceil(depth.curriculum_fraction * steps)),
        Curriculum(
            depth.backprop_depth,
            depth.backprop_curriculum,
            math.ceil(depth.backprop_curriculum_fraction * steps),
            start=1,
            lead=1,
        ),
        seed=config.seed,
        fixed=depth.fixed,
    )


@dataclass(frozen=True)
class MicroBatch:
    """Rows `first_row` … `first_row + rows - 1` of the global batch, run at depth (n, k): n recurrences without
    gradient, then k with."""

    first_row: int
    rows: int
    n: int
    k: int

    @property
    def num_steps(self) -> tuple[int, int]:
        return self.n, self.k


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step's depths: a single draw for the whole global batch (`depth.draw: step`, or a baseline),
    or one per micro-batch of the global batch over all processes (`depth.draw: micro_batch`)."""

    step: int  # optimizer steps done before this one
    micro_batches: tuple[MicroBatch, ...]

    @property
    def per_micro_batch(self) -> bool:
        """Whether the step draws more than one depth (the log then lists them all)."""
        return len(self.micro_batches) > 1

    @property
    def first(self) -> MicroBatch:
        return self.micro_batches[0]

    def at_row(self, first_row: int) -> MicroBatch:
        """The planned micro-batch that starts at `first_row` of the global batch (the single draw if one)."""
        return next((m for m in self.micro_batches if m.first_row == first_row), self.first)


def draws_shared(config: TrainConfig) -> bool:
    """Whether every process runs the same depths, one draw per micro-batch slot (`depth.across_processes`).

    FSDP2 synchronises the processes at every micro-batch (each unit's all-gather and reduce-scatter), so a step
    costs the sum over micro-batches of the deepest process's draw; by layer its collectives also follow the depth.
    DDP synchronises once per step, at the last micro-batch's all-reduce: each process's own draws then cost only
    the spread of the processes' sums, and keep a run's depths those of one process."""
    across = config.depth.across_processes
    return across == "same" or (across == "auto" and config.distributed == "fsdp")


def plan_step(config: TrainConfig, schedule: DepthSchedule, step: int, world: int, recurrent: bool) -> StepPlan:
    """The plan of optimizer step `step` (0-based) of a run on `world` processes."""
    global_rows, micro = config.batch.global_, config.batch.micro
    if not recurrent:
        return StepPlan(step, (MicroBatch(0, global_rows, 0, 1),))
    if config.depth.draw == "step":
        return StepPlan(step, (MicroBatch(0, global_rows, *schedule.at(step)),))
    share = global_rows // world
    starts = [rank * share + start for rank in range(world) for start in range(0, share, micro)]
    seeded_by = share if draws_shared(config) else global_rows  # a row's seed: its place in its share, or the batch
    return StepPlan(
        step,
        tuple(MicroBatch(row, min(micro, share - row % share), *schedule.at(step, row % seeded_by)) for row in starts),
    )
