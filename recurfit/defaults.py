"""recurfit's defaults and choices, each written once, for the library and the command line alike.

Each choice is a `Literal` type (what the training config's fields are annotated with) and the tuple of its
values derived from it (what the command line's `choices` and the checks use): the values are written once.

This module imports nothing heavy (no torch, no transformers), so `recurfit --help` can show them quickly.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

# Depth, as the paper trains: recurrences sampled around a mean r̄ = 32, backprop through the last k̄ = 8.
# r̄ is also a model's default test-time recurrence.
MEAN_RECURRENCE = 32
BACKPROP_DEPTH = 8
Curriculum = Literal["constant", "linear", "1-sqrt"]  # how r̄ (and k̄) ramp up over training
CURRICULA = get_args(Curriculum)
DepthDraw = Literal["step", "micro_batch"]  # one (n, k) per optimizer step, or per micro-batch (the authors' loop)
DEPTH_DRAWS = get_args(DepthDraw)
# With depth.draw: micro_batch, whether every process runs the same depths (one draw per micro-batch slot, its
# place in the process's share) or its own (seeded by the micro-batch's first row in the global batch, so that N
# processes draw the depths one does); auto: the same under FSDP2, whose collectives make every process wait for the
# deepest at each micro-batch (and by layer follow the depth), own under DDP
DrawAcross = Literal["auto", "same", "own"]
DRAWS_ACROSS = get_args(DrawAcross)
# How the paper's FLOPs accounting rounds a ramp's depth boundaries: floor, as the authors' param_counter.py;
# ceil, as its commented-out variant.
RampRounding = Literal["floor", "ceil"]
RAMP_ROUNDINGS = get_args(RampRounding)
# Depth supervision: each supervised depth alike, or the i-th of m (shallowest first) weighing i.
SuperviseWeighting = Literal["uniform", "linear"]
SUPERVISE_WEIGHTINGS = get_args(SuperviseWeighting)

# Surgery
DEFAULT_SHAPE = (4, 8, 4)  # (prelude, core, coda) layers: the paper's headline shape (TinyLlama 4,8,4)
Selection = Literal["paper", "shortgpt", "angular"]  # which parent layers a shape keeps
SELECTIONS = get_args(Selection)
Adapter = Literal["linear", "add"]
ADAPTERS = get_args(Adapter)
# identity: W = [0 | I], the pruned parent exactly (recurfit's default); torch-default: nn.Linear's own
# Kaiming-uniform, seeded, where the paper's conversions leave the adapter; random: N(0, initializer_range²).
AdapterInit = Literal["identity", "torch-default", "random"]
ADAPTER_INITS = get_args(AdapterInit)
ModelInit = Literal["pretrained", "random"]  # a retrofit's weights: the parent's, or the scaled random init
MODEL_INITS = get_args(ModelInit)
DEFAULT_STATE_INIT_STD = math.sqrt(2 / (5 * 5280))  # s_0's σ: Huginn-0125's, which the paper's models inherit

# Test-time recurrences that reports and sweeps show by default
SUMMARY_RECURRENCES = (1, 4, 32)
LOSS_RECURRENCES = (1, 2, 4, 8, 16, 32)
TASK_RECURRENCES = (1, 4, 32)

# Training
OptimizerName = Literal["muon", "adamw", "adamw*"]  # Muon (+AdamW), AdamW, or the paper authors' AdamW variant
OPTIMIZERS = get_args(OptimizerName)
MuonDtype = Literal["auto", "bfloat16", "float32"]  # Newton-Schulz's precision
MUON_DTYPES = get_args(MuonDtype)
DecayShape = Literal["cosine", "linear", "1-sqrt"]  # the LR schedule's decay
DECAY_SHAPES = get_args(DecayShape)
Precision = Literal["auto", "bf16", "fp32"]  # auto: bf16 (autocast, or a teacher's weights) on a GPU, fp32 on a CPU
PRECISIONS = get_args(Precision)
SnapshotDtype = Literal["float32", "bfloat16"]  # the weights of a run's snapshots
SNAPSHOT_DTYPES = get_args(SnapshotDtype)
# Whether training compiles each decoder layer: auto compiles on a GPU (recurfit.train.loop.compiles_training)
Compile = Literal["auto", True, False]
Strategy = Literal["ddp", "fsdp"]  # how several processes share a run
STRATEGIES = get_args(Strategy)
# FSDP2's units: the recurrent unit gathered once per micro-batch, or every layer gathered at each use (its
# weights and gradients never whole on a GPU)
FsdpUnits = Literal["recurrence", "layer"]
FSDP_UNITS = get_args(FsdpUnits)
NonfinitePolicy = Literal["skip", "apply"]  # what an update with a non-finite loss or gradient does
NONFINITE_POLICIES = get_args(NonfinitePolicy)
# What a run does when it would read a training store more than once: go on silently, go on and say so, or stop.
DataRepeat = Literal["allow", "warn", "refuse"]
DATA_REPEATS = get_args(DataRepeat)

# Generation
CachePolicy = Literal["all", "latest"]
CACHE_POLICIES = get_args(CachePolicy)
ExitCriterion = Literal["kl", "state", "argmax"]
EXIT_CRITERIA = get_args(ExitCriterion)
# `recurfit lens`: the exit rules it marks (one of each criterion; kl's and argmax's are `generate --exit`'s
# defaults) and the tokens of greedy continuation it reads after the prompt
LENS_EXIT_RULES = ("kl:5e-4", "state:0.01", "argmax:2")
LENS_NEW_TOKENS = 16
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES = get_args(Dtype)

# Serving (recurfit.serving): the deepest recurrence a request may ask for when a server is given none
# (`max_recurrence`), as a multiple of r̄; and a chat request's `reasoning_effort` → its recurrence.
MAX_RECURRENCE_FACTOR = 2


def depth_for_effort(mean_recurrence: int, max_recurrence: int | None = None) -> dict[str, int]:
    """The default `depth_for_effort` table of a model of mean recurrence r̄ served up to `max_recurrence`
    (default MAX_RECURRENCE_FACTOR × r̄): low r̄ // 2 (at least 1), medium r̄, high max_recurrence. What
    `recurfit train` writes into a model's config, and what a server uses for a config without one."""
    if max_recurrence is None:
        max_recurrence = MAX_RECURRENCE_FACTOR * mean_recurrence
    return {"low": max(1, mean_recurrence // 2), "medium": mean_recurrence, "high": max_recurrence}


# Data preparation (`data prepare`; recurfit/data/packing.py and shards.py say more)
# The tokenizer's special tokens (its BOS) + document + EOS, as the authors; or + EOS
Packing = Literal["bos-eos", "eos"]
PACKINGS = get_args(Packing)
DEFAULT_PACKING = "bos-eos"
# Decontamination: the evaluation sets recurfit runs offline, whose test and validation items no training
# document may share an n-gram with (data/decontaminate/); every `data prepare` checks all of them by default.
EVAL_SETS = ("gsm8k", "math", "arc_easy", "arc_challenge", "openbookqa", "hellaswag", "mmlu", "piqa", "social_iqa")
EVAL_SETS += ("winogrande", "lambada")
DECONTAMINATE = "all"
SHARD_DOCUMENTS = 1 << 17  # ≈ 130 M tokens of FineWeb-Edu: the unit of resume and of --task
BLOCK_DOCUMENTS = 1024  # what one worker tokenises at a time; a --max-tokens budget stops at a block's end

# The model parts `model.trainable` and `lora.parts` name. The final norm goes with the last layers (a recurrent
# model's coda, a baseline's layers): it reads their output, and an adapter- or core-only phase keeps it as it is.
RECURRENT_PARTS = ("embeddings", "prelude", "adapter", "core", "coda", "head")
BASELINE_PARTS = ("embeddings", "layers", "head")
TRAINABLE_PARTS = (*RECURRENT_PARTS, "layers")
LAYER_PARTS = ("prelude", "core", "coda", "layers")  # the parts made of decoder layers, where LoRA applies
