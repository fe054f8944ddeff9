"""The training config's schema: its sections as dataclasses, each key with its type, default and meaning.

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

Unknown keys and bad values are errors that name the key and what it accepts (`binder.py`); the rules between
values are `validation.py`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import yaml

from ...defaults import (
    BACKPROP_DEPTH,
    MEAN_RECURRENCE,
    Adapter,
    AdapterInit,
    Compile,
    Curriculum,
    DataRepeat,
    DecayShape,
    DepthDraw,
    DrawAcross,
    FsdpUnits,
    ModelInit,
    MuonDtype,
    NonfinitePolicy,
    OptimizerName,
    Precision,
    RampRounding,
    Selection,
    SnapshotDtype,
    Strategy,
    SuperviseWeighting,
)
from .binder import to_plain
from .validation import validate


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
    select: Selection = "paper"
    prune_to: int | None = None  # a non-recurrent baseline: keep this many parent layers (select: shortgpt)
    calibration: str | None = None  # a token store whose first validation rows ShortGPT scores layers on
    calibration_rows: int = 16
    init: ModelInit = "pretrained"  # random: the scaled (Takase/Huginn) init of the shape
    # Token embeddings are multiplied by this in the forward (Huginn's `emb_scale`; the random-init ablation).
    embedding_scale: float | None = None
    untie_embeddings: bool = False  # give a tied parent its own output matrix (the paper's Llama baseline)
    adapter: Adapter = "linear"
    # How a retrofit starts its linear adapter: [0 | I] (the pruned parent), or nn.Linear's default draw
    # (`torch-default`, where the paper's runs started), seeded by the run's seed.
    adapter_init: AdapterInit = "identity"
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


# The parts `model.trainable` and `lora.parts` name. The final norm goes with the last layers (a recurrent


@dataclass
class SourceWeight:
    shorthand: ClassVar[str] = "path"  # in YAML, a bare string is a source of weight 1

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
    repeat: DataRepeat = "warn"  # a store the run reads more than once (a second pass over its rows)
    # The loss over the assistant's tokens only (stores of conversations, `data prepare` of a `messages` field);
    # off: every token, as plain text trains
    assistant_only_loss: bool = False


@dataclass
class SuperviseConfig:
    """Depth supervision: the loss read out after each of the last `last` recurrences with gradient (all k of
    the step when None, at most k), weighted by `weighting`, instead of after the final recurrence alone."""

    last: int | None = None
    # uniform: each supervised depth alike; linear: the i-th of m supervised depths (shallowest first) weighs i
    weighting: SuperviseWeighting = "uniform"


@dataclass
class DepthConfig:
    mean_recurrence: int = MEAN_RECURRENCE
    backprop_depth: int = BACKPROP_DEPTH
    curriculum: Curriculum = "constant"
    curriculum_fraction: float = 0.75  # of all steps, for the mean-recurrence ramp
    # k̄ ramps from 1, as the paper authors' scheduler (their default ramp: the first 10% of steps).
    backprop_curriculum: Curriculum = "constant"
    backprop_curriculum_fraction: float = 0.1
    fixed: bool = False  # every step runs exactly (mean - k, k): no sampling
    # step: one (n, k) per optimizer step; micro_batch: one per micro-batch, as the paper authors' loop
    draw: DepthDraw = "step"
    # With draw: micro_batch, the same depths on every process (same) or each its own (own: N processes then draw
    # the depths one does, each waiting at every FSDP2 micro-batch for the deepest); auto: same under FSDP2, own
    # under DDP
    across_processes: DrawAcross = "auto"
    # How `flops_paper` rounds the ramp's depth boundaries (accounting.paper_ramp): floor, as the authors'
    # param_counter.py; ceil, as its commented-out variant, which counted their loop_whole_model runs.
    paper_ramp_rounding: RampRounding = "floor"
    supervise: SuperviseConfig | None = None  # None: the loss at the final recurrence only


@dataclass
class OptimizerConfig:
    name: OptimizerName = "muon"
    lr: float = 5e-5  # AdamW's (under muon: embeddings, head, norms, biases)
    muon_lr: float = 1e-3
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    muon_momentum: float = 0.95
    # Orthogonalise each attention's q,k,v and each MLP's gate,up as one matrix (the authors' fused Wqkv, fc).
    muon_fused: bool = False
    # Newton-Schulz precision. auto: bfloat16 on GPUs and CPUs with native bf16 matmul, float32 on other CPUs
    # (torch's Muon always uses bfloat16, which such CPUs emulate ~50-100x slower).
    muon_dtype: MuonDtype = "auto"
    eps: float | None = None  # AdamW's ε; None: 1e-10 under muon (Keller's aux Adam), 1e-8 under adamw
    grad_clip: float = 1.0  # 0: no clipping
    # transformers' warmup-stable-decay. warmup/decay: a fraction of the steps (ceil(fraction · steps)),
    # or a step count if >= 1; decay 0: constant LR after warmup.
    warmup: float = 0.1
    decay: float = 0.1
    decay_shape: DecayShape = "cosine"
    min_lr_ratio: float = 0.001  # warmup starts and decay ends at min_lr_ratio · lr

    def schedule_steps(self, steps: int) -> tuple[int, int]:
        """(warmup steps, decay steps) of a run of `steps`: ceil(fraction · steps), or the count itself."""
        warmup, decay = (int(v) if v >= 1 else math.ceil(v * steps) for v in (self.warmup, self.decay))
        if self.decay < 1:  # rounding two fractions up can overrun a very short run: the decay gives way
            decay = min(decay, max(steps - warmup, 0))
        return warmup, decay


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
    dtype: Precision = "auto"

    def source(self, model: ModelConfig) -> tuple[str | None, str | None]:
        """(what to load, its revision): the teacher, or the run's parent."""
        return (self.teacher, self.revision) if self.teacher is not None else (model.path, model.revision)


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT's `LoraConfig`) on the linear layers named `targets` in the decoder layers of `parts`."""

    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])  # the layers' linear modules
    parts: list[str] | None = None  # prelude, core, coda (a baseline: layers); None: every layer part


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
    dtype: SnapshotDtype = "float32"


@dataclass
class LogConfig:
    every: int = 1
    tensorboard: bool = False
    wandb: str | None = None  # project name
    progress: bool = True


@dataclass
class EvalConfig:
    every: int = 0  # steps; 0: only at the end
    at: list[int] = field(default_factory=list)  # also after these optimizer steps (a phase's end, say)
    steps: list[int] = field(default_factory=lambda: [1, 4, 8])  # test recurrences
    rows: int = 16  # validation rows per store
    # None: as training runs (`precision`); fp32: without autocast, as the paper authors' multi_recurence_eval.py
    precision: Precision | None = None

    def due(self, step: int) -> bool:
        """Whether validation runs after optimizer step `step` (before the end, which always validates)."""
        return bool(self.every and step % self.every == 0) or step in self.at


@dataclass
class TrainConfig:
    out: str
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    depth: DepthConfig = field(default_factory=DepthConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    distill: DistillConfig | None = None  # None: no distillation
    lora: LoraConfig | None = None  # None: no LoRA
    batch: BatchConfig = field(default_factory=BatchConfig)
    steps: int = 100
    # End this run after this optimizer step (None: at `steps`), its schedules still those of `steps`: the first
    # part of a run that another run continues (model.continue_schedule).
    stop_at: int | None = None
    precision: Precision = "auto"  # auto: bf16 autocast on GPUs and CPUs with native bf16 matmul, fp32 on other CPUs
    compile: Compile = False  # auto: compiled on a GPU, eager on a CPU (recurfit.train.loop.compiles_training)
    distributed: Strategy = "ddp"
    # FSDP2's units (distributed: fsdp): recurrence gathers the adapter, core and coda once per micro-batch (its
    # weights and gradients are whole on every GPU then); layer gathers each layer at each use, so no GPU holds
    # more than two layers' weights whole (the core's gradients still are, through its backward), at the cost of
    # gathering the core once per recurrence (its collectives then follow the depth: depth.across_processes: own is
    # refused)
    fsdp_units: FsdpUnits = "recurrence"
    # Processes that share one sharded copy of the model (distributed: fsdp). Groups of this many shard it, and the
    # groups all-reduce their gradients (HSDP: gathers within a node, gradients across nodes). null: the processes of
    # a node (torchrun's --nproc-per-node), so one node shards over all its processes and several nodes run HSDP.
    fsdp_shard_size: int | None = None
    # Seconds a process waits in a collective before the run fails. Each process writes its own shards of a
    # checkpoint, so the longest wait is the final model, gathered and written by the main process alone (a 14B
    # model's 56 GB of fp32 weights: minutes on a network disk); on --resume the processes share the hashing.
    distributed_timeout: int = 900
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    snapshots: SnapshotConfig = field(default_factory=SnapshotConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0
    max_bad_steps: int = 5  # non-finite losses in a row before the run stops
    # skip: a non-finite loss or gradient skips the update (max_bad_steps in a row stop the run); apply: every
    # update is applied, as the paper authors' loop did (their AdamW run diverges in Fig. 4), and nothing stops
    nonfinite: NonfinitePolicy = "skip"

    def validate(self) -> TrainConfig:
        """This config, or a RecurfitError listing every problem it has (`validation.py`)."""
        return validate(self)

    @property
    def end(self) -> int:
        """The optimizer step this run ends at: `stop_at`, or the end of its schedule."""
        return self.stop_at if self.stop_at is not None else self.steps

    def to_dict(self) -> dict:
        return to_plain(self)

    def to_yaml(self) -> str:
        """The config as run (the file, the overrides and every default), as `OUT/config.yaml` holds it."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
