"""Processes and devices: torchrun's environment, DDP or FSDP2 applied from outside the model (torchtitan style).

One process (no torchrun) needs no process group. Under torchrun, gloo on CPU and NCCL on GPU, with DDP or FSDP2
applied even to a single process (`torchrun --nproc-per-node 1`), so that the distributed path can be checked on a
machine with one GPU.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Processes:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    grouped: bool = False  # in a process group: under torchrun, even with one process

    @classmethod
    def from_environment(cls) -> Processes:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        grouped = world > 1 or "TORCHELASTIC_RUN_ID" in os.environ  # torchrun sets it, also for one process
        if grouped and not dist.is_initialized():
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
            )
        return cls(rank, world, local_rank, device, grouped)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module, strategy: str) -> nn.Module:
        """DDP: a wrapper to call for forward/backward. FSDP2: `fully_shard` each layer and the root, in place."""
        if not self.grouped:
            return model
        if strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for module in model.modules():
                if type(module).__name__.endswith("DecoderLayer"):
                    fully_shard(module)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[self.local_rank] if self.device.type == "cuda" else None)

    def no_sync(self, wrapped: nn.Module, last_micro_batch: bool):
        """Skip DDP's gradient all-reduce on all but the last micro-batch of an accumulation."""
        if last_micro_batch or not hasattr(wrapped, "no_sync"):
            return nullcontext()
        return wrapped.no_sync()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.world
        return value

    def barrier(self) -> None:
        if self.grouped:
            dist.barrier()

    def close(self) -> None:
        if self.grouped and dist.is_initialized():
            dist.destroy_process_group()
