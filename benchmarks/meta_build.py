"""Peak host memory of each process setting up a 2-process run: the meta-device build against every process
building the whole model (what recurfit did before), gloo on the CPU.

    python benchmarks/meta_build.py                    # the embedded SmolLM2-135M, retrofit (4, 8, 4), FSDP2 and DDP

Each case runs tests/distributed_probe.py `weights` (the meta-device build: the main process builds the
retrofit, the other makes it on the meta device and receives its shards, or the whole under DDP) or
`weights-alone` (each process builds the whole retrofit itself) under `torchrun --nproc-per-node 2`. Each
process reports its peak resident set while the trainer is set up, over its resident set before (torch and
recurfit imported). glibc serves allocations of 128 KiB or more by mmap (MALLOC_MMAP_THRESHOLD_), so that freed
tensors leave the resident set at once. The two cases ran one after the other in this one run; the weights
they set up are the same (tests/test_train_distributed.py checks them bit for bit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "tests" / "distributed_probe.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
WORDS = "the a cat dog sat ran on under mat tree and then it was big small red".split()


def token_store(root: Path) -> Path:
    """A small token store of the embedded model's tokenizer (seq_len 64)."""
    import random

    from recurfit.data import prepare
    from recurfit.model.loading import load_tokenizer

    generator = random.Random(0)
    documents = root / "prose.jsonl"
    with documents.open("w") as file:
        for _ in range(200):
            file.write(json.dumps({"text": " ".join(generator.choices(WORDS, k=80))}) + "\n")
    prepare(load_tokenizer(None), [str(documents)], 64, root / "prose", show_progress=False, val_fraction=0.05,
            decontaminate="none")  # fmt: skip
    return root / "prose"


def run(root: Path, store: Path, strategy: str, mode: str) -> list[int]:
    config = {
        "out": str(root / f"{strategy}-{mode}"),
        "model": {"shape": [4, 8, 4]},
        "data": {"phases": [{"sources": [str(store)]}], "validation": []},
        "batch": {"micro": 2, "global": 4},
        "steps": 1,
        "distributed": strategy,
        "log": {"progress": False},
    }
    path = root / f"{strategy}-{mode}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = root / f"{strategy}-{mode}.json"
    subprocess.run([*TORCHRUN, str(PROBE), mode, str(path), str(out)], cwd=REPO, env=env, check=True,
                   capture_output=True)  # fmt: skip
    return [json.loads(Path(f"{out}.{rank}").read_text())["peak_host_bytes"] for rank in range(2)]


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        store = token_store(root)
        print("peak host memory per process while the trainer is set up (MiB): main, other")
        print(f"{'strategy':9s} {'each builds the whole':>24s} {'meta-device build':>20s} {'other: ratio':>13s}")
        for strategy in ("fsdp", "ddp"):
            alone, meta = (run(root, store, strategy, mode) for mode in ("weights-alone", "weights"))
            shown = [f"{a / 2**20:6.0f}, {b / 2**20:6.0f}" for a, b in (alone, meta)]
            print(f"{strategy:9s} {shown[0]:>24s} {shown[1]:>20s} {meta[1] / alone[1]:13.2f}")


if __name__ == "__main__":
    main()
