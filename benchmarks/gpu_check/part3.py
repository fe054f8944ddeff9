"""Part 3: decoding (benchmarks/decode.py at batch 1, self-speculative at batch 32), benchmarks/profile_step.py
(the profile, 128k-vocabulary memory, FSDP2's all-gathers) and a one-process NCCL `recurfit train`; its command
lines, and the function of its prepare step (part 4 runs it too)."""

from __future__ import annotations

from train_setup import prepare_train

from .common import (
    BENCH,
    DEVICE,
    PART_BUDGET,
    BenchSizes,
    Part,
    Step,
    has_peaks,
    model_arguments,
    peaks,
    python,
    torchrun,
)
from .context import Context


def decode(b: BenchSizes, *options) -> list:
    """decode.py on random tokens, its floor at the bandwidth the part's device step measured."""
    bandwidth = ["--bandwidth", f"{peaks(b.work)['bandwidth_bytes'] / 1e9:.0f}"] if has_peaks(b.work) else []
    return python(
        BENCH / "decode.py",
        "--parent",
        b.parent,
        "--random-tokens",
        "--device",
        b.device,
        "--dtype",
        b.dtype,
        *b.decode,
        *bandwidth,
        *options,
    )


def profile(b: BenchSizes, *options) -> list:
    return python(BENCH / "profile_step.py", *model_arguments(b), "--depth", b.depth, *options)


PART = Part(
    "decoding, the profile, one-process NCCL training",
    (
        DEVICE,
        Step(
            "decode-batch-1",
            120,
            "decode.py: speed, cache policy, adaptive exit, speculative, batch depth",
            lambda b: decode(b, "--sequences", 1, "--sections", "1,2,3,4,5"),
        ),
        Step(
            "speculative-batch-32",
            60,
            "decode.py: self-speculative decoding at batch 32",
            lambda b: decode(b, "--sequences", 2 if b.smoke else 32, "--sections", 4),
        ),
        Step(
            "profile",
            70,
            "profile_step.py: operators, host synchronisations, kernels per step",
            lambda b: profile(b, "--trace", b.work / "profile-trace.json.gz"),
        ),
        Step(
            "head-memory-128k",
            50,
            "profile_step.py: logits and loss memory at a Llama-3 vocabulary",
            lambda b: profile(b, "--vocab-size", b.head_vocab, "--no-profile"),
        ),
        Step(
            "fsdp-gathers",
            60,
            "profile_step.py --fsdp: FSDP2's all-gathers per step, one process",
            lambda b: profile(b, "--fsdp", "--depth", b.fsdp_depth, "--rows", 10),
        ),
        Step("prepare", 60, "train_setup.py: a parent, tokenizer, token store and train.yaml"),
        Step(
            "train-torchrun",
            130,
            "one-process NCCL recurfit train, FSDP2, bf16: tokens/s, MFU",
            lambda b: torchrun("train", b.work / "train.yaml"),
        ),
    ),
    PART_BUDGET,
    6,
)


# ---------------------------------------------------------------- the step of parts 3 and 4 that is a function


def step_prepare(ctx: Context) -> None:
    prepare_train(ctx.work, ctx.smoke)
    ctx.record("prepare", f"a parent, tokenizer, token store and train.yaml in {ctx.work}")


STEP_FUNCTIONS = {"prepare": step_prepare}
