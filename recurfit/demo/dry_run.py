"""`recurfit demo --dry-run`: the shape the demo will cut, the memory plan of its two trainings and their time on
this machine, without training.

The memory plan is `recurfit train --dry-run`'s (train/memory.py), for the retrofit and for the parent trained on
the same tokens, one after the other. The time is measured, not modelled: each model is built from the parent's
config with random weights (time depends on shapes, not values), and one micro-batch's forward and backward at
the recipe's mean recurrence and one optimizer update are timed here, once each, then multiplied out to the
recipe's micro-batches and steps.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

from ..model.sampling import split_depth
from ..train import load_config as load_train_config
from ..train.config import TrainConfig
from ..train.head import final_hidden_states, head_losses
from ..train.initial_model import is_recurrent, planned_model
from ..train.memory import MemoryPlan, gb, plan_memory
from ..train.memory_fit import plan_table
from ..train.optim import build_optimizers
from .report import duration
from .settings import DemoSettings, training_config, with_shape

WARM_UP_TOKENS = 8  # the untimed forward and backward before the timed one


@dataclass(frozen=True)
class StepTiming:
    """One optimizer step of a training, timed on this machine: its micro-batches' forward and backward (one of
    them timed) and the optimizer's update."""

    forward_backward: float  # seconds, one micro-batch
    micro_batches: int  # per step
    optimizer: float  # seconds, one update
    depth: tuple[int, int]  # (n, k) timed: n steps without gradient, k with

    @property
    def step(self) -> float:
        return self.forward_backward * self.micro_batches + self.optimizer


def dry_run(settings: DemoSettings, console: Console) -> None:
    """Print the shape, each training's memory plan and time, and the totals; train nothing."""
    chosen = "given" if settings.shape is not None else "chosen for the parent's layer count"
    settings = with_shape(settings)
    parent = _random_parent(settings.model)
    plans, seconds = {}, {}
    for name, shape in (("retrofit", settings.shape), ("parent", None)):
        config = demo_config(settings, shape)
        model = planned_model(config, copy.deepcopy(parent) if shape is not None else parent)
        if shape is not None:
            _say_shape(console, shape, chosen, model, parent.config.num_hidden_layers)
        plans[name] = plan_memory(config, model, settings.seq_len, device="cpu")
        if name == "retrofit":
            console.print(plan_table(plans[name]))
        timing = time_step(config, model, settings.seq_len)
        seconds[name] = timing.step * config.steps
        _say_timing(console, name, plans[name], timing, config.steps)
        del model  # before the next model is built: one at a time, as the demo trains them
    peak = max(plans.values(), key=lambda plan: plan.peak)
    console.print(
        f"Memory: the larger plan, {gb(peak.peak)} (tensors only; Python, torch and the data add their own).",
        highlight=False,
    )
    console.print(
        f"Training time on this machine: about {duration(sum(seconds.values()))} for both (stages 3 and 4), "
        f"measured now on {torch.get_num_threads()} threads (other work running now slows it); evaluation (stages "
        "5 to 8) comes on top. Not run: --dry-run.",
        highlight=False,
    )


def demo_config(settings: DemoSettings, shape) -> TrainConfig:
    """The training config the demo runs for the retrofit to `shape` (None: the parent); its data need not exist
    yet."""
    out = settings.out
    data = {store: out / "data" / store for store in ("prose", "math")}
    folder = out / ("recurrent" if shape is not None else "parent")
    return load_train_config(None, base=training_config(settings, data, Path(folder), shape))


def time_step(config: TrainConfig, model: nn.Module, seq_len: int) -> StepTiming:
    """One micro-batch's forward and backward, as training runs it (the loss from the final hidden states, the
    depth at the recipe's mean recurrence: n steps without gradient, then k with), and one optimizer update, on
    random tokens, each timed once. A forward and backward of a few tokens runs first, untimed, to pay the
    one-time costs (kernels' setup, first allocations); the update's timing includes creating its state."""
    micro = config.batch.micro
    depth = split_depth(config.depth.mean_recurrence, config.depth.backprop_depth)
    rows = torch.randint(model.config.vocab_size, (micro, seq_len + 1))
    kwargs = {"num_steps": depth} if is_recurrent(model) else {}
    model.train()

    def forward_backward(rows: torch.Tensor) -> None:
        hidden, weight = final_hidden_states(model, model, rows[:, :-1], **kwargs)
        head_losses(hidden[-1], weight, rows[:, 1:])[0].backward()

    forward_backward(rows[:1, :WARM_UP_TOKENS])
    start = time.perf_counter()
    forward_backward(rows)
    forward_backward_seconds = time.perf_counter() - start
    optimizers = build_optimizers(model, config.optimizer)
    start = time.perf_counter()
    for optimizer in optimizers:
        optimizer.step()
    update_seconds = time.perf_counter() - start
    return StepTiming(forward_backward_seconds, config.batch.global_ // micro, update_seconds, depth)


def _random_parent(model: str | None) -> nn.Module:
    """The parent's architecture with random weights, in float32 on the CPU: no weights are read."""
    from transformers import AutoModelForCausalLM

    from ..model.loading import load_config

    return AutoModelForCausalLM.from_config(load_config(model), dtype=torch.float32)


def _say_shape(console: Console, shape, chosen: str, model: nn.Module, layers: int) -> None:
    P, R, C = shape
    parts = model.config.source_layers
    console.print(
        f"Shape ({P}, {R}, {C}), {chosen}: prelude = parent layers {parts['prelude']}, core = {parts['core']}, "
        f"coda = {parts['coda']}; {P + R + C} of the parent's {layers} layers kept.",
        highlight=False,
    )


def _say_timing(console: Console, name: str, plan: MemoryPlan, timing: StepTiming, steps: int) -> None:
    n, k = timing.depth
    depth = f" at depth (n, k) = ({n}, {k})" if name == "retrofit" else ""
    console.print(
        f"{name.capitalize()}: peak {gb(plan.peak)}; one micro-batch's forward and backward{depth} took "
        f"{timing.forward_backward:.2f} s and one optimizer update {timing.optimizer:.2f} s here, so a step of "
        f"{timing.micro_batches} micro-batches about {timing.step:.1f} s and {steps} steps about "
        f"{duration(timing.step * steps)}.",
        highlight=False,
    )
