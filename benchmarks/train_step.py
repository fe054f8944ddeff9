"""Training-step cost and activation memory of a retrofitted model against its parent (issue 3 benchmarks).

    python benchmarks/train_step.py                       # embedded SmolLM2-135M, (4,8,4), CPU
    python benchmarks/train_step.py --parent tinyllama --device cuda --dtype bf16 [--compile]   # GPU

1. Step cost: forward+backward time at fixed (n, k) over the parent's time on the same tokens, divided by
   the FLOP ratio the accounting predicts. ≈ 1 means the recurrence machinery costs nothing beyond its FLOPs.
   Two predictions are printed: the paper's non-embedding FLOPs, and the same plus the LM head (which both
   models pay equally, so it pulls the measured ratio towards 1).
2. Memory: bytes saved for backward (and CUDA peak) at k = 4, n ∈ {0, 8, 28}: no-grad steps keep nothing,
   so these must be flat.
3. Throughput (GPU): tokens/s and MFU of training steps at the sampled depth of mean recurrence 32.
4. Optimizer (`--optimizer`): the optimizer step (Muon in each precision, batched and one matrix at a time;
   AdamW) beside forward+backward: time, FLOPs (Newton–Schulz: 5 iterations of 4m²n + 2m³ per m×n matrix,
   m ≤ n), GFLOP/s against forward+backward's, and share of an optimizer step of `--step-tokens` tokens at
   `--step-depth` (forward+backward time predicted from the rate measured here), e.g.

    python benchmarks/train_step.py --shape 6,12,6 --batch 2 --seq-len 256 --steps 2,2 --step-tokens 1024 \
        --sections optimizer                                                      # the demo's step
    python benchmarks/train_step.py --parent tinyllama --batch 1 --seq-len 256 --steps 0,2 \
        --step-tokens 1048576 --step-depth 24,8 --sections optimizer              # the paper's TinyLlama step

Times are medians of several repeats measured in this one run (the machine is noisy).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import recurfit
from recurfit.model.accounting import count_parameters, training_flops_per_token
from recurfit.model.loading import load_model
from recurfit.model.sampling import sample_depth
from recurfit.train import optim
from recurfit.train.config import OptimizerConfig
from recurfit.train.head import final_hidden_states, head_losses
from recurfit.train.metrics import peak_flops
from recurfit.train.optim import (
    BatchedMuon,
    build_optimizers,
    cpu_has_native_bf16,
    global_grad_norm,
    newton_schulz_flops,
)

TINYLLAMA = dict(  # TinyLlama-1.1B's public config; random weights, no download
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def parent_model(name: str) -> torch.nn.Module:
    if name == "tinyllama":
        return AutoModelForCausalLM.from_config(LlamaConfig(**TINYLLAMA), dtype=torch.float32)
    return load_model(None if name == "embedded" else name, dtype=torch.float32)


def training_loss(model, rows: torch.Tensor, autocast, **kwargs) -> torch.Tensor:
    """The loss as `recurfit train` computes it: the forward on `rows[:, :-1]` under `autocast` up to the final
    hidden states, then the head's float32 cross-entropy against `rows[:, 1:]` a chunk of positions at a time
    (transformers' loss would upcast every logit at once, which training never does)."""
    with autocast:
        hidden, weight = final_hidden_states(model, model, rows[:, :-1], **kwargs)
        return head_losses(hidden[-1], weight, rows[:, 1:])[0]


def optimizer_step(model, ids, autocast, depth, optimizers, clip: float | None = None) -> None:
    """Forward, backward (gradients clipped to a global norm of `clip`, as training does) and a step of every
    optimizer on one batch at `depth` (n, k)."""
    training_loss(model, ids, autocast, num_steps=depth).backward()
    if clip:
        global_grad_norm(model.parameters(), clip)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def step_seconds(model, ids, num_steps, autocast, repeats: int) -> float:
    kwargs = {} if num_steps is None else {"num_steps": num_steps}
    times = []
    for _ in range(repeats + 1):  # the first run warms up (and compiles)
        start = time.perf_counter()
        loss = training_loss(model, ids, autocast, **kwargs)
        loss.backward()
        if ids.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def saved_bytes(model, ids, num_steps, autocast) -> int:
    """Bytes of activations autograd keeps for backward during one forward (storages counted once; the
    weights, which backward also references, are not activations and are left out)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(tensor):
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = training_loss(model, ids, autocast, num_steps=num_steps)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent", default="embedded", help="embedded | tinyllama (random weights) | a folder")
    parser.add_argument("--shape", default="4,8,4")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", default="4,4", help="fixed (n, k) for the step-cost ratio")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument("--attn", default=None, help="attention implementation, e.g. sdpa or flash_attention_2")
    parser.add_argument("--throughput-steps", type=int, default=0, help="GPU: time this many sampled-depth steps")
    parser.add_argument(
        "--sections", default="step,memory", help="comma-separated: step, memory, optimizer (default: step,memory)"
    )
    parser.add_argument("--step-tokens", type=int, default=None, help="tokens per optimizer step (default: one batch)")
    parser.add_argument("--step-depth", default=None, help="(n, k) of the optimizer step's tokens (default: --steps)")
    parser.add_argument("--unbatched", action="store_true", help="also time Muon one matrix at a time")
    parser.add_argument(
        "--torch-muon", action="store_true", help="also time bfloat16 Muon on a CPU without native bf16 (very slow)"
    )
    args = parser.parse_args()
    sections = set(args.sections.split(","))

    device = torch.device(args.device)
    shape = tuple(int(x) for x in args.shape.split(","))
    n, k = (int(x) for x in args.steps.split(","))
    parent = parent_model(args.parent)
    if args.attn:
        parent.config._attn_implementation = args.attn
    model = recurfit.retrofit(parent, shape).to(device).train()
    parent = parent.to(device).train()
    if args.attn:
        model.set_attn_implementation(args.attn)
    if args.compile:
        for module in [*model.modules(), *parent.modules()]:
            if type(module).__name__.endswith("DecoderLayer"):
                module.compile()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    # One token more per row: the inputs are its first seq_len tokens, the targets its last (as in training).
    ids = torch.randint(0, parent.config.vocab_size, (args.batch, args.seq_len + 1), device=device)
    tokens = args.batch * args.seq_len
    print(
        f"parent {args.parent} ({parent.config.num_hidden_layers} layers), shape {shape}, {args.batch}×{args.seq_len} "
        f"tokens, {device}, {args.dtype}{', compiled' if args.compile else ''}, torch {torch.__version__}"
    )

    if "step" not in sections and "memory" not in sections:
        del parent  # the optimizer section needs only the retrofit: room for a TinyLlama-sized one on a CPU
        optimizer_costs(model, ids, (n, k), autocast, args)
        return
    if "optimizer" in sections:
        optimizer_costs(model, ids, (n, k), autocast, args)

    # 1. step cost
    t_parent = step_seconds(parent, ids, None, autocast, args.repeats)
    t_model = step_seconds(model, ids, (n, k), autocast, args.repeats)
    counts_model, counts_parent = count_parameters(model), count_parameters(parent)
    predicted = training_flops_per_token(counts_model, (n, k)) / training_flops_per_token(counts_parent, (0, 1))
    head = 6 * parent.config.vocab_size * parent.config.hidden_size
    predicted_head = (training_flops_per_token(counts_model, (n, k)) + head) / (
        training_flops_per_token(counts_parent, (0, 1)) + head
    )
    measured = t_model / t_parent
    print(
        f"\nstep time: parent {t_parent * 1e3:.1f} ms, retrofit at (n,k)=({n},{k}) {t_model * 1e3:.1f} ms → "
        f"measured ratio {measured:.3f}"
    )
    print(f"predicted FLOP ratio: {predicted:.3f} (non-embedding), {predicted_head:.3f} (with the LM head)")
    print(
        f"cost over FLOPs: {measured / predicted:.3f} (non-embedding), {measured / predicted_head:.3f} (with head)  "
        "— ≤ 1.1 means no overhead beyond FLOPs"
    )

    # 2. memory at k = 4
    if "memory" not in sections:
        return
    print("\nactivation memory at k=4:")
    for n_free in (0, 8, 28):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        saved = saved_bytes(model, ids, (n_free, 4), autocast)
        peak = f", CUDA peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if device.type == "cuda" else ""
        print(f"  n={n_free:>2}: saved for backward {saved / 2**20:8.1f} MiB{peak}")

    # 3. throughput at the sampled depth (GPU)
    if args.throughput_steps:
        optimizers = build_optimizers(model, OptimizerConfig())  # recurfit train's default: Muon and AdamW
        generator = torch.Generator().manual_seed(0)
        depths = [sample_depth(32, 8, generator) for _ in range(args.throughput_steps + 2)]

        for depth in depths[:2]:  # warm-up: compilation and the optimizers' states, untimed
            optimizer_step(model, ids, autocast, depth, optimizers)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, flops = time.perf_counter(), 0.0
        for depth in depths[2:]:
            optimizer_step(model, ids, autocast, depth, optimizers)
            flops += tokens * training_flops_per_token(counts_model, depth)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = peak_flops(device)
        mfu = f", MFU {flops / seconds / peak:.1%}" if peak else ""
        print(f"\nthroughput at mean recurrence 32: {tokens * args.throughput_steps / seconds:,.0f} tokens/s{mfu}")


def optimizer_seconds(model, optimizer, repeats: int) -> float:
    """Median time of `optimizer.step()` on the gradients the model holds (the first step, which creates the
    state, is not counted)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        optimizer.step()
        if next(model.parameters()).is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def optimizer_costs(model, ids, num_steps, autocast, args) -> None:
    """The optimizer step beside forward+backward: time, FLOPs, GFLOP/s and share of an optimizer step."""
    device = ids.device
    counts = count_parameters(model)
    head = 6 * model.config.vocab_size * model.config.hidden_size  # the LM head, which the step also runs

    def step_flops(tokens, depth):
        return tokens * (training_flops_per_token(counts, depth) + head)

    tokens = args.batch * args.seq_len
    t_forward_backward = step_seconds(model, ids, num_steps, autocast, args.repeats)
    rate = step_flops(tokens, num_steps) / t_forward_backward
    step_tokens = args.step_tokens or tokens
    step_depth = tuple(int(x) for x in args.step_depth.split(",")) if args.step_depth else num_steps
    t_step = step_flops(step_tokens, step_depth) / rate
    print(
        f"\noptimizer step against forward+backward ({device}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, native bf16 matmul: {cpu_has_native_bf16()}):\n"
        f"  forward+backward of {tokens:,} tokens at (n,k)={num_steps}: {t_forward_backward:.2f} s, "
        f"{rate / 1e9:.0f} GFLOP/s (with the LM head); an optimizer step of {step_tokens:,} tokens at "
        f"(n,k)={step_depth}: {t_step:.2f} s predicted at that rate"
    )
    loss = training_loss(model, ids, autocast, num_steps=num_steps)
    loss.backward()  # gradients for the optimizers to step on, kept for every row
    arms = [("Muon, float32", dict(muon_dtype="float32"), None)]
    if args.unbatched:
        arms.append(("Muon, float32, one matrix at a time", dict(muon_dtype="float32"), 1))
    if device.type == "cuda" or cpu_has_native_bf16() or args.torch_muon:
        arms.append(("Muon, bfloat16 (= torch.optim.Muon)", dict(muon_dtype="bfloat16"), None))
    arms.append(("AdamW", dict(name="adamw"), None))
    print(f"  {'optimizer':<38} {'time':>8} {'GFLOP':>8} {'GFLOP/s':>8} {'vs f+b':>7} {'share of step':>14}")
    batch_elements = optim.NS_BATCH_ELEMENTS
    for name, settings, chunk in arms:
        optimizers = build_optimizers(model, OptimizerConfig(**settings))
        optim.NS_BATCH_ELEMENTS = chunk or batch_elements
        seconds = sum(optimizer_seconds(model, o, args.repeats) for o in optimizers)
        optim.NS_BATCH_ELEMENTS = batch_elements
        muon = next((o for o in optimizers if isinstance(o, BatchedMuon)), None)
        flops = newton_schulz_flops(muon) if muon else 0.0
        speed = f"{flops / seconds / 1e9:8.0f} {flops / seconds / rate:7.0%}" if flops else f"{'':8} {'':7}"
        print(f"  {name:<38} {seconds:7.2f}s {flops / 1e9:8.1f} {speed} {seconds / (seconds + t_step):14.1%}")
        del optimizers
    model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
