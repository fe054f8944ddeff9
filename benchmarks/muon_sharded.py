"""Muon's duplicated work under FSDP2: the Newton-Schulz orthogonalisations each process runs in one optimizer
step, when every process orthogonalises every matrix (recurfit before) and when each matrix is orthogonalised
by one process (BatchedMuon now, round robin), gloo on the CPU:

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/muon_sharded.py

A random Llama of 8 layers (hidden 512, MLP 1376) is sharded as the trainer shards it (distributed.fsdp_units),
its hidden matrices given seeded random gradients. Per process: "every matrix" times Newton-Schulz over every
unit's whole momentum update, in the same chunks (what each process computed before); "its share" times the
Newton-Schulz calls of BatchedMuon.step and the whole step (gathers and scatters included). Medians of 3 steps
measured in this one run, float32 Newton-Schulz (bf16 is emulated on CPUs without it).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor
from transformers import AutoModelForCausalLM, LlamaConfig

from recurfit.train import optim
from recurfit.train.distributed import Processes, fsdp_units

REPEATS = 3


def sharded_model():
    config = LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    fsdp_units(model, mixed_precision=False)
    return model


def with_gradients(matrices, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in matrices:
        whole = torch.randn(p.shape, generator=generator)
        p.grad = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)


def every_matrix_seconds(muon: optim.BatchedMuon) -> float:
    """Newton-Schulz over every unit's whole update, chunk by chunk: one process's work before."""
    group = muon.param_groups[0]
    units = list(muon._units(group))
    seconds = 0.0
    for chunk in optim.same_shape_chunks(units):
        updates = torch.stack([torch.cat([p.grad.full_tensor() for p in unit]) for unit in chunk])
        started = time.perf_counter()  # Newton-Schulz alone, not the gathers
        optim.newton_schulz(updates, group["ns_coefficients"], group["ns_steps"], group["eps"], muon.ns_dtype)
        seconds += time.perf_counter() - started
    return seconds


def main() -> None:
    torch.set_num_threads(1)
    with Processes.from_environment(timeout=600) as processes:
        line = measure()
        lines = [None] * processes.world
        dist.all_gather_object(lines, line)
    if processes.is_main:
        print("\n".join(lines))


def measure() -> str:
    """This process's line; the model and optimizer are freed on return, before the group is destroyed."""
    model = sharded_model()
    matrices, _ = optim.split_parameters(model)
    muon = optim.BatchedMuon([{"params": matrices}], ns_dtype=torch.float32, lr=0.02)
    spent, newton_schulz = [], optim.newton_schulz

    def timed(batch, *args):
        started = time.perf_counter()
        result = newton_schulz(batch, *args)
        spent.append((time.perf_counter() - started, batch.shape[0]))
        return result

    before, share, step, matrices_done = [], [], [], 0
    for repeat in range(REPEATS):
        with_gradients(matrices, repeat)
        before.append(every_matrix_seconds(muon))
        spent.clear()
        optim.newton_schulz = timed
        started = time.perf_counter()
        muon.step()
        step.append(time.perf_counter() - started)
        optim.newton_schulz = newton_schulz
        share.append(sum(seconds for seconds, _ in spent))
        matrices_done = sum(count for _, count in spent)
    units = len(list(muon._units(muon.param_groups[0])))
    line = (
        f"process {dist.get_rank()}: every matrix ({units}) {statistics.median(before) * 1e3:7.1f} ms of "
        f"Newton-Schulz; its share ({matrices_done}) {statistics.median(share) * 1e3:7.1f} ms "
        f"({statistics.median(share) / statistics.median(before):.2f}), the whole sharded step "
        f"{statistics.median(step) * 1e3:7.1f} ms"
    )
    return line


if __name__ == "__main__":
    main()
