"""Host memory per process while a checkpoint is saved and resumed, over 1, 2 and 4 gloo processes under FSDP2.

    .venv/bin/python benchmarks/checkpoint_memory.py                 # 1, 2 and 4 processes
    .venv/bin/python benchmarks/checkpoint_memory.py --processes 2

Each process builds memory_plan.py's model D, shards it as the trainer does (`Processes.wrap`), takes one AdamW
step (so the optimizer has its two moments per weight) and then, measuring the growth of its resident memory over
what it held before (sampled every 2 ms):

- sharded: saves a checkpoint as `recurfit train` does under torchrun (`checkpoint.save_checkpoint`: DCP, each
  process its shards), and resumes from it (`read_checkpoint` and `restore`);
- whole, for comparison, in processes of their own: gathers the whole model and optimizer states (`gather_state`,
  what a whole checkpoint is written from) and reads a whole checkpoint back as every process did before
  checkpoints were sharded (the safetensors file and the optimizer file, whole, on every process).

The largest growth over the processes is shown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * PAGE


@contextmanager
def peak_growth(into: dict, key: str):
    """The largest resident memory while the block runs, over what was resident before it, in bytes."""
    import gc

    gc.collect()
    base, peak, done = resident(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        into[key] = max(peak[0], resident()) - base


def measure(root: Path, mode: str) -> dict:
    import torch
    from memory_plan import SHAPES, build
    from safetensors.torch import load_file, save_file

    from recurfit.train.checkpoint import gather_state, read_checkpoint, restore, save_checkpoint
    from recurfit.train.distributed import Processes
    from recurfit.train.head import final_hidden_states
    from recurfit.train.losses import HealingLoss

    torch.set_num_threads(1)
    config, model, _ = build(dict(shape="D", k=2, loss="chunked", world=int(os.environ["WORLD_SIZE"])))
    processes = Processes.from_environment(timeout=600)
    processes.wrap(model, "fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    size = SHAPES["D"]
    rows = torch.randint(0, size["vocab"], (1, size["seq"] + 1))
    hidden, weight = final_hidden_states(model, model, rows[:, :-1], num_steps=(1, 1))
    HealingLoss(None, None)(hidden, weight, rows[:, 1:].flatten(), None, {}).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    grown = {}
    if mode == "sharded":
        trainer = {"counters": {"step": 1}, "stream": {}, "config": {}}
        with peak_growth(grown, "save"):
            save_checkpoint(root / "sharded", 1, model, [optimizer], [], trainer, 1, processes)
        with peak_growth(grown, "resume"):
            restore(read_checkpoint(root / "sharded" / "step-000001", verify=False), model, [optimizer], [])
    else:
        with peak_growth(grown, "gather whole"):
            model_state, optimizer_states = gather_state(model, [optimizer])
            if processes.is_main:
                save_file(model_state, root / "model.safetensors")
                torch.save(optimizer_states, root / "optimizer.pt")
            del model_state, optimizer_states
        processes.barrier()
        with peak_growth(grown, "read whole"):
            whole = load_file(root / "model.safetensors"), torch.load(root / "optimizer.pt", weights_only=True)
            del whole
    weights = sum(p.numel() for p in model.parameters())
    processes.close()
    return {"weights": weights, "rank": processes.rank, **grown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        root, mode = args.one
        result = measure(Path(root), mode)
        Path(root, f"{mode}.{result['rank']}.json").write_text(json.dumps(result))
        return
    print("| processes | weights | save (sharded) | resume (sharded) | gather whole | read whole |")
    print("|---|---|---|---|---|---|")
    for count in map(int, args.processes.split(",")):
        results = []
        with tempfile.TemporaryDirectory() as root:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={count}"]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent))
            for mode in ("sharded", "whole"):
                subprocess.run([*command, __file__, "--one", root, mode], check=True, env=env, capture_output=True)
                results += [json.loads(Path(root, f"{mode}.{rank}.json").read_text()) for rank in range(count)]
        keys = ("save", "resume", "gather whole", "read whole")
        worst = {key: max(r[key] for r in results if key in r) / 1e6 for key in keys}
        print(
            f"| {count} | {results[0]['weights'] / 1e6:.0f} M | {worst['save']:.0f} MB | {worst['resume']:.0f} MB "
            f"| {worst['gather whole']:.0f} MB | {worst['read whole']:.0f} MB |"
        )


if __name__ == "__main__":
    main()
