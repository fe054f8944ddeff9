"""The training config: one YAML file, validated against these dataclasses, plus `key.sub=value` overrides.

    model:       what to train (a saved model, a parent retrofitted on the fly, or random init of a shape),
                 and which of its parts train (`model.trainable`; the rest is frozen and gets no optimizer state)
    data:        phases of weighted token stores, and validation stores
    depth:       mean recurrence and backprop depth, their curricula; `depth.supervise`: the loss at several
                 recurrences of one forward (depth supervision)
    optimizer:   muon (+AdamW) | adamw | adamw*; the LR schedule
    distill:     distillation from the parent (absent or null: off): loss = alpha·CE + (1 - alpha)·T²·KL(teacher_T ‖
                 student_T) over next-token distributions; the teacher runs forward only and is never saved
    lora:        LoRA adapters (PEFT) on some parts' linear layers, trained with AdamW and merged into `final/`
    batch, steps, precision, compile, distributed, checkpoint, log, eval, seed, out
    snapshots:   loadable models every N steps, for evaluation over training

Unknown keys and bad values are errors that name the key and what it accepts.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import itertools
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from ..defaults import BACKPROP_DEPTH, MEAN_RECURRENCE
from ..errors import RecurfitError


@dataclass
class ModelConfig:
    path: str | None = None  # folder or Hub id; None: the embedded SmolLM2-135M
    revision: str | None = None  # of a Hub `path`: a branch, tag or commit (OLMo's intermediate checkpoints)
    # A finished run's folder: start from its `final` weights (phase 2 of a two-phase run, a cooldown).
    init_from: str | None = None
    # With init_from: also continue that run's optimizer state and data position (its last checkpoint), as a
    # cooldown resumes a run; the LR schedule and the step count start afresh.
    carry_state: bool = False
    # With init_from: continue that run as one run (it stopped early, `stop_at`): its step count, LR schedule,
    # curricula, depth draws and data position go on where it stopped, `steps` being the whole schedule's length,
    # and the optimizer state of what trained in both runs carries over (implies carry_state; the trained parts
    # may differ: parameters new here start afresh).
    continue_schedule: bool = False
    shape: list[int] | None = None  # [P, R, C]: retrofit `path` with the paper's layer rule
    # Or the parent's layer indices for each part (the paper's layer-choice ablations), instead of `shape`.
    prelude: list[int] | None = None
    core: list[int] | None = None
    coda: list[int] | None = None
    # How `shape` (or `prune_to`) picks layers: the paper's rule, ShortGPT's Block Influence on `calibration`, or
    # the angular distance's knees on `calibration` (which also choose the shape when `shape` is left out).
    select: Literal["paper", "shortgpt", "angular"] = "paper"
    prune_to: int | None = None  # a non-recurrent baseline: keep this many parent layers (select: shortgpt)
    calibration: str | None = None  # a token store whose first validation rows ShortGPT scores layers on
    calibration_rows: int = 16
    init: Literal["pretrained", "random"] = "pretrained"  # random: the scaled (Takase/Huginn) init of the shape
    # Token embeddings are multiplied by this in the forward (Huginn's `emb_scale`; the random-init ablation).
    embedding_scale: float | None = None
    untie_embeddings: bool = False  # give a tied parent its own output matrix (the paper's Llama baseline)
    adapter: Literal["linear", "add"] = "linear"
    # How a retrofit starts its linear adapter: [0 | I] (the pruned parent), or nn.Linear's default draw
    # (`torch-default`, where the paper's runs started), seeded by the run's seed.
    adapter_init: Literal["identity", "torch-default", "random"] = "identity"
    state_init_std: float | None = None  # None: keep the model's
    gradient_checkpointing: bool = False
    # The parts that train (see TRAINABLE_PARTS): a recurrent model's embeddings, prelude, adapter, core, coda
    # (with the final norm) and head; a non-recurrent baseline's embeddings, layers (with the final norm) and head.
    # None: every part, or with `lora:` none but the LoRA matrices. The others are frozen, with no optimizer state.
    trainable: list[str] | None = None

    @property
    def source(self) -> str | None:
        """What to load: the chained run's final model, or `path`."""
        return str(Path(self.init_from) / "final") if self.init_from else self.path

    def problems(self) -> list[str]:
        problems = []
        explicit = [self.prelude, self.core, self.coda]
        retrofits = self.shape is not None or any(part is not None for part in explicit)
        if self.shape is not None and (len(self.shape) != 3 or min(self.shape) < 0 or self.shape[1] < 1):
            problems.append(f"model.shape must be [P, R, C] with R >= 1, got {self.shape}")
        if any(part is not None for part in explicit):
            if self.shape is not None:
                problems.append("give model.shape or model.prelude/core/coda, not both")
            elif self.core is None or None in explicit[::2]:
                problems.append("model.prelude, model.core and model.coda go together (an empty list is allowed)")
            elif not _in_parent_order(self.prelude, self.core, self.coda):
                problems.append(
                    f"model.prelude {self.prelude}, core {self.core} and coda {self.coda} must run in parent order: "
                    "every prelude layer before every core layer, every core layer before every coda layer"
                )
        if self.init_from is not None:
            if self.path is not None or self.revision is not None:
                problems.append("model.init_from continues a run's final model; drop model.path and model.revision")
            if retrofits or self.prune_to is not None or self.init == "random":
                problems.append(
                    "model.init_from continues a run's final model as it is; drop model.shape/prelude/core/coda, "
                    "model.prune_to and model.init=random"
                )
        if self.carry_state and self.init_from is None:
            problems.append("model.carry_state carries a finished run's state: set model.init_from to that run")
        if self.continue_schedule and self.init_from is None:
            problems.append("model.continue_schedule continues a run: set model.init_from to that run")
        if self.prune_to is not None:
            if retrofits:
                problems.append("model.prune_to makes a non-recurrent baseline; drop model.shape/prelude/core/coda")
            if self.prune_to < 1:
                problems.append(f"model.prune_to must be >= 1 layer, got {self.prune_to}")
            if self.select != "shortgpt":
                problems.append("model.prune_to picks layers by ShortGPT's Block Influence: set model.select=shortgpt")
        if self.select != "paper" and self.calibration is None:
            problems.append(f"model.select={self.select} scores layers on text: set model.calibration to a token store")
        if self.select == "shortgpt":
            if self.shape is None and self.prune_to is None:
                problems.append("model.select=shortgpt needs model.shape (a retrofit) or model.prune_to (a baseline)")
        if self.select == "angular" and any(part is not None for part in explicit):
            problems.append("model.select=angular chooses the layers; drop model.prelude/core/coda (or the select)")
        if self.embedding_scale is not None and not self.embedding_scale > 0:
            problems.append(f"model.embedding_scale must be > 0, got {self.embedding_scale}")
        if self.calibration_rows < 1:
            problems.append("model.calibration_rows must be >= 1")
        if self.state_init_std is not None and not self.state_init_std >= 0:
            problems.append(f"model.state_init_std must be >= 0 (0: a zero initial state), got {self.state_init_std}")
        problems += unknown_parts("model.trainable", self.trainable, TRAINABLE_PARTS)
        return problems


# The parts `model.trainable` and `lora.parts` name. The final norm goes with the last layers (a recurrent
# model's coda, a baseline's layers): it reads their output, and an adapter- or core-only phase keeps it as it is.
RECURRENT_PARTS = ("embeddings", "prelude", "adapter", "core", "coda", "head")
BASELINE_PARTS = ("embeddings", "layers", "head")
TRAINABLE_PARTS = (*RECURRENT_PARTS, "layers")
LAYER_PARTS = ("prelude", "core", "coda", "layers")  # the parts made of decoder layers, where LoRA applies


def unknown_parts(key: str, names: list[str] | None, valid: tuple[str, ...]) -> list[str]:
    """One problem naming the first unknown part of `names` and the valid ones; none when all are known."""
    unknown = [name for name in names or [] if name not in valid]
    if not unknown:
        return []
    return [f"{key}: unknown part {unknown[0]!r}; the parts are {', '.join(valid)}"]


def _in_parent_order(*parts: list[int]) -> bool:
    indices = [i for part in parts for i in part]
    return all(a < b for a, b in itertools.pairwise(indices))


@dataclass
class SourceWeight:
    path: str
    weight: float = 1.0


@dataclass
class PhaseConfig:
    sources: list[SourceWeight]
    tokens: int | None = None  # budget for this phase; None on the last phase: until the end


@dataclass
class DataConfig:
    phases: list[PhaseConfig] = field(default_factory=list)
    validation: list[str] = field(default_factory=list)  # stores whose `val` split is evaluated


@dataclass
class SuperviseConfig:
    """Depth supervision: the loss read out after each of the last `last` recurrences with gradient (all k of
    the step when None, at most k), weighted by `weighting`, instead of after the final recurrence alone."""

    last: int | None = None
    # uniform: each supervised depth alike; linear: the i-th of m supervised depths (shallowest first) weighs i
    weighting: Literal["uniform", "linear"] = "uniform"

    def problems(self) -> list[str]:
        if self.last is not None and self.last < 1:
            return [f"depth.supervise.last must be >= 1 recurrence (null: every one with gradient), got {self.last}"]
        return []


@dataclass
class DepthConfig:
    mean_recurrence: int = MEAN_RECURRENCE
    backprop_depth: int = BACKPROP_DEPTH
    curriculum: Literal["constant", "linear", "1-sqrt"] = "constant"
    curriculum_fraction: float = 0.75  # of all steps, for the mean-recurrence ramp
    # k̄ ramps from 1, as the paper authors' scheduler (their default ramp: the first 10% of steps).
    backprop_curriculum: Literal["constant", "linear", "1-sqrt"] = "constant"
    backprop_curriculum_fraction: float = 0.1
    fixed: bool = False  # every step runs exactly (mean - k, k): no sampling
    # step: one (n, k) per optimizer step; micro_batch: one per micro-batch, as the paper authors' loop
    draw: Literal["step", "micro_batch"] = "step"
    # How `flops_paper` rounds the ramp's depth boundaries (accounting.paper_ramp): floor, as the authors'
    # param_counter.py; ceil, as its commented-out variant, which counted their loop_whole_model runs.
    paper_ramp_rounding: Literal["floor", "ceil"] = "floor"
    supervise: SuperviseConfig | None = None  # None: the loss at the final recurrence only


@dataclass
class OptimizerConfig:
    name: Literal["muon", "adamw", "adamw*"] = "muon"
    lr: float = 5e-5  # AdamW's (under muon: embeddings, head, norms, biases)
    muon_lr: float = 1e-3
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    muon_momentum: float = 0.95
    # Orthogonalise each attention's q,k,v and each MLP's gate,up as one matrix (the authors' fused Wqkv, fc).
    muon_fused: bool = False
    # Newton-Schulz precision. auto: bfloat16 on GPUs and CPUs with native bf16 matmul, float32 on other CPUs
    # (torch's Muon always uses bfloat16, which such CPUs emulate ~50-100x slower).
    muon_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    eps: float | None = None  # AdamW's ε; None: 1e-10 under muon (Keller's aux Adam), 1e-8 under adamw
    grad_clip: float = 1.0  # 0: no clipping
    # transformers' warmup-stable-decay. warmup/decay: a fraction of the steps (ceil(fraction · steps)),
    # or a step count if >= 1; decay 0: constant LR after warmup.
    warmup: float = 0.1
    decay: float = 0.1
    decay_shape: Literal["cosine", "linear", "1-sqrt"] = "cosine"
    min_lr_ratio: float = 0.001  # warmup starts and decay ends at min_lr_ratio · lr

    def schedule_steps(self, steps: int) -> tuple[int, int]:
        """(warmup steps, decay steps) of a run of `steps`: ceil(fraction · steps), or the count itself."""
        warmup, decay = (int(v) if v >= 1 else math.ceil(v * steps) for v in (self.warmup, self.decay))
        if self.decay < 1:  # rounding two fractions up can overrun a very short run: the decay gives way
            decay = min(decay, max(steps - warmup, 0))
        return warmup, decay

    def problems(self, steps: int) -> list[str]:
        found = []
        for name in ("warmup", "decay"):
            value = getattr(self, name)
            if value < 0 or (value >= 1 and not float(value).is_integer()):
                found.append(
                    f"optimizer.{name} must be a fraction of the steps in [0, 1) or a whole step count, got {value}"
                )
        if not 0 <= self.min_lr_ratio <= 1:
            found.append(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.eps is not None and self.eps <= 0:
            found.append(f"optimizer.eps must be > 0, got {self.eps}")
        for name in ("lr", "muon_lr"):
            if not getattr(self, name) > 0:
                found.append(f"optimizer.{name} must be > 0, got {getattr(self, name)}")
        if not self.weight_decay >= 0 or not self.grad_clip >= 0:
            found.append("optimizer.weight_decay and optimizer.grad_clip must be >= 0 (grad_clip 0: no clipping)")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas) or not 0 <= self.muon_momentum < 1:
            found.append(f"optimizer.betas must be two values in [0, 1) and muon_momentum one, got {self.betas}")
        if not found and self.warmup < 1 and self.decay < 1 and self.warmup + self.decay > 1:
            found.append(
                f"optimizer.warmup ({self.warmup}) + optimizer.decay ({self.decay}) are more than the whole run"
            )
        elif not found and steps >= 1:
            warmup, decay = self.schedule_steps(steps)
            if warmup + decay > steps:
                found.append(
                    f"optimizer.warmup ({warmup} steps) + optimizer.decay ({decay} steps) are longer than the run "
                    f"(steps: {steps}); shorten them"
                )
        return found


@dataclass
class DistillConfig:
    """Distillation from a teacher (by default the run's parent): loss = alpha·CE + (1 - alpha)·T²·KL(teacher_T ‖
    student_T), KL between the next-token distributions at temperature T, averaged over tokens."""

    teacher: str | None = None  # folder or Hub id; None: the run's parent (`model.path`, at `model.revision`)
    revision: str | None = None  # of a Hub `teacher`
    alpha: float = 0.5  # the weight of the cross-entropy; 1 - alpha weighs the KL
    temperature: float = 2.0
    # The teacher's weights. auto: bfloat16 on a GPU (half the memory of float32; it only runs forward, under the
    # run's autocast), float32 on a CPU.
    dtype: Literal["auto", "bf16", "fp32"] = "auto"

    def problems(self, model: ModelConfig) -> list[str]:
        found = []
        if not 0 <= self.alpha <= 1:
            found.append(f"distill.alpha must be in [0, 1] (the weight of the cross-entropy), got {self.alpha}")
        if not self.temperature > 0:
            found.append(f"distill.temperature must be > 0, got {self.temperature}")
        if self.teacher is None and model.init_from is not None:
            found.append(
                "distill.teacher defaults to model.path, which a run from model.init_from has not: set "
                "distill.teacher to the parent to distil from (a folder or Hub id)"
            )
        if self.revision is not None and self.teacher is None:
            found.append(
                "distill.revision pins a Hub distill.teacher: set distill.teacher (the parent's is model.revision)"
            )
        return found

    def source(self, model: ModelConfig) -> tuple[str | None, str | None]:
        """(what to load, its revision): the teacher, or the run's parent."""
        return (self.teacher, self.revision) if self.teacher is not None else (model.path, model.revision)


@dataclass
class LoraSettings:
    """LoRA adapters (PEFT's `LoraConfig`) on the linear layers named `targets` in the decoder layers of `parts`."""

    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])  # the layers' linear modules
    parts: list[str] | None = None  # prelude, core, coda (a baseline: layers); None: every layer part

    def problems(self, config: TrainConfig) -> list[str]:
        found = unknown_parts("lora.parts", self.parts, LAYER_PARTS)
        if self.rank < 1 or not self.alpha > 0 or not 0 <= self.dropout < 1:
            found.append(
                f"lora.rank must be >= 1, lora.alpha > 0 and lora.dropout in [0, 1), got {self.rank}, "
                f"{self.alpha}, {self.dropout}"
            )
        if not self.targets or self.parts == []:
            found.append("lora.targets and lora.parts must name at least one module and part")
        if config.optimizer.name == "muon":
            found.append(
                "optimizer.name=muon with lora: LoRA's low-rank factors train with AdamW; set optimizer.name=adamw"
            )
        if config.distributed == "fsdp":
            found.append("lora with distributed=fsdp: LoRA's merge needs whole matrices; use distributed=ddp")
        both = [part for part in config.model.trainable or [] if part in (self.parts or LAYER_PARTS)]
        if both:
            found.append(
                f"model.trainable and lora.parts both name {both[0]!r}: a part trains fully or through LoRA, not both"
            )
        return found


@dataclass
class BatchConfig:
    micro: int = 8  # rows per forward on each process
    global_: int = 64  # rows per optimizer step, over all processes (YAML key: global)


@dataclass
class CheckpointConfig:
    every: int = 100  # steps; 0: only at the end
    keep: int = 2


@dataclass
class SnapshotConfig:
    # Save a loadable model (weights, config, tokenizer; no optimizer state) every N steps into OUT/snapshots,
    # all kept, for evaluation over training (`recurfit eval tasks OUT`); 0: none. Step 0 is the model before
    # training. Independent of the few resumable checkpoints.
    every: int = 0
    # bfloat16 halves their disk (evaluation runs in bf16 on a GPU anyway); checkpoints stay float32 for resume
    dtype: Literal["float32", "bfloat16"] = "float32"


@dataclass
class LogConfig:
    every: int = 1
    tensorboard: bool = False
    wandb: str | None = None  # project name
    progress: bool = True


@dataclass
class EvalConfig:
    every: int = 0  # steps; 0: only at the end
    steps: list[int] = field(default_factory=lambda: [1, 4, 8])  # test recurrences
    rows: int = 16  # validation rows per store
    # None: as training runs (`precision`); fp32: without autocast, as the paper authors' multi_recurence_eval.py
    precision: Literal["auto", "bf16", "fp32"] | None = None


@dataclass
class TrainConfig:
    out: str
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    depth: DepthConfig = field(default_factory=DepthConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    distill: DistillConfig | None = None  # None: no distillation
    lora: LoraSettings | None = None  # None: no LoRA
    batch: BatchConfig = field(default_factory=BatchConfig)
    steps: int = 100
    # End this run after this optimizer step (None: at `steps`), its schedules still those of `steps`: the first
    # part of a run that another run continues (model.continue_schedule).
    stop_at: int | None = None
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    compile: bool = False
    distributed: Literal["ddp", "fsdp"] = "ddp"
    # Seconds a process waits in a collective before the run fails. One hour: the other processes wait while the
    # main one writes a checkpoint (~12 GB for a 1B model with Muon and AdamW state: minutes on a network disk) or
    # the final model; NCCL's own default, 10 minutes, would kill such a run at its first checkpoint.
    distributed_timeout: int = 3600
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    snapshots: SnapshotConfig = field(default_factory=SnapshotConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0
    max_bad_steps: int = 5  # non-finite losses in a row before the run stops
    # skip: a non-finite loss or gradient skips the update (max_bad_steps in a row stop the run); apply: every
    # update is applied, as the paper authors' loop did (their AdamW run diverges in Fig. 4), and nothing stops
    nonfinite: Literal["skip", "apply"] = "skip"

    def validate(self) -> TrainConfig:
        problems = []
        if self.steps < 1:
            problems.append("steps must be >= 1")
        elif self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            problems.append(f"stop_at must be a step from 1 to steps ({self.steps}), got {self.stop_at}")
        if self.batch.micro < 1 or self.batch.global_ < self.batch.micro:
            problems.append("batch.micro must be >= 1 and batch.global >= batch.micro")
        elif self.batch.global_ % self.batch.micro:
            problems.append(
                f"batch.global ({self.batch.global_}) must be a multiple of batch.micro ({self.batch.micro})"
            )
        problems += self.model.problems()
        if self.depth.mean_recurrence < 1 or self.depth.backprop_depth < 1:
            problems.append("depth.mean_recurrence and depth.backprop_depth must be >= 1")
        if not self.data.phases:
            problems.append("data.phases needs at least one phase with sources")
        for number, phase in enumerate(self.data.phases):
            if not phase.sources:
                problems.append(f"data.phases[{number}] has no sources")
            if any(s.weight <= 0 for s in phase.sources):
                problems.append(f"data.phases[{number}]: source weights must be positive")
            if phase.tokens is None and number != len(self.data.phases) - 1:
                problems.append(f"data.phases[{number}] needs a token budget (only the last phase may omit it)")
            if phase.tokens is not None and phase.tokens < 1:
                problems.append(f"data.phases[{number}].tokens must be >= 1, got {phase.tokens}")
        if min(self.eval.steps, default=1) < 1:
            problems.append("eval.steps must be recurrences >= 1")
        if self.checkpoint.keep < 1:
            problems.append("checkpoint.keep must be >= 1")
        for name, value, least in (
            ("checkpoint.every", self.checkpoint.every, 0),
            ("snapshots.every", self.snapshots.every, 0),
            ("eval.every", self.eval.every, 0),
            ("log.every", self.log.every, 1),
            ("eval.rows", self.eval.rows, 1),
            ("max_bad_steps", self.max_bad_steps, 1),
            ("distributed_timeout", self.distributed_timeout, 1),
        ):
            if value < least:
                problems.append(f"{name} must be >= {least}, got {value}")
        for name in ("curriculum_fraction", "backprop_curriculum_fraction"):
            if not 0 <= getattr(self.depth, name) <= 1:
                problems.append(f"depth.{name} must be in [0, 1]")
        problems += self.optimizer.problems(self.steps)
        if self.depth.supervise is not None:
            problems += self.depth.supervise.problems()
        if self.distill is not None:
            problems += self.distill.problems(self.model)
        if self.lora is not None:
            problems += self.lora.problems(self)
        elif self.model.trainable == []:
            problems.append("model.trainable is empty: name the parts to train (or leave it out to train all)")
        if problems:
            raise RecurfitError("Invalid training config: " + "; ".join(problems) + ".")
        return self

    @property
    def end(self) -> int:
        """The optimizer step this run ends at: `stop_at`, or the end of its schedule."""
        return self.stop_at if self.stop_at is not None else self.steps

    def to_dict(self) -> dict:
        return _to_plain(self)

    def to_yaml(self) -> str:
        """The config as run (the file, the overrides and every default), as `OUT/config.yaml` holds it."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: list[str] = (), base: dict | None = None) -> TrainConfig:
    """Read a YAML config (or start from `base`), apply `a.b=value` overrides, validate."""
    raw: dict = copy.deepcopy(base or {})
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecurfitError(f"Config file not found: {path}.")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as problem:
            raise RecurfitError(f"{path} is not valid YAML: {problem}") from None
        if not isinstance(raw, dict):
            raise RecurfitError(f"{path} must hold a mapping of config keys.")
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise RecurfitError(f"Overrides look like key.sub=value, got {override!r}.")
        target = raw
        *parents, last = key.split(".")
        for part in parents:
            target = _override_slot(target, part, override, descend=True)
        _override_slot(target, last, override, descend=False)
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as problem:
            reason = getattr(problem, "problem", None) or "not YAML"
            raise RecurfitError(
                f"Override {override!r}: {value!r} is not a YAML value ({reason}); write lists as [1, 2] and quote "
                "text that holds YAML syntax."
            ) from None
        if isinstance(target, list):
            target[int(last)] = parsed
        else:
            target[last] = parsed
    return _build(TrainConfig, raw, "").validate()


def _override_slot(target, part: str, override: str, descend: bool):
    """The section (or list item: `data.phases.1` is the second phase) an override's `part` names; with
    `descend`, a missing section is created."""
    if isinstance(target, list):
        if not part.isdigit() or int(part) >= len(target):
            raise RecurfitError(
                f"Override {override!r}: {part!r} is not an item of a list of {len(target)} (items count from 0)."
            )
        return target[int(part)] if descend else None
    if not isinstance(target, dict):
        raise RecurfitError(f"Override {override!r}: the value before {part!r} is not a section.")
    return target.setdefault(part, {}) if descend else None


def _yaml_name(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")  # `global_` is `global` in YAML


def _build(cls, raw, where: str):
    if not isinstance(raw, dict):
        raise RecurfitError(f"{where or 'the config'} must be a mapping, got {raw!r}.")
    fields = {_yaml_name(f): f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        key = sorted(unknown)[0]
        hint = difflib.get_close_matches(key, fields, n=1)
        raise RecurfitError(
            f"Unknown config key {where + key!r}"
            + (
                f"; did you mean {where + hint[0]!r}?"
                if hint
                else f"; {where or 'top level'} accepts {sorted(fields)}."
            )
        )
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in fields.items():
        if name in raw:
            values[f.name] = _convert(hints[f.name], raw[name], where + name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecurfitError(f"The config needs {where + name!r}.")
    return cls(**values)


def _convert(kind, value, where: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kind = next(a for a in args if a is not type(None))
        return _convert(kind, value, where)
    if dataclasses.is_dataclass(kind):
        if kind is SourceWeight and isinstance(value, str):
            value = {"path": value}
        return _build(kind, value, where + ".")
    if origin is Literal:
        if value not in args:
            raise RecurfitError(f"{where} must be one of {list(args)}, got {value!r}.")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise RecurfitError(f"{where} must be a list, got {value!r}.")
        return [_convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads 1e-3 as a string
        except ValueError:
            pass
    if kind in (int, str, bool) and type(value) is kind:
        return value
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    raise RecurfitError(f"{where} must be {kind.__name__}, got {value!r}.")


def _to_plain(value):
    if dataclasses.is_dataclass(value):
        return {_yaml_name(f): _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    return value
