"""The training config's rules: what each section's values must be, and what sections must agree on.

Each `*_problems` function returns the problems it finds as short phrases naming the key; `validate` raises them
all in one RecurfitError. (The schema, what keys exist and what types they hold, is `schema.py`; reading YAML and
overrides into it is `binder.py`.)
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from ...defaults import LAYER_PARTS, TRAINABLE_PARTS
from ...errors import RecurfitError
from ...model.shape import shape_or_indices_problem, shape_problem

if TYPE_CHECKING:
    from .schema import DistillConfig, LoraConfig, ModelConfig, OptimizerConfig, SuperviseConfig, TrainConfig


def validate(config: TrainConfig) -> TrainConfig:
    """`config`, or a RecurfitError listing every problem it has."""
    problems = config_problems(config)
    if problems:
        raise RecurfitError("Invalid training config: " + "; ".join(problems) + ".")
    return config


def config_problems(config: TrainConfig) -> list[str]:
    """Every problem of `config`, each section's and those between sections, in the order a user reads them."""
    problems = []
    if config.steps < 1:
        problems.append("steps must be >= 1")
    elif config.stop_at is not None and not 1 <= config.stop_at <= config.steps:
        problems.append(f"stop_at must be a step from 1 to steps ({config.steps}), got {config.stop_at}")
    if config.batch.micro < 1 or config.batch.global_ < config.batch.micro:
        problems.append("batch.micro must be >= 1 and batch.global >= batch.micro")
    elif config.batch.global_ % config.batch.micro:
        problems.append(
            f"batch.global ({config.batch.global_}) must be a multiple of batch.micro ({config.batch.micro})"
        )
    problems += model_problems(config.model)
    if config.depth.mean_recurrence < 1 or config.depth.backprop_depth < 1:
        problems.append("depth.mean_recurrence and depth.backprop_depth must be >= 1")
    if not config.data.phases:
        problems.append("data.phases needs at least one phase with sources")
    for number, phase in enumerate(config.data.phases):
        if not phase.sources:
            problems.append(f"data.phases[{number}] has no sources")
        if any(s.weight <= 0 for s in phase.sources):
            problems.append(f"data.phases[{number}]: source weights must be positive")
        if phase.tokens is None and number != len(config.data.phases) - 1:
            problems.append(f"data.phases[{number}] needs a token budget (only the last phase may omit it)")
        if phase.tokens is not None and phase.tokens < 1:
            problems.append(f"data.phases[{number}].tokens must be >= 1, got {phase.tokens}")
    if min(config.eval.steps, default=1) < 1:
        problems.append("eval.steps must be recurrences >= 1")
    if any(not 1 <= step <= config.steps for step in config.eval.at):
        problems.append(f"eval.at must be optimizer steps from 1 to steps ({config.steps}), got {config.eval.at}")
    if config.checkpoint.keep < 1:
        problems.append("checkpoint.keep must be >= 1")
    for name, value, least in (
        ("checkpoint.every", config.checkpoint.every, 0),
        ("snapshots.every", config.snapshots.every, 0),
        ("eval.every", config.eval.every, 0),
        ("log.every", config.log.every, 1),
        ("eval.rows", config.eval.rows, 1),
        ("max_bad_steps", config.max_bad_steps, 1),
        ("distributed_timeout", config.distributed_timeout, 1),
    ):
        if value < least:
            problems.append(f"{name} must be >= {least}, got {value}")
    if config.fsdp_units != "recurrence" and config.distributed != "fsdp":
        problems.append(f"fsdp_units={config.fsdp_units} shards with FSDP2: set distributed=fsdp as well")
    if config.fsdp_shard_size is not None and config.distributed != "fsdp":
        problems.append(f"fsdp_shard_size={config.fsdp_shard_size} shards with FSDP2: set distributed=fsdp as well")
    if config.fsdp_shard_size is not None and config.fsdp_shard_size < 1:
        problems.append(f"fsdp_shard_size must be >= 1 (or null: a node's processes), got {config.fsdp_shard_size}")
    problems += draw_problems(config)
    for name in ("curriculum_fraction", "backprop_curriculum_fraction"):
        if not 0 <= getattr(config.depth, name) <= 1:
            problems.append(f"depth.{name} must be in [0, 1]")
    problems += optimizer_problems(config.optimizer, config.steps)
    if config.depth.supervise is not None:
        problems += supervise_problems(config.depth.supervise)
    if config.distill is not None:
        problems += distill_problems(config.distill, config.model)
    if config.lora is not None:
        problems += lora_problems(config.lora, config)
    elif config.model.trainable == []:
        problems.append("model.trainable is empty: name the parts to train (or leave it out to train all)")
    return problems


def draw_problems(config: TrainConfig) -> list[str]:
    across = config.depth.across_processes
    if across != "auto" and config.depth.draw != "micro_batch":
        return [f"depth.across_processes={across} applies to one draw per micro-batch: set depth.draw=micro_batch"]
    if across == "own" and config.distributed == "fsdp" and config.fsdp_units == "layer":
        return ["depth.across_processes=own: by layer, FSDP2's collectives follow the depth: use same or auto"]
    return []


def model_problems(model: ModelConfig) -> list[str]:
    """What is wrong with the `model` section on its own: the source, the layers it keeps and how they are chosen."""
    problems = []
    explicit = [model.prelude, model.core, model.coda]
    retrofits = model.shape is not None or any(part is not None for part in explicit)
    if model.shape is not None and (problem := shape_problem(model.shape)):
        problems.append(f"model.{problem}")
    if any(part is not None for part in explicit):
        if both := shape_or_indices_problem(model.shape, explicit, "model.shape", "model.prelude/core/coda"):
            problems.append(both)
        elif model.core is None or None in explicit[::2]:
            problems.append("model.prelude, model.core and model.coda go together (an empty list is allowed)")
        elif not _in_parent_order(model.prelude, model.core, model.coda):
            problems.append(
                f"model.prelude {model.prelude}, core {model.core} and coda {model.coda} must run in parent order: "
                "every prelude layer before every core layer, every core layer before every coda layer"
            )
    if model.init_from is not None:
        if model.path is not None or model.revision is not None:
            problems.append("model.init_from continues a run's final model; drop model.path and model.revision")
        if retrofits or model.prune_to is not None or model.init == "random":
            problems.append(
                "model.init_from continues a run's final model as it is; drop model.shape/prelude/core/coda, "
                "model.prune_to and model.init=random"
            )
    if model.carry_state and model.init_from is None:
        problems.append("model.carry_state carries a finished run's state: set model.init_from to that run")
    if model.continue_schedule and model.init_from is None:
        problems.append("model.continue_schedule continues a run: set model.init_from to that run")
    if model.prune_to is not None:
        if retrofits:
            problems.append("model.prune_to makes a non-recurrent baseline; drop model.shape/prelude/core/coda")
        if model.prune_to < 1:
            problems.append(f"model.prune_to must be >= 1 layer, got {model.prune_to}")
        if model.select != "shortgpt":
            problems.append("model.prune_to picks layers by ShortGPT's Block Influence: set model.select=shortgpt")
    if model.select != "paper" and model.calibration is None:
        problems.append(f"model.select={model.select} scores layers on text: set model.calibration to a token store")
    if model.select == "shortgpt":
        if model.shape is None and model.prune_to is None:
            problems.append("model.select=shortgpt needs model.shape (a retrofit) or model.prune_to (a baseline)")
    if model.select == "angular" and any(part is not None for part in explicit):
        problems.append("model.select=angular chooses the layers; drop model.prelude/core/coda (or the select)")
    if model.embedding_scale is not None and not model.embedding_scale > 0:
        problems.append(f"model.embedding_scale must be > 0, got {model.embedding_scale}")
    if model.calibration_rows < 1:
        problems.append("model.calibration_rows must be >= 1")
    if model.state_init_std is not None and not model.state_init_std >= 0:
        problems.append(f"model.state_init_std must be >= 0 (0: a zero initial state), got {model.state_init_std}")
    problems += unknown_parts("model.trainable", model.trainable, TRAINABLE_PARTS)
    return problems


def supervise_problems(supervise: SuperviseConfig) -> list[str]:
    if supervise.last is not None and supervise.last < 1:
        return [f"depth.supervise.last must be >= 1 recurrence (null: every one with gradient), got {supervise.last}"]
    return []


def optimizer_problems(optimizer: OptimizerConfig, steps: int) -> list[str]:
    """The optimizer's settings, and its LR schedule against a run of `steps`."""
    found = []
    for name in ("warmup", "decay"):
        value = getattr(optimizer, name)
        if value < 0 or (value >= 1 and not float(value).is_integer()):
            found.append(
                f"optimizer.{name} must be a fraction of the steps in [0, 1) or a whole step count, got {value}"
            )
    if not 0 <= optimizer.min_lr_ratio <= 1:
        found.append(f"optimizer.min_lr_ratio must be in [0, 1], got {optimizer.min_lr_ratio}")
    if optimizer.eps is not None and optimizer.eps <= 0:
        found.append(f"optimizer.eps must be > 0, got {optimizer.eps}")
    for name in ("lr", "muon_lr"):
        if not getattr(optimizer, name) > 0:
            found.append(f"optimizer.{name} must be > 0, got {getattr(optimizer, name)}")
    if not optimizer.weight_decay >= 0 or not optimizer.grad_clip >= 0:
        found.append("optimizer.weight_decay and optimizer.grad_clip must be >= 0 (grad_clip 0: no clipping)")
    if (
        len(optimizer.betas) != 2
        or not all(0 <= b < 1 for b in optimizer.betas)
        or not 0 <= optimizer.muon_momentum < 1
    ):
        found.append(f"optimizer.betas must be two values in [0, 1) and muon_momentum one, got {optimizer.betas}")
    if not found and optimizer.warmup < 1 and optimizer.decay < 1 and optimizer.warmup + optimizer.decay > 1:
        found.append(
            f"optimizer.warmup ({optimizer.warmup}) + optimizer.decay ({optimizer.decay}) are more than the whole run"
        )
    elif not found and steps >= 1:
        warmup, decay = optimizer.schedule_steps(steps)
        if warmup + decay > steps:
            found.append(
                f"optimizer.warmup ({warmup} steps) + optimizer.decay ({decay} steps) are longer than the run "
                f"(steps: {steps}); shorten them"
            )
    return found


def distill_problems(distill: DistillConfig, model: ModelConfig) -> list[str]:
    """The distillation settings, and where the teacher comes from given the `model` section."""
    found = []
    if not 0 <= distill.alpha <= 1:
        found.append(f"distill.alpha must be in [0, 1] (the weight of the cross-entropy), got {distill.alpha}")
    if not distill.temperature > 0:
        found.append(f"distill.temperature must be > 0, got {distill.temperature}")
    if distill.teacher is None and model.init_from is not None:
        found.append(
            "distill.teacher defaults to model.path, which a run from model.init_from has not: set "
            "distill.teacher to the parent to distil from (a folder or Hub id)"
        )
    if distill.revision is not None and distill.teacher is None:
        found.append(
            "distill.revision pins a Hub distill.teacher: set distill.teacher (the parent's is model.revision)"
        )
    return found


def lora_problems(lora: LoraConfig, config: TrainConfig) -> list[str]:
    """LoRA's settings, and what they clash with elsewhere in the config."""
    found = unknown_parts("lora.parts", lora.parts, LAYER_PARTS)
    if lora.rank < 1 or not lora.alpha > 0 or not 0 <= lora.dropout < 1:
        found.append(
            f"lora.rank must be >= 1, lora.alpha > 0 and lora.dropout in [0, 1), got {lora.rank}, "
            f"{lora.alpha}, {lora.dropout}"
        )
    if not lora.targets or lora.parts == []:
        found.append("lora.targets and lora.parts must name at least one module and part")
    if config.optimizer.name == "muon":
        found.append(
            "optimizer.name=muon with lora: LoRA's low-rank factors train with AdamW; set optimizer.name=adamw"
        )
    if config.distributed == "fsdp":
        found.append("lora with distributed=fsdp: LoRA's merge needs whole matrices; use distributed=ddp")
    both = [part for part in config.model.trainable or [] if part in (lora.parts or LAYER_PARTS)]
    if both:
        found.append(
            f"model.trainable and lora.parts both name {both[0]!r}: a part trains fully or through LoRA, not both"
        )
    return found


def unknown_parts(key: str, names: list[str] | None, valid: tuple[str, ...]) -> list[str]:
    """One problem naming the first unknown part of `names` and the valid ones; none when all are known."""
    unknown = [name for name in names or [] if name not in valid]
    if not unknown:
        return []
    return [f"{key}: unknown part {unknown[0]!r}; the parts are {', '.join(valid)}"]


def _in_parent_order(*parts: list[int]) -> bool:
    indices = [i for part in parts for i in part]
    return all(a < b for a, b in itertools.pairwise(indices))
