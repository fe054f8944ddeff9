"""Whether a memory plan (memory.py) fits a device: device sizes, the verdict naming the micro-batch that fits,
a run's warning, and the plan as a table (`recurfit train CONFIG --dry-run`)."""

from __future__ import annotations

import re

import torch
from torch import nn

from ..errors import RecurfitError
from .config import TrainConfig
from .memory import MemoryPlan, gb, plan_memory

# Of a device's memory, the part a plan may fill: the rest is left to the CUDA context, cuBLAS's workspaces
# and the caching allocator's fragmentation.
USABLE_FRACTION = 0.9


SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'80GB' (10⁹ bytes), '80GiB' (2³⁰), '512MB', '1.5TB', a number of bytes: the bytes; a one-line error else."""
    match = SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise RecurfitError(f"--device-memory must be a size such as 80GB, 80GiB or 512MB, got {text!r}.")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "B").upper()])


def visible_device_memory() -> int | None:
    """The visible GPU's total memory, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def fits(plan: MemoryPlan, memory: int) -> bool:
    return plan.peak <= USABLE_FRACTION * memory


def micro_batches(config: TrainConfig, world: int) -> list[int]:
    """The micro-batches that keep the global batch: divisors of each process's share of it, largest first."""
    share = max(config.batch.global_ // world, 1)
    return [m for m in range(share, 0, -1) if share % m == 0]


def fitting_micro(plan_of, config: TrainConfig, world: int, memory: int) -> int | None:
    """The largest micro-batch whose plan (`plan_of(micro)`) fits `memory`, or None when none does."""
    return next((m for m in micro_batches(config, world) if fits(plan_of(m), memory)), None)


def verdict(plan_of, config: TrainConfig, world: int, memory: int) -> tuple[bool, str]:
    """(fits, the line that says so) for the config's micro-batch; when it does not fit, the line names the
    largest micro-batch that does (`plan_of(micro)`: the plan at a micro-batch)."""
    plan = plan_of(config.batch.micro)
    peak = f"predicted peak {gb(plan.peak)} per device at micro-batch {plan.micro}"
    usable = f"the {gb(USABLE_FRACTION * memory)} usable of {gb(memory)}"
    if fits(plan, memory):
        return True, f"Fits: {peak}, within {usable}."
    fitting = fitting_micro(plan_of, config, world, memory)
    if fitting is None:
        advice = f"no micro-batch fits; try {' or '.join(_bigger_savings(config))}"
    else:
        advice = f"batch.micro={fitting} fits (the same global batch)"
    return False, f"Does not fit: {peak}, more than {usable}; {advice}."


def _bigger_savings(config: TrainConfig) -> list[str]:
    """The settings that save the most memory and the config does not have yet."""
    savings = [] if config.model.gradient_checkpointing else ["model.gradient_checkpointing=true"]
    if config.distributed != "fsdp":
        return [*savings, "distributed=fsdp"]
    return [*savings, "fsdp_units=layer"] if config.fsdp_units != "layer" else [*savings, "more GPUs"]


def planner(config: TrainConfig, model: nn.Module, seq_len: int, *, world: int, device: str, teacher_parameters=0):
    """`plan_of(micro)`: the plan of this run at a micro-batch (what `verdict` tries)."""

    def plan_of(micro: int) -> MemoryPlan:
        return plan_memory(
            config, model, seq_len, world=world, device=device, micro=micro, teacher_parameters=teacher_parameters
        )

    return plan_of


def memory_warning(
    config: TrainConfig, model: nn.Module, seq_len: int, *, world: int, device: str, teacher_parameters=0, memory=None
) -> str | None:
    """The line a run starts with when its plan does not fit `memory` (None: the visible GPU's); None when it
    fits or no device memory is known. A run warns and goes on: the plan is a prediction."""
    memory = memory or visible_device_memory()
    if memory is None:
        return None
    plan_of = planner(config, model, seq_len, world=world, device=device, teacher_parameters=teacher_parameters)
    fits, line = verdict(plan_of, config, world, memory)
    return None if fits else f"warning: {line}"


# ---------------------------------------------------------------- the table


DESCRIPTIONS = {
    "parameters": "fp32 master weights",
    "gradients": "fp32, of the trained weights",
    "optimizer_muon": "Muon momentum (hidden matrices)",
    "optimizer_adamw": "AdamW moments",
    "distributed": "DDP buckets / FSDP2's gathered weights",
    "teacher": "distillation teacher's weights",
    "autocast_copies": "bf16 weight copies kept for backward",
    "activations": "saved for backward",
    "readouts": "depth supervision's extra readouts",
    "logits_and_loss": "logits, their gradient, loss chunks",
    "body_all_gather": "FSDP2: the body's flat all-gather, forward's start",
    "all_gather_buffer": "FSDP2: last unit's flat all-gather, forward's end",
    "unsharded_gradients": "FSDP2: whole gradients (gathered dtype) in backward",
    "beside_gradients": "FSDP2: activations and units beside them",
    "reduce_scatter_buffer": "FSDP2: final callback's gradients + fp32 input",
    "optimizer_step": "step temporaries (after backward)",
    "validation": "validation forward, one chunk of logits",
}


def plan_table(plan: MemoryPlan):
    from rich.table import Table

    precision = "bf16 autocast" if plan.autocast else "fp32"
    where = f"{plan.world} × {plan.strategy.upper()}" if plan.world > 1 else "one process"
    title = (
        f"Memory plan per device: micro-batch {plan.micro} × {plan.seq_len:,} tokens, k = {plan.k} with "
        f"gradient, {precision}, {where}"
    )
    table = Table(title=title, title_justify="left")
    for column, justify in (("part", "left"), ("size", "right"), ("what", "left")):
        table.add_column(column, justify=justify)
    for name, size in plan.parts().items():
        if size:
            table.add_row(name.replace("_", " "), gb(size), DESCRIPTIONS[name])
    peak = "resident + max(forward/backward, whole gradients, step, validation)"  # MemoryPlan.phases
    table.add_row("[bold]peak[/]", f"[bold]{gb(plan.peak)}[/]", peak)
    return table
