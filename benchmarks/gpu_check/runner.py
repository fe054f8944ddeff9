"""The GPU check: the questions that matter most, in order, each step its own process and time limit; later parts
measure more, each within one 10-minute command.

On a lent GPU machine (torch and transformers as installed there, no network), from the repository root:

    python benchmarks/gpu_check.py --out "$OUT"            # part 1, the five-minute check: run it first
    python benchmarks/gpu_check.py --part 2 --out "$OUT"   # later, one part a command: 2 to 6 (< 9.5 min each)
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

Parts 2-6 each begin with the device step (a part may run on a fresh machine), then run the benchmark scripts,
the CUDA tests and training runs as command steps, on TinyLlama-shaped random weights:
2. the CUDA tests (`pytest --device cuda`, fp32 and bf16);
3. benchmarks/decode.py at batch 1 (every section but compiled decoding, which part 1 measures) and
   self-speculative decoding at batch 32, benchmarks/profile_step.py (profile, 128k-vocabulary memory, FSDP2's
   all-gathers), and a one-process NCCL `recurfit train` with FSDP2;
4. training at scale: NCCL kill-and-resume with DDP and FSDP2 (losses against a straight run), the core's gradient
   under CUDA bf16 autocast, the healing tests on CUDA, and recompiles of `compile: true` training;
5. benchmarks/train_step.py eager and compiled (step cost against the parent, activation memory, the optimizer
   step, throughput at the sampled depth);
6. self-speculative decoding at r = 32, batch 1 and 32, on a (4, 8, 4) retrofit first trained on the device for
   300 steps on generated word problems (random weights alone would make every draft's acceptance meaningless).
A command step's status line carries the last lines of its output; a part's long outputs (JUnit XML, the
profiler's trace, the training log) are packed into OUT/artifacts-partN.tar.gz after its last step.

The runner. The check is sized for a lent GPU machine that runs one command for at most 600 s and may be a fresh
machine at every command (nothing installed or compiled by an earlier one): part 1's limits add up to 300 s (the
five minutes), each later part's to at most PART_BUDGET (570 s), leaving the rest of the 600 s to the interpreter's
start and packing. Every part begins with the device step, so its results name the card and versions and its MFU
and decode floors use the peaks measured on that machine. Each step runs in a process and session of its own (its
command, or benchmarks/gpu_check.py with `--step NAME`), killed with its children once its limit and the seconds
the steps before it left unused are spent; the part goes on with its next step, and what a killed step wrote
stays. The limits (Step.seconds) are set for an H100-class card; parts 3 and 4's are estimates until a GPU run
measures them, and `--plan` prints them all. Like part 1, every part needs only torch and transformers, runs
recurfit from the checkout and downloads nothing (benchmarks/train_setup.py builds the parent, a word-level
tokenizer and a token store locally).

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
minute on 2 cores, no CUDA graphs on a CPU; parts 2-6: minutes each), with the packages the device lacks hidden
(MISSING_ON_DEVICE), so that CI fails here if a step stops running; scripts/check-device.sh runs part 1's under
the GPU machine's torch and transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from train_setup import prepare_train

from . import part1, part2, part3, part4, part5, part6
from .common import BENCH, REPO, SCRIPT, Step, append, bench_sizes, has_peaks, output, peaks, read_results
from .context import Context
from .smoke import hide_device_missing

# The parts, in order (each one's steps, limits and budget are its module's).
PARTS = {1: part1.PART, 2: part2.PART, 3: part3.PART, 4: part4.PART, 5: part5.PART, 6: part6.PART}
# A part's long outputs, packed after its last step (the device returns few files).
ARTIFACTS = (
    "peaks.json",
    "junit-float32.xml",
    "junit-bfloat16.xml",
    "junit-healing.xml",
    "profile-trace.json.gz",
    "run/log.jsonl",
    "train.yaml",
    "drafting-run/log.jsonl",
    "drafting.yaml",
)


# ---------------------------------------------------------------- the runner


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
        argv = [sys.executable, SCRIPT, "--step", step.name, "--part", part, "--out", out, "--work", work]
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
    for folder in [work / "run", work / "drafting-run", work / "compiled", *work.glob("resume-*")]:
        if folder.is_dir():
            shutil.rmtree(folder)


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


# The steps that are functions, by name, from the parts' modules (part 4 runs part 3's prepare too).
STEP_FUNCTIONS = {**part1.STEP_FUNCTIONS, **part3.STEP_FUNCTIONS, **part4.STEP_FUNCTIONS, **part6.STEP_FUNCTIONS}


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="results folder ($OUT on the device machine)")
    parser.add_argument(
        "--part",
        choices=[*map(str, PARTS), "all"],
        default="1",
        help="1: the five-minute check (default); 2-6: later, one a command; all: each in turn (the smoke, --plan)",
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
