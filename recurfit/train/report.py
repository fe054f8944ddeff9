"""What `recurfit train` tells its user: the resolved config, the model's size and cost per token, the depth and
LR schedules (`--dry-run`), warnings about the data phases, and the final validation table."""

from __future__ import annotations

import math

import torch
from rich.table import Table

from ..errors import RecurfitError
from .config import TrainConfig
from .metrics import validation_columns
from .optim import build_schedulers
from .step_plan import depth_schedule


def lr_multiplier(config: TrainConfig):
    """The LR schedule's multiplier of step s (0-based), from the schedule the run builds."""
    (scheduler,) = build_schedulers([torch.optim.SGD([torch.zeros(1)], lr=1.0)], config.optimizer, config.steps)
    return scheduler.lr_lambdas[0]


def schedule_steps(config: TrainConfig) -> list[int]:
    """The steps where something changes: the start, the end of warmup and of each curriculum, the decay's start,
    the quarters of the run, the last step (1-based, as the log counts them)."""
    warmup, decay = config.optimizer.schedule_steps(config.steps)
    depth = config.depth
    ramps = [math.ceil(f * config.steps) for f in (depth.curriculum_fraction, depth.backprop_curriculum_fraction)]
    marks = [1, warmup, *ramps, config.steps - decay, *(config.steps * q // 4 for q in (1, 2, 3)), config.steps]
    return sorted({min(max(mark, 1), config.steps) for mark in marks})


def schedule_table(config: TrainConfig) -> Table:
    """Mean recurrence, backprop depth and learning rates at the steps where the schedules change."""
    schedule, multiplier = depth_schedule(config), lr_multiplier(config)
    muon = config.optimizer.name == "muon"
    table = Table(title=f"Schedule over {config.steps:,} steps", title_justify="left")
    for column in ("step", "mean r̄", "backprop k̄", "LR factor", "AdamW LR", *(["Muon LR"] if muon else [])):
        table.add_column(column, justify="right")
    for step in schedule_steps(config):
        factor = multiplier(step - 1)
        n, k = schedule.mean_depth(step - 1)
        cells = [
            f"{step:,}",
            str(n + k),
            str(k),
            f"{factor:.3f}",
            f"{config.optimizer.lr * factor:.2e}",
        ]
        table.add_row(*cells, *([f"{config.optimizer.muon_lr * factor:.2e}"] if muon else []))
    return table


def tokens_per_row(config: TrainConfig) -> int | None:
    """Training tokens per row of the first store (its seq_len), or None if it is not prepared yet."""
    from ..data import TokenStore

    try:
        return TokenStore(config.data.phases[0].sources[0].path, "train").seq_len
    except (RecurfitError, OSError, KeyError, ValueError):
        return None


def phase_warnings(config: TrainConfig, tokens_per_row: int | None) -> list[str]:
    """A phase whose budget (with those before it) reaches the end of the run leaves the later phases unused."""
    if tokens_per_row is None or len(config.data.phases) < 2:
        return []
    total = config.steps * config.batch.global_ * tokens_per_row
    warnings, spent = [], 0
    for index, phase in enumerate(config.data.phases[:-1]):
        spent += phase.tokens or 0
        if spent >= total:
            warnings.append(
                f"data.phases.{index} (phase {index + 1}) ends at {spent:,} tokens, but the run trains {total:,} "
                f"(steps × batch.global × {tokens_per_row} tokens per row): the phases after it never run. Lower "
                f"its tokens (e.g. data.phases.{index}.tokens={total // 2}) or raise steps."
            )
            break
    return warnings


def validation_table(record: dict | None) -> Table | None:
    """A training log's eval record as a table: a row per validation store, a column per test recurrence."""
    columns, rows = validation_columns(record)
    if not rows:
        return None
    result = Table(title=f"Validation loss (nats/token) at step {record.get('step')}", title_justify="left")
    result.add_column("data")
    for column in columns:
        result.add_column(column, justify="right")
    for store, cells in rows.items():
        result.add_row(store, *cells)
    return result
