"""FSDP2's traffic per training step: all-gathers and reduce-scatters, calls and bytes, by micro-batches per process.

    .venv/bin/python benchmarks/fsdp_traffic.py                  # 2 gloo processes (torchrun), 1, 2 and 4
                                                                 # micro-batches
    .venv/bin/python benchmarks/fsdp_traffic.py --units layer    # `fsdp_units: layer`

Each process builds memory_plan.py's model D (5 of its 6 layers in the recurrent body), shards it as the trainer
does (`Processes.wrap`) and runs one step per micro-batch count as the trainer runs it (`Processes.accumulating`
around each micro-batch's forward and backward, depth (2, 2)), counting the calls of FSDP2's two collectives and
the bytes of the unsharded tensors each call moves (the weights an all-gather assembles, the gradients a
reduce-scatter reduces). A ring all-gather or reduce-scatter sends (W - 1) / W of those bytes from each process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from recurfit.defaults import FSDP_UNITS

MICRO_BATCHES = (1, 2, 4)


def count(module, name: str, size) -> dict:
    """Count the calls of `module.name` and the bytes `size(*args)` says each moves."""
    tally, original = {"calls": 0, "bytes": 0}, getattr(module, name)

    def counted(*args, **kwargs):
        tally["calls"] += 1
        tally["bytes"] += size(*args)
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return tally


def gathered_bytes(fsdp_params, *args) -> int:
    import torch

    return sum(torch.Size(p._orig_size).numel() * (p.param_dtype or p.orig_dtype).itemsize for p in fsdp_params)


def reduced_bytes(fsdp_params, unsharded_grads, *args) -> int:
    return sum(grad.numel() * grad.element_size() for grad in unsharded_grads)


def measure(units: str) -> dict:
    import torch
    from memory_plan import SHAPES, build
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    from recurfit.train.distributed import Processes
    from recurfit.train.head import final_hidden_states
    from recurfit.train.losses import HealingLoss

    torch.set_num_threads(1)
    case = dict(shape="D", k=2, loss="chunked", world=int(os.environ["WORLD_SIZE"]), units=units)
    config, model, _ = build(case)
    processes = Processes.from_environment(timeout=600)
    processes.wrap(model, "fsdp", layers=units == "layer")
    healing, size = HealingLoss(None, None), SHAPES["D"]
    gathers = count(group, "foreach_all_gather", gathered_bytes)
    reductions = count(group, "foreach_reduce", reduced_bytes)
    results = {}
    for micro_batches in MICRO_BATCHES:
        before = {name: dict(tally) for name, tally in (("gather", gathers), ("reduce", reductions))}
        rows = torch.randint(0, size["vocab"], (micro_batches, size["micro"], size["seq"] + 1))
        for index, micro_batch in enumerate(rows):
            with processes.accumulating(model, index == micro_batches - 1):
                hidden, weight = final_hidden_states(model, model, micro_batch[:, :-1], num_steps=(2, 2))
                loss = healing(hidden, weight, micro_batch[:, 1:].flatten(), None, {})
                (loss / micro_batches).backward()
        model.zero_grad(set_to_none=True)
        results[micro_batches] = {
            name: {key: tally[key] - before[name][key] for key in tally}
            for name, tally in (("gather", gathers), ("reduce", reductions))
        }
    weights = sum(p.numel() for p in model.parameters())
    del model
    processes.close()
    return {"weights": weights, "steps": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--units", choices=FSDP_UNITS, default=FSDP_UNITS[0], help="fsdp_units")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = measure(args.units)
        if os.environ.get("RANK") == "0":
            print(json.dumps(result))
        return
    command = [
        *(sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.processes}"),
        *(__file__, "--one", "--units", args.units),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"model D, {result['weights'] / 1e6:.1f} M weights (float32), fsdp_units {args.units}, {args.processes} gloo "
        "processes, per step:"
    )
    print(f"{'micro-batches':>13s} {'all-gathers':>11s} {'gathered':>10s} {'reduce-scatters':>15s} {'reduced':>10s}")
    for micro_batches, step in result["steps"].items():
        gather, reduce = step["gather"], step["reduce"]
        print(
            f"{micro_batches:>13s} {gather['calls']:>11d} {gather['bytes'] / 1e6:>7.0f} MB "
            f"{reduce['calls']:>15d} {reduce['bytes'] / 1e6:>7.0f} MB"
        )


if __name__ == "__main__":
    main()
