"""Part 4, training at scale: NCCL kill-and-resume with DDP and FSDP2 (losses against a straight run), the
core's gradient under CUDA bf16 autocast, the healing tests on CUDA, and recompiles of `compile: true` training;
its steps, and the functions of those that are not commands."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .common import DEVICE, PART_BUDGET, Part, Step, pytest_command, python, torchrun
from .context import Context
from .smoke import SMOKE_HEALING

PART = Part(
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
)


# ---------------------------------------------------------------- the steps of part 4 that are functions


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
    "resume-ddp": lambda ctx: resume_check(ctx, "ddp"),
    "resume-fsdp": lambda ctx: resume_check(ctx, "fsdp"),
    "recompiles": step_recompiles,
}
