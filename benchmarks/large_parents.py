"""The memory plan (recurfit/train/memory.py) of retrofits of 8 B to 70 B parents on 8 and 16 GPUs of 80 GB:
which sharding (DDP, FSDP2, FSDP2 layer by layer), micro-batch and gradient checkpointing fit
(docs/how-to/large-parents.md quotes it).

    python benchmarks/large_parents.py [--seq-len 4096]

The parents are built on the meta device from their public config values (no download, no weights); the
retrofit keeps half their layers as the paper's (2, 4, 2) of a 16-layer parent: Llama-3.1-8B (32 layers) as
(4, 8, 4), Qwen3-14B (40 layers) as (5, 10, 5), Qwen3-32B (64) as (8, 16, 8), Llama-3.1-70B (80) as
(10, 20, 10). Training: mean recurrence 32, backprop depth 8, Muon, bf16
autocast, validation at r = 1…64. A plan is a prediction (checked against measured peaks by
benchmarks/memory_plan.py); a verdict "fits" leaves 10% of the GPU free.
"""

from __future__ import annotations

import argparse

# Each parent retrofitted with half its layers, as the paper's (2, 4, 2) of a 16-layer parent (their configs:
# recurfit/train/memory.py's PLANNED_PARENTS).
SHAPES = {
    "meta-llama/Llama-3.1-8B": [4, 8, 4],
    "Qwen/Qwen3-14B": [5, 10, 5],
    "Qwen/Qwen3-32B": [8, 16, 8],
    "meta-llama/Llama-3.1-70B": [10, 20, 10],
}


# How the processes share the run: DDP, FSDP2 with the recurrent unit gathered once per micro-batch, or layer by layer.
SHARDINGS = {"ddp": ("ddp", "recurrence"), "fsdp": ("fsdp", "recurrence"), "fsdp-layer": ("fsdp", "layer")}


def train_config(name: str, sharding: str, checkpointing: bool, micro: int):
    from recurfit.train import load_config

    base = {
        "out": "runs/plan",
        "model": {"path": name, "shape": SHAPES[name], "gradient_checkpointing": checkpointing},
        "data": {"phases": [{"sources": ["unused"]}]},
        "depth": {"mean_recurrence": 32, "backprop_depth": 8},
        "optimizer": {"name": "muon"},
        "batch": {"micro": micro, "global": 512},
        "precision": "bf16",
        "distributed": SHARDINGS[sharding][0],
        "fsdp_units": SHARDINGS[sharding][1],
        "eval": {"steps": [1, 2, 4, 8, 16, 32, 64]},
    }
    return load_config(None, base=base)


def main() -> None:
    from recurfit.train.memory import PAPER_GPU_MEMORY, gb, plan_memory, planned_model
    from recurfit.train.memory_fit import fits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    print(f"seq_len {args.seq_len}, global batch 512, predicted peak per 80 GB GPU (fits: within 72 GB)")
    print(
        f"{'parent':26s} {'GPUs':>4s} {'sharding':10s} {'checkpointing':13s} "
        + " ".join(f"{m:>12d}" for m in (1, 2, 4, 8))
    )
    for name in SHAPES:
        for world in (8, 16):
            for sharding in SHARDINGS:
                for checkpointing in (False, True):
                    cells = []
                    for micro in (1, 2, 4, 8):
                        config = train_config(name, sharding, checkpointing, micro)
                        plan = plan_memory(config, planned_model(config), args.seq_len, world=world)
                        cells.append(f"{gb(plan.peak):>8s} {'fits' if fits(plan, PAPER_GPU_MEMORY) else '  no'}")
                    on = "on" if checkpointing else "off"
                    print(f"{name:26s} {world:4d} {sharding:10s} {on:13s} " + " ".join(f"{c:>12s}" for c in cells))


if __name__ == "__main__":
    main()
