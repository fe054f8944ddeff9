"""The GPU tutorial's budget (docs/tutorials/gpu-1b.md), computed from its recipe and recurfit's memory plan:
memory per GPU, training FLOPs, GPU-hours and disk, for each run the tutorial starts (the smoke run, the recurrent
run at r̄ = 4, 8 and 32, the parent baseline), written as one page, docs/reference/gpu-budget.md:

    .venv/bin/python scripts/gpu_budget.py            # rewrites docs/reference/gpu-budget.md
    .venv/bin/python scripts/gpu_budget.py --check    # exit 1 if the page differs from what the code computes

Nothing is downloaded: Llama-3.2-1B is built on the meta device from its public config values
(recurfit/train/memory.py's PLANNED_PARENTS). Memory is the plan `recurfit train … --dry-run` prints; FLOPs are
what the run's log adds up (each step's drawn depth, `training_flops_per_token`); time assumes the MFU (30 %) of an
H100's dense bf16 peak that an eager training step of a paper recipe of this size reached on an H200
(docs/results/gpu.md), and compiled time the speed-up a compiled step measured there; disk counts 4 bytes per
token of the store (the 128 k vocabulary needs uint32), fp32
weights and optimizer state in a checkpoint, and snapshots in `snapshots.dtype`. tests/test_docs.py checks that
the page is up to date and that every training command of the docs fits the memory it is planned for.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "paper" / "llama-464-math.yaml"
PAGE = REPO / "docs" / "reference" / "gpu-budget.md"
GPUS = 8
GPU_MEMORY = 80 * 10**9
PEAK_FLOPS = 989e12  # an H100 SXM's dense bf16 peak
MFU = 0.3  # an eager step of recipes/paper/tinyllama-484-fineweb.yaml on an H200: 30.3 % of 989 (docs/results/gpu.md)
# Compiled training (`compile: true`): the same step compiled ran 9,406 tokens/s against eager's 6,536 on an H200
# (docs/results/gpu.md, part 5), so it reaches 1.44 times the eager MFU.
COMPILED_SPEEDUP = 9406 / 6536
STORE_TOKENS = 52.5e9  # `data prepare --max-tokens 52.5B`: the run's 52.43 B tokens and a margin
VAL_FRACTION = 0.01
TOKEN_BYTES = 4
# The large-parent recipes (docs/how-to/large-parents.md): rows of 4,096 tokens, as their headers prepare them.
LARGE_RECIPES = (
    ("Llama-3.1-8B, (4, 8, 4)", REPO / "recipes" / "llama-3.1-8b.yaml"),
    ("Qwen3-14B, (5, 10, 5)", REPO / "recipes" / "qwen3-14b.yaml"),
)
LARGE_SEQ_LEN = 4096
# (name, overrides, processes): the runs of the tutorial, in its order
RUNS = (
    ("smoke run (1 GPU, 20 steps)", ["steps=20", "checkpoint.every=10", "snapshots.every=0", "eval.every=0"], 1),
    ("recurrent, r̄ = 4", ["snapshots.dtype=bfloat16"], GPUS),
    ("recurrent, r̄ = 8", ["snapshots.dtype=bfloat16", "depth.mean_recurrence=8", "batch.micro=4"], GPUS),
    ("recurrent, r̄ = 32", ["snapshots.dtype=bfloat16", "depth.mean_recurrence=32", "batch.micro=4"], GPUS),
    ("parent baseline", ["model.shape=null", "optimizer.muon_fused=false", "snapshots.dtype=bfloat16"], GPUS),
)


def planned(recipe: Path, overrides: list[str]):
    """The config and its model (meta device, frozen parts frozen) without download."""
    from recurfit.train import load_config
    from recurfit.train.memory import planned_model

    config = load_config(recipe, overrides)
    return config, planned_model(config)


def memory_plan(recipe: Path, overrides: list[str], world: int = GPUS, built=None):
    """What `recurfit train RECIPE OVERRIDES --dry-run --world-size WORLD` plans per GPU (`built`: the config and
    model `planned` returned for them, when already made)."""
    from recurfit.train.memory import PAPER_SEQ_LEN, plan_memory

    config, model = built or planned(recipe, overrides)
    return plan_memory(config, model, PAPER_SEQ_LEN, world=world, device="cuda")


def run_flops(config, model, seq_len: int | None = None) -> float:
    """Training FLOPs: what the run's log adds up (each step's drawn depth (n, k) on its tokens, the body only)
    and the LM head's 6·V·h per token (rows of `seq_len` tokens; default the paper's)."""
    import recurfit
    from recurfit.model.accounting import training_flops_per_token
    from recurfit.train.memory import PAPER_SEQ_LEN
    from recurfit.train.step_plan import depth_schedule

    counts = recurfit.count_parameters(model)
    tokens = config.batch.global_ * (seq_len or PAPER_SEQ_LEN)
    schedule = depth_schedule(config)
    head = 6 * model.config.vocab_size * model.config.hidden_size
    body = sum(tokens * training_flops_per_token(counts, schedule.at(step)) for step in range(config.steps))
    return float(body + config.steps * tokens * head)


def recompute_flops(config, model, seq_len: int) -> float:
    """What gradient checkpointing adds: backward runs again the forward of every layer with gradient (the
    prelude, the coda and each step's k core passes), 2 FLOPs per parameter and token, a third of their 6."""
    import recurfit
    from recurfit.model.accounting import training_flops_per_token
    from recurfit.train.step_plan import depth_schedule

    counts = recurfit.count_parameters(model)
    schedule = depth_schedule(config)
    tokens = config.batch.global_ * seq_len
    return float(
        sum(tokens * training_flops_per_token(counts, (0, schedule.at(step)[1])) // 3 for step in range(config.steps))
    )


def disk(config, model) -> dict[str, float]:
    """Bytes on disk: the checkpoints kept (fp32 weights, Muon momentum, AdamW moments), the snapshots, final/."""
    from recurfit.train.memory import _optimizer_bytes

    numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    muon, adamw = _optimizer_bytes(config, model)
    checkpoint = 4 * numel + muon + adamw
    every, end = config.snapshots.every, config.steps
    snapshots = (1 + (end - 1) // every) if every else 0
    snapshot = numel * getattr(torch, config.snapshots.dtype).itemsize
    kept = min(config.checkpoint.keep, end // config.checkpoint.every) if config.checkpoint.every else 0
    return {
        "checkpoint": checkpoint,
        "checkpoints": kept * checkpoint,
        "snapshots_count": snapshots,
        "snapshots": snapshots * snapshot,
        "final": 4 * numel,
    }


def gb(size: float) -> str:
    return f"{size / 1e9:,.1f} GB"


def rows() -> list[dict]:
    found = []
    for name, overrides, world in RUNS:
        config, model = planned(RECIPE, overrides)
        plan = memory_plan(RECIPE, overrides, world, built=(config, model))
        row = timed_row(config, model, plan, run_flops(config, model), 0.0, world)
        found.append(dict(name=name, overrides=overrides, world=world, **row))
    return found


def timed_row(config, model, plan, flops: float, recompute: float, world: int) -> dict:
    """A run's plan, FLOPs (and recomputed FLOPs) and time on `world` GPUs at MFU, eager and compiled, and disk."""
    gpu_hours = (flops + recompute) / (MFU * PEAK_FLOPS) / 3600
    hours = gpu_hours / world
    return dict(
        plan=plan,
        flops=flops,
        recompute=recompute,
        gpu_hours=gpu_hours,
        hours=hours,
        compiled_hours=hours / COMPILED_SPEEDUP,
        disk=disk(config, model),
    )


def large_rows() -> list[dict]:
    """The 8 B and 14 B recipes on one node of GPUS: memory, FLOPs and time, recomputation included."""
    from recurfit.train.memory import plan_memory

    found = []
    for name, recipe in LARGE_RECIPES:
        config, model = planned(recipe, [])
        plan = plan_memory(config, model, LARGE_SEQ_LEN, world=GPUS, device="cuda")
        flops = run_flops(config, model, LARGE_SEQ_LEN)
        recompute = recompute_flops(config, model, LARGE_SEQ_LEN) if config.model.gradient_checkpointing else 0.0
        found.append(dict(name=name, recipe=recipe, **timed_row(config, model, plan, flops, recompute, GPUS)))
    return found


def large_section() -> list[str]:
    lines = [
        "",
        "## The 8 B and 14 B recipes",
        "",
        "Computed the same way, for the [large parents](../how-to/large-parents.md)' recipes on one node of "
        f"{GPUS} 80 GB GPUs:",
        "5,000 steps of 512 rows of 4,096 tokens (10.5 B tokens), r̄ = 32 reached by a linear curriculum over the",
        "first 12.5 % of the steps, k̄ = 8. Gradient checkpointing runs the forward of every layer with gradient",
        "again in backward: the hours include it, the training FLOPs (as `train` logs them and counts its MFU) do",
        "not. Attention's own FLOPs, a few per cent at 4,096 tokens, are in neither. A checkpoint holds fp32 weights",
        "and the optimizers' state, written and read as each process's shards.",
        "",
        "| recipe | micro-batch | peak memory per GPU | training FLOPs | recomputed | GPU-hours | hours (days) "
        "| compiled | a checkpoint |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in large_rows():
        recipe = row["recipe"].relative_to(REPO)
        lines.append(
            f"| [{row['name']}](../../{recipe}) | {row['plan'].micro} | {gb(row['plan'].peak)} (k = {row['plan'].k}) "
            f"| {row['flops']:.2e} | {row['recompute']:.2e} | {row['gpu_hours']:,.0f} "
            f"| {hours(row['hours'])} ({row['hours'] / 24:.1f}) "
            f"| {hours(row['compiled_hours'])} ({row['compiled_hours'] / 24:.1f}) | {gb(row['disk']['checkpoint'])} |"
        )
    return lines


def run_bytes(row: dict) -> float:
    return row["disk"]["checkpoints"] + row["disk"]["snapshots"] + row["disk"]["final"]


def hours(value: float) -> str:
    return f"{value * 60:.0f} min" if value < 1 else f"{value:,.1f} h" if value < 10 else f"{value:,.0f} h"


def page() -> str:
    table = rows()
    store = STORE_TOKENS * (1 + VAL_FRACTION) * TOKEN_BYTES
    lines = [
        "# Budget of the GPU tutorial",
        "",
        "Computed, not measured, by `scripts/gpu_budget.py` from",
        "[recipes/paper/llama-464-math.yaml](../../recipes/paper/llama-464-math.yaml) and recurfit's memory plan",
        "(the plan `recurfit train … --dry-run --device-memory 80GB --world-size 8` prints once the token store",
        "of the tutorial's step 4 exists: it reads the store), for the runs of the",
        "[GPU tutorial](../tutorials/gpu-1b.md) on 80 GB GPUs. Do not edit by hand: run",
        "`.venv/bin/python scripts/gpu_budget.py`; the docs test fails when this page and the code disagree.",
        "",
        f"- **Time** assumes {MFU:.0%} MFU of an H100's {PEAK_FLOPS / 1e12:.0f} TFLOP/s dense bf16 peak: what one",
        "  eager training step of a paper recipe of this size, TinyLlama (4, 8, 4), reached on an H200",
        "  ([measured](../results/gpu.md#compiled-decoding-and-a-training-step)). Training alone: loading,",
        f"  validation and saving add to it. `recurfit train` logs the MFU it reaches: scale the hours by {MFU:g} /",
        "  yours. On A100s (312 TFLOP/s) the hours are 3.2 times as many. Compiled (`compile: true`), the same",
        f"  step ran {COMPILED_SPEEDUP:.2f} times as fast on an H200",
        "  ([measured](../results/gpu.md#training-step-cost)), hence the column of compiled hours; whether a whole",
        "  run compiles without recompiling under its depth draws has not been counted on a GPU.",
        "- **FLOPs** are what the run's log adds up (each step's drawn depth over its 1,048,576 tokens, the body",
        "  only) and the LM head's 6·V·h per token. The MFU `train` logs counts the body only: the hours it",
        "  implies are a little pessimistic.",
        f"- **Disk**: the token store is {gb(store)} ({STORE_TOKENS / 1e9:.1f} B tokens and "
        f"{VAL_FRACTION:.0%} held out, {TOKEN_BYTES} bytes a token); the Hub source is streamed, not",
        "  stored.",
        "  A run adds its checkpoints (fp32 weights, Muon momentum, AdamW moments; the last 3 kept), its",
        "  snapshots (one per 1,000 steps, in bf16 with `snapshots.dtype=bfloat16`, twice that in fp32) and",
        "  `final/` (fp32).",
        "- **Not in the table**: preparing the store (tokenising is CPU work: [measured",
        "  throughput](../results/cpu-training.md#data-prepare-throughput), plus the download) and the evaluation",
        "  steps, whose time depends on the generated lengths; neither has been measured on a GPU node.",
        "",
        "| run | processes | micro-batch | peak memory per GPU | training FLOPs | GPU-hours | hours | hours compiled "
        "| checkpoints | snapshots | final | disk of the run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    total = store
    for row in table:
        d = row["disk"]
        run_disk = run_bytes(row)
        if row["world"] > 1:
            total += run_disk
        lines.append(
            f"| {row['name']} | {row['world']} | {row['plan'].micro} | {gb(row['plan'].peak)} (k = {row['plan'].k}) "
            f"| {row['flops']:.2e} | {row['gpu_hours']:,.{0 if row['gpu_hours'] >= 10 else 1}f} "
            f"| {hours(row['hours'])} | {hours(row['compiled_hours'])} "
            f"| {gb(d['checkpoints'])} ({gb(d['checkpoint'])} each) | {d['snapshots_count']} × "
            f"{gb(d['snapshots'] / d['snapshots_count']) if d['snapshots_count'] else '0'} = {gb(d['snapshots'])} "
            f"| {gb(d['final'])} | {gb(run_disk)} |"
        )
    path = store + sum(run_bytes(row) for row in table if row["name"] in ("recurrent, r̄ = 4", "parent baseline"))
    lines += [
        "",
        "**Disk for the tutorial's path** (the store, the recurrent run at r̄ = 4 and the parent baseline, the smoke",
        f"run's folder deleted): **{gb(path)}**; with the runs at r̄ = 8 and 32 as well: {gb(total)}.",
        "",
        "Overrides of each run (after the recipe):",
        "",
    ]
    lines += [f"- {row['name']}: `{' '.join(row['overrides'])}`" for row in table]
    lines += large_section()
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = page()
    if "--check" in sys.argv[1:]:
        sys.exit(0 if PAGE.read_text() == text else 1)
    PAGE.write_text(text)
    print(text)
