"""What a run counts: optimizer steps, tokens, and training FLOPs two ways (the depths actually drawn, and the
paper's rule), plus the teacher's forwards under distillation; and each step's model FLOPs utilisation."""

from __future__ import annotations

from dataclasses import dataclass

from ..model.accounting import paper_flops_per_token, paper_ramp, paper_training_flops, training_flops_per_token
from .config import TrainConfig
from .step_plan import StepPlan


@dataclass
class Counters:
    """Everything the loop accumulates that a resumed run must continue from."""

    step: int = 0  # optimizer steps done
    tokens: int = 0
    flops: float = 0.0  # from the depths actually drawn
    flops_paper: float = 0.0  # the paper's rule: mean recurrence and backprop depth of each step
    flops_teacher: float = 0.0  # distillation: the teacher's forward passes (not in `flops`)
    skipped: int = 0  # updates skipped for a non-finite loss or gradient
    bad_in_row: int = 0


def paper_accounting_depth(config: TrainConfig, step: int) -> tuple[int, int]:
    """(r, k̄) of optimizer step `step` as the paper's FLOPs accounting counts it (`accounting.paper_ramp`, its
    boundaries rounded by `depth.paper_ramp_rounding`)."""
    depth, steps = config.depth, config.steps
    ramps = [
        (depth.mean_recurrence, depth.curriculum, depth.curriculum_fraction),
        (depth.backprop_depth, depth.backprop_curriculum, depth.backprop_curriculum_fraction),
    ]
    r, k = (paper_ramp(step, *ramp, steps, depth.paper_ramp_rounding) for ramp in ramps)
    return r, k


def paper_run_flops(config: TrainConfig, counts: dict, step: int, tokens_per_step: int) -> float:
    """The paper's training FLOPs of `config`'s run after `step` steps of `tokens_per_step` tokens
    (`accounting.paper_training_flops`, every depth setting taken from the config)."""
    depth = config.depth
    return paper_training_flops(
        counts,
        step,
        tokens_per_step,
        total_steps=config.steps,
        mean_recurrence=depth.mean_recurrence,
        backprop_depth=depth.backprop_depth,
        curriculum=depth.curriculum,
        curriculum_fraction=depth.curriculum_fraction,
        backprop_curriculum=depth.backprop_curriculum,
        backprop_curriculum_fraction=depth.backprop_curriculum_fraction,
        ramp_rounding=depth.paper_ramp_rounding,
    )


def step_flops(plan: StepPlan, counts: dict, seq_len: int, readout_flops_per_token) -> float:
    """Training FLOPs of the step `plan` describes, over all processes, from the depths it draws; the healing
    objective's extra readouts (`readout_flops_per_token(counts, (n, k))`) included."""
    return seq_len * sum(
        batch.rows
        * (training_flops_per_token(counts, batch.num_steps) + readout_flops_per_token(counts, batch.num_steps))
        for batch in plan.micro_batches
    )


def count_step(
    counters: Counters,
    config: TrainConfig,
    plan: StepPlan,
    counts: dict,
    seq_len: int,
    flops: float,
    teacher_flops_per_token: float | None,
) -> int:
    """Add the step `plan` describes to `counters`: one step, its tokens, its `flops`, the teacher's forwards
    (`teacher_flops_per_token`: None without distillation) and the paper's FLOPs. Returns the step's tokens."""
    tokens = config.batch.global_ * seq_len
    counters.step += 1
    counters.tokens += tokens
    counters.flops += flops
    if teacher_flops_per_token is not None:
        counters.flops_teacher += tokens * teacher_flops_per_token
    # As the paper's figures count: the authors' ramp, no adapter or final norm (accounting.paper_training_flops).
    counters.flops_paper += tokens * paper_flops_per_token(counts, *paper_accounting_depth(config, plan.step))
    return tokens
