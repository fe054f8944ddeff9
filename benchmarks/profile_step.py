"""One training step of a retrofit under torch.profiler: where the time goes, and the memory of the LM head.

    python benchmarks/profile_step.py --parent tinyllama --device cuda --dtype bf16 --trace trace.json.gz
    python benchmarks/profile_step.py --parent tinyllama --vocab-size 128256 --no-profile   # Llama-3 vocabulary
    python benchmarks/profile_step.py --parent tinyllama --fsdp --rows 10                   # FSDP2, one process

Runs forward and backward at the fixed depth `--depth n,k` (r̄ = 32, k̄ = 8 by default: 24 + 8) after a
warm-up step, then prints: the operators by device time (and host time), the host synchronisations
(`aten::item`, `aten::_local_scalar_dense`, `cudaStreamSynchronize`, `cudaDeviceSynchronize`), the number of
kernels launched, and the peak memory with the logits' share. `--fsdp` shards the model with FSDP2 in a
one-process group (NCCL on a GPU, gloo on a CPU), as `recurfit train` does under torchrun (the token
embeddings, each prelude layer, the recurrent body as one unit, the head as the root; with `--dtype bf16` in
training's mixed precision: parameters gathered and computed in bf16, gradients reduced in fp32), and lists the
all-gathers the profiler saw. In a group of one
FSDP2 communicates nothing (each unit already holds its whole parameters); the counts of 2 processes, which do
not grow with n + k, are tests/test_train_distributed.py's. The loss is recurfit's own (chunked fp32
cross-entropy, as `recurfit train` computes it), so the peak memory is training's.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile
from train_step import TINYLLAMA, parent_model, training_loss  # benchmarks/ is on the path when this file runs
from transformers import AutoModelForCausalLM, LlamaConfig

import recurfit
from recurfit.train.distributed import Processes
from recurfit.train.head import CHUNK_ELEMENTS, chunk_rows

SYNCS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def build(args, processes: Processes) -> torch.nn.Module:
    if args.parent == "tinyllama" and args.vocab_size:
        config = LlamaConfig(**{**TINYLLAMA, "vocab_size": args.vocab_size})
        parent = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        parent = parent_model(args.parent)
    model = recurfit.retrofit(parent, tuple(int(x) for x in args.shape.split(","))).to(args.device).train()
    if args.attn:
        model.set_attn_implementation(args.attn)
    if args.compile:
        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                module.compile()
    if args.fsdp:
        bf16 = args.dtype == "bf16"  # as recurfit train shards: parameters gathered in bf16 on a GPU
        backend = torch.distributed.get_backend()
        print(f"FSDP2 over a one-process {backend} group{', bf16 mixed precision' if bf16 else ''}")
        processes.wrap(model, "fsdp", bf16=bf16)
    return model


def one_process(args) -> Processes:
    """This process alone; with --fsdp, in a one-process group (NCCL on a GPU, gloo on a CPU)."""
    if args.fsdp:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")})
        torch.distributed.init_process_group("nccl" if args.device.startswith("cuda") else "gloo", rank=0, world_size=1)
    return Processes(device=torch.device(args.device), grouped=args.fsdp)


def step(model, ids, depth, autocast) -> None:
    training_loss(model, ids, autocast, num_steps=depth).backward()
    model.zero_grad(set_to_none=True)


def report(prof, device: torch.device, rows: int) -> None:
    events = prof.key_averages()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=rows, max_name_column_width=60))
    by_name = {event.key: event.count for event in events}
    print("host synchronisations: " + ", ".join(f"{name} ×{by_name.get(name, 0)}" for name in SYNCS))
    gathers = {name: count for name, count in by_name.items() if "allgather" in name.lower().replace("_", "")}
    print("all-gathers: " + (", ".join(f"{name} ×{count}" for name, count in gathers.items()) or "none"))
    if device.type == "cuda":
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"device kernels launched: {kernels}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent", default="tinyllama", help="tinyllama (random weights) | embedded | a folder")
    parser.add_argument("--shape", default="4,8,4")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--depth", default="24,8", help="(n, k): steps without and with gradient")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument("--vocab-size", type=int, help="tinyllama with another vocabulary (Llama-3: 128256)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 as recurfit train applies it, one process")
    parser.add_argument("--no-profile", action="store_true", help="only the memory")
    parser.add_argument("--trace", help="write the Chrome trace here (.json.gz)")
    parser.add_argument("--rows", type=int, default=25, help="operators in the table")
    args = parser.parse_args()
    with one_process(args) as processes:
        measure(args, processes)


def measure(args, processes: Processes) -> None:
    """The profile and the memory; the model is freed on return, before the group is destroyed."""
    device = torch.device(args.device)
    model = build(args, processes)
    vocab = model.config.text_config.vocab_size
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    # One token more per row: inputs its first seq_len tokens, targets its last, as recurfit train feeds them.
    ids = torch.randint(0, vocab, (args.batch, args.seq_len + 1), device=device)
    depth = tuple(int(x) for x in args.depth.split(","))
    print(
        f"{args.parent} {model.config.shape}, vocabulary {vocab}, {args.batch}×{args.seq_len} tokens, depth {depth}, "
        f"{device} {args.dtype}{', compiled' if args.compile else ''}, torch {torch.__version__}"
    )
    step(model, ids, depth, autocast)  # warm-up (and compilation)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if args.no_profile:
        step(model, ids, depth, autocast)
    else:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step(model, ids, depth, autocast)
            if device.type == "cuda":
                torch.cuda.synchronize()
        report(prof, device, args.rows)
        if args.trace:
            plain = args.trace.removesuffix(".gz")
            prof.export_chrome_trace(plain)
            with open(plain, "rb") as source, gzip.open(args.trace, "wb") as target:
                shutil.copyfileobj(source, target)
            os.remove(plain)
            print(f"trace: {args.trace} ({os.path.getsize(args.trace) / 2**20:.1f} MiB)")
    logits = args.batch * args.seq_len * vocab
    width = 2 if args.dtype == "bf16" else 4
    peak = f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; " if device.type == "cuda" else ""
    print(
        f"{peak}logits {logits * width / 2**30:.2f} GiB ({args.dtype}); the loss upcasts {chunk_rows(vocab)} "
        f"positions at a time to fp32 ({CHUNK_ELEMENTS * 4 / 2**20:.0f} MiB, not {logits * 4 / 2**30:.2f} GiB)"
    )


if __name__ == "__main__":
    main()
