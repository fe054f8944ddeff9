"""recurfit's defaults and choices, each written once, for the library and the command line alike.

This module imports nothing heavy (no torch, no transformers), so `recurfit --help` can show them quickly.
"""

from __future__ import annotations

import math

# Depth, as the paper trains: recurrences sampled around a mean r̄ = 32, backprop through the last k̄ = 8.
# r̄ is also a model's default test-time recurrence.
MEAN_RECURRENCE = 32
BACKPROP_DEPTH = 8
CURRICULA = ("constant", "linear", "1-sqrt")  # how r̄ (and k̄) ramp up over training

# Surgery
DEFAULT_SHAPE = (4, 8, 4)  # (prelude, core, coda) layers: the paper's headline shape (TinyLlama 4,8,4)
SELECTIONS = ("paper", "shortgpt", "angular")  # which parent layers a shape keeps
ADAPTERS = ("linear", "add")
# identity: W = [0 | I], the pruned parent exactly (recurfit's default); torch-default: nn.Linear's own
# Kaiming-uniform, seeded, where the paper's conversions leave the adapter; random: N(0, initializer_range²).
ADAPTER_INITS = ("identity", "torch-default", "random")
DEFAULT_STATE_INIT_STD = math.sqrt(2 / (5 * 5280))  # s_0's σ: Huginn-0125's, which the paper's models inherit

# Test-time recurrences that reports and sweeps show by default
SUMMARY_RECURRENCES = (1, 4, 32)
LOSS_RECURRENCES = (1, 2, 4, 8, 16, 32)
TASK_RECURRENCES = (1, 4, 32)

# Generation
CACHE_POLICIES = ("all", "latest")
EXIT_CRITERIA = ("kl", "state", "argmax")
DTYPES = ("auto", "float32", "bfloat16", "float16")

# Data preparation (`data prepare`; recurfit/data/packing.py and shards.py say more)
PACKINGS = ("bos-eos", "eos")  # the tokenizer's special tokens (its BOS) + document + EOS, as the authors; or + EOS
DEFAULT_PACKING = "bos-eos"
# Decontamination: the evaluation sets recurfit runs offline, whose test and validation items no training
# document may share an n-gram with (data/decontaminate.py); every `data prepare` checks all of them by default.
EVAL_SETS = ("gsm8k", "math", "arc_easy", "arc_challenge", "openbookqa", "hellaswag", "mmlu", "piqa", "social_iqa")
EVAL_SETS += ("winogrande", "lambada")
DECONTAMINATE = "all"
SHARD_DOCUMENTS = 1 << 17  # ≈ 130 M tokens of FineWeb-Edu: the unit of resume and of --task
BLOCK_DOCUMENTS = 1024  # what one worker tokenises at a time; a --max-tokens budget stops at a block's end
