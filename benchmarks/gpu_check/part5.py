"""Part 5: benchmarks/train_step.py eager and compiled (step cost against the parent, activation memory, the
optimizer step, throughput at the sampled depth), as command steps."""

from __future__ import annotations

from .common import BENCH, DEVICE, PART_BUDGET, BenchSizes, Part, Step, model_arguments, python


def train_step(b: BenchSizes, *options) -> list:
    """train_step.py on the (4, 8, 4): step cost at (24, 8), activation memory, and the optimizer step (Muon in bf16
    and fp32, AdamW) beside forward+backward at the paper's step of 1 M tokens; throughput at r̄ = 32."""
    sections = ["--sections", "step,memory,optimizer", "--step-tokens", 1048576, "--step-depth", b.depth]
    return python(
        BENCH / "train_step.py",
        *model_arguments(b),
        "--shape",
        "4,8,4",
        "--steps",
        b.depth,
        "--throughput-steps",
        b.throughput_steps,
        *sections,
        "--attn",
        "sdpa",
        "--repeats",
        b.repeats,
        *options,
    )


PART = Part(
    "the training step, eager and compiled",
    (
        DEVICE,
        Step(
            "train-step-eager",
            100,
            "train_step.py: step cost, memory at n = 0/8/28, optimizer, MFU",
            lambda b: train_step(b),
        ),
        Step(
            "train-step-compiled",
            150,
            "the same, each decoder layer compiled",
            lambda b: train_step(b, "--compile"),
        ),
    ),
    PART_BUDGET,
    6,
)
