"""What drawing a depth per micro-batch costs on several processes: each process's own draws against the same
draws on every process (`depth.across_processes`).

    .venv/bin/python benchmarks/depth_draws.py                     # both sections
    .venv/bin/python benchmarks/depth_draws.py --sections model    # the sampler's numbers only (a second)

1. model: FSDP2 makes every process wait at each micro-batch for the slowest (each unit's all-gather and
   reduce-scatter pair the processes up), so a step costs the sum over micro-batch slots of the deepest process's
   draw. With recurfit's own plans (`plan_step`, r̄ 32, k̄ 8, 200 steps) and a cost of 1 per recurrence without
   gradient and 4 per recurrence with (forward, backward and the forward again of a checkpointed step): the share
   of the hardware's throughput a run keeps, mean work per process over that sum, for W processes of M
   micro-batches each.
2. measured: `recurfit train` under torchrun with 2 gloo processes, FSDP2 by recurrence, one draw per micro-batch
   (r̄ 8, k̄ 2, 4 micro-batches per process), a random 8-layer Llama (hidden 256) at 128 tokens, own draws and then
   the same draws: the wall time per step against the model's sum of per-slot maxima, and the throughput each
   keeps, time per unit of mean work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

GRAD_COST = 4  # a recurrence with gradient against one without: forward, backward (2×) and a checkpointed forward


def work(n: int, k: int) -> int:
    return n + GRAD_COST * k


def step_costs(depths: list[list[int]], world: int) -> tuple[float, float]:
    """A step's (sum over slots of the deepest process's work, mean work per process), from its micro-batches'
    (n, k) in plan order (process by process)."""
    slots = len(depths) // world
    per_process = [[work(*depths[p * slots + j]) for j in range(slots)] for p in range(world)]
    return sum(max(column) for column in zip(*per_process)), statistics.fmean(map(sum, per_process))


def plans(world: int, micro_batches: int, across: str, steps: int, mean: int, backprop: int):
    from recurfit.train import load_config
    from recurfit.train.step_plan import depth_schedule, plan_step

    settings = {
        "out": "unused",
        "data": {"phases": [{"sources": ["unused"]}]},
        "batch": {"micro": 1, "global": world * micro_batches},
        "depth": {
            "mean_recurrence": mean,
            "backprop_depth": backprop,
            "draw": "micro_batch",
            "across_processes": across,
        },
    }
    config = load_config(None, [], base=settings)
    schedule = depth_schedule(config)
    for step in range(steps):
        yield [list(m.num_steps) for m in plan_step(config, schedule, step, world, True).micro_batches]


def model_section() -> None:
    print("## The sampler's plans: share of the hardware's throughput kept (r̄ 32, k̄ 8, 200 steps)\n")
    print("| processes | micro-batches each | own draws | same draws |")
    print("|---|---|---|---|")
    for world, micro_batches in ((2, 4), (8, 4), (8, 32), (64, 32)):
        kept = {}
        for across in ("own", "same"):
            costs = [step_costs(d, world) for d in plans(world, micro_batches, across, 200, 32, 8)]
            kept[across] = sum(mean for _, mean in costs) / sum(top for top, _ in costs)
        print(f"| {world} | {micro_batches} | {kept['own']:.0%} | {kept['same']:.0%} |")


def measured_section(root: Path, steps: int) -> None:
    import random

    import torch
    import yaml
    from train_setup import token_store, word_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    words = 500
    tokenizer = word_tokenizer([f"w{i}" for i in range(words - 4)])
    config = LlamaConfig(
        vocab_size=words, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "parent")
    tokenizer.save_pretrained(root / "parent")
    rng = random.Random(0)
    texts = (" ".join(f"w{rng.randrange(words - 4)}" for _ in range(rng.randint(100, 1500))) for _ in range(400))
    store = token_store(root / "docs.jsonl", tokenizer, texts, 128, root / "data")
    world, micro_batches = 2, 4
    print(f"\n## Measured: {world} gloo processes, FSDP2 by recurrence, r̄ 8, k̄ 2, {micro_batches} micro-batches each\n")
    print(
        "| draws | s per step | sum of slot maxima | mean work per process | s per unit of mean work | kept (model) |"
    )
    print("|---|---|---|---|---|---|")
    rates = {}
    for across in ("own", "same"):
        run = {
            "out": str(root / across),
            "model": {"path": str(root / "parent"), "shape": [2, 4, 2]},
            "data": {"phases": [{"sources": [str(store)]}]},
            "depth": {"mean_recurrence": 8, "backprop_depth": 2, "draw": "micro_batch", "across_processes": across},
            "optimizer": {"name": "adamw"},
            "precision": "fp32",
            "batch": {"micro": 1, "global": world * micro_batches},
            "steps": steps + 1,
            "distributed": "fsdp",
            "checkpoint": {"every": 0},
            "eval": {"every": 0},
            "log": {"progress": False},
        }
        (root / f"{across}.yaml").write_text(yaml.safe_dump(run))
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([*torchrun, "-m", "recurfit", "train", str(root / f"{across}.yaml")], check=True, env=env)
        lines = (root / across / "log.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if r["kind"] == "train"][1:]  # the first step warms up
        seconds = sum(r["seconds"] for r in records)
        costs = [step_costs(r["depths"], world) for r in records]
        top, mean = sum(c[0] for c in costs), sum(c[1] for c in costs)
        rates[across] = seconds / mean
        print(
            f"| {across} | {seconds / len(records):.3f} | {top / len(records):.1f} | {mean / len(records):.1f} "
            f"| {seconds / mean * 1e3:.2f} ms | {mean / top:.0%} |"
        )
    print(f"\nThroughput with the same draws over own draws, per unit of work: {rates['own'] / rates['same']:.2f}×")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="model,measured")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per run (after one to warm up)")
    args = parser.parse_args()
    sections = args.sections.split(",")
    if "model" in sections:
        model_section()
    if "measured" in sections:
        sys.path.insert(0, str(Path(__file__).parent))
        with tempfile.TemporaryDirectory() as root:
            measured_section(Path(root), args.steps)


if __name__ == "__main__":
    main()
