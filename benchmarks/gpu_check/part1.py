"""Part 1, the five-minute check: its steps and limits (device, correctness, decode, train, sweep; the compile
budget they leave room for) and the functions of its steps, each run in a process of its own."""

from __future__ import annotations

import copy
import json
import time

from .common import DEVICE, MISSING_ON_DEVICE, RECIPE, Part, Step, importable
from .context import Context
from .decoding import build_retrofit, graph_use, graphs_text, predicted_compile, random_rows
from .smoke import SMOKE_SCALE, TOY_PARENT

# A cold inductor compile of the TinyLlama-shaped decoder's pieces (prelude, one step, coda + head), the most the
# limits below leave room for: correctness and decode each compile one batch size, besides STARTUP_S and their runs.
COLD_COMPILE_S = 90
STARTUP_S = 15  # a step's imports and model build, before its first compile
DECODE_MARGIN_S = 10  # a decode key's eager and compiled runs besides the compile (16 tokens, twice, at r <= 32)
STEPS = (
    DEVICE,
    Step("correctness", 125, "batch 1: bf16 compiled vs eager vs fp32 decoding of a TinyLlama (4,8,4); its decoding"),
    Step("decode", 120, "batch 32: tokens/s eager and compiled at r = 4, 32 against the weight-read floor"),
    Step("train", 25, "one step of the paper's TinyLlama recipe: tokens/s, MFU, peak memory against the plan"),
    Step("sweep", 10, "a toy model: warm starts and new depths replaying CUDA graphs (on the time left over)"),
)
PART = Part("the five-minute check", STEPS, 300, SMOKE_SCALE)


def step_device(ctx: Context) -> None:
    import platform

    import torch
    import transformers
    from device_peaks import measure

    measured = measure(ctx.device, **ctx.sizes.peaks)
    (ctx.work / "peaks.json").write_text(json.dumps(measured, indent=1))
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if ctx.device.type == "cuda" else None
    missing = [name for name in MISSING_ON_DEVICE if not importable(name)]
    versions = f"python {platform.python_version()}, torch {torch.__version__}"
    versions += f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    ctx.record(
        "device",
        f"{measured['device']}{f', {memory:.0f} GiB' if memory else ''}; {versions}, transformers "
        f"{transformers.__version__}; bf16 matmul {measured['bf16_flops'] / 1e12:.3g} TFLOP/s, copy "
        f"{measured['bandwidth_bytes'] / 1e9:.0f} GB/s (read + write); recurfit dependencies missing here: "
        f"{', '.join(missing) or 'none'}",
        device=measured["device"],
        memory_gib=memory,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformers=transformers.__version__,
        bf16_tflops=measured["bf16_flops"] / 1e12,
        bandwidth_gbs=measured["bandwidth_bytes"] / 1e9,
        missing=missing,
    )


def step_correctness(ctx: Context) -> None:
    import torch

    torch.set_grad_enabled(False)
    check, sizes = ctx.sizes.check, ctx.sizes
    reference = build_retrofit(ctx, sizes.parent, sizes.shape, torch.float32)
    model = copy.deepcopy(reference).to(torch.bfloat16 if sizes.dtype == "bf16" else torch.float32)
    ids = random_rows(ctx, check["batch"], check["prompt"] + check["new"], sizes.parent["vocab_size"])
    compiles = {}  # batch size -> seconds, compiled in this process
    for r in sorted({*check["eager"], *check["compiled"]}):
        ctx.attempt("correctness", f"r = {r}", check_depth, ctx, reference, model, ids, r, compiles)
    del reference
    decode_keys(ctx, model, compiles, lambda batch: batch == check["batch"])  # with the graphs compiled here


# The teacher-forced next-token agreement every compared pair must reach for the correctness step to be ok. bf16
# rounding flips the argmax at near-ties: on an H200 this check's model agreed on 93.8-96.9 % of its tokens
# (docs/results/gpu.md), and a wrong depth, cache slot or stale graph agrees on a share near chance. In fp32 (the CPU
# smoke) two orders of the same sums differ at the last bit only.
AGREEMENT = {"bf16": 0.9, "fp32": 0.99}


def agreements_hold(figures: dict, pairs: list[tuple[str, str]], dtype: str) -> bool:
    """Whether every compared pair (`figures["a_vs_b"]`) agrees on at least AGREEMENT[dtype] of the tokens."""
    return all(figures[f"{a}_vs_{b}"]["agreement"] >= AGREEMENT[dtype] for a, b in pairs)


def check_depth(ctx: Context, reference, model, ids, r: int, compiles: dict) -> None:
    """Teacher-forced decoding at r: the bf16 model eager (and compiled, where its predicted compile fits the time
    left) against the fp32 reference."""
    from decode import teacher_forced

    from recurfit.model.compiled import decoding_cache

    check, sizes, batch = ctx.sizes.check, ctx.sizes, ids.shape[0]
    runs = {"fp32": teacher_forced(reference, ids, check["prompt"], keep_logits=True, num_steps=r)}
    runs["eager"] = teacher_forced(model, ids, check["prompt"], keep_logits=True, num_steps=r)
    pairs = [("eager", "fp32")]
    figures, compile_s, compiled = {}, None, ""
    predicted = predicted_compile(compiles, batch)
    if r in check["compiled"] and predicted is not None and predicted > ctx.seconds_left() - DECODE_MARGIN_S:
        compiled = f"; compiled: not run, its compile (predicted {predicted:.0f} s) does not fit the time left"
    elif r in check["compiled"]:
        before = graph_use(model)
        cache = decoding_cache(model, batch, ids.shape[1], r, compile=sizes.compile)
        start = time.perf_counter()
        runs["compiled"] = teacher_forced(model, ids, check["prompt"], cache=cache, keep_logits=True, num_steps=r)
        compile_s = time.perf_counter() - start - check["new"] * runs["compiled"]["ms_per_token"] / 1e3
        compiles[batch] = max(compiles.get(batch, 0.0), compile_s)
        figures["graph_use"] = graph_use(model, before)
        compiled = f"; compile ≈ {compile_s:.0f} s; {graphs_text(figures['graph_use'])}"
        pairs += [("compiled", "eager"), ("compiled", "fp32")]
    scale = runs["fp32"]["logits"].abs().max().item()
    names = {"fp32": "the fp32 reference", "eager": f"{sizes.dtype} eager", "compiled": f"{sizes.dtype} compiled"}
    parts, bound = [], AGREEMENT[sizes.dtype]
    for a, b in pairs:
        agree = (runs[a]["predictions"] == runs[b]["predictions"]).float().mean().item()
        error = (runs[a]["logits"] - runs[b]["logits"]).abs().max().item()
        figures[f"{a}_vs_{b}"] = {"agreement": agree, "max_logit_error": error}
        below = "" if agree >= bound else f" (below the bound, {bound:.0%})"
        parts.append(f"{names[a]} vs {names[b]}: {agree:.1%} agree{below}, max logit error {error:.3g}")
    tokens = batch * check["new"]
    ctx.record(
        "correctness",
        f"r = {r}, {tokens} teacher-forced tokens (logits up to {scale:.3g}): {'; '.join(parts)}{compiled}",
        ok=not figures.get("graph_use", {}).get("failures") and agreements_hold(figures, pairs, sizes.dtype),
        batch=batch,
        r=r,
        tokens=tokens,
        logit_scale=scale,
        compile_s=compile_s,
        **figures,
    )


def step_decode(ctx: Context) -> None:
    import torch

    torch.set_grad_enabled(False)
    sizes = ctx.sizes
    model = build_retrofit(ctx, sizes.parent, sizes.shape, torch.bfloat16 if sizes.dtype == "bf16" else torch.float32)
    # Nothing compiled in this process yet; the correctness step's compile tells how long one takes.
    earlier = [r["compile_s"] for r in ctx.results("correctness") if r.get("compile_s") is not None]
    decode_keys(ctx, model, {}, lambda batch: batch != sizes.check["batch"], earlier)


def decode_keys(ctx: Context, model, compiles: dict, chosen, earlier=()) -> None:
    """The decode measurement at each key whose batch size is `chosen`, in the keys' order."""
    decode = ctx.sizes.decode
    keys = [(batch, r) for batch, r in decode["keys"] if chosen(batch)]
    if not keys:
        return
    bandwidth = ctx.peaks()["bandwidth_bytes"] / 1e9
    prompts = random_rows(ctx, max(b for b, _ in keys), decode["prompt"], ctx.sizes.parent["vocab_size"])
    for batch, r in keys:
        label = f"batch {batch}, r = {r}"
        ctx.attempt("decode", label, decode_key, ctx, model, prompts[:batch], r, bandwidth, compiles, earlier)


def decode_key(ctx: Context, model, rows, r: int, bandwidth: float, compiles: dict, earlier=()) -> None:
    """Free-running greedy tokens/s at (batch, r), eager and (when its compile fits the time left) compiled."""
    from decode import decode_ms, weight_floor_ms

    sizes, decode, batch = ctx.sizes, ctx.sizes.decode, rows.shape[0]
    floor_ms = weight_floor_ms(model, bandwidth, r)
    predicted = predicted_compile(compiles, batch, earlier)
    affordable = predicted is None or predicted < ctx.seconds_left() - DECODE_MARGIN_S
    before = graph_use(model)
    times = decode_ms(model, rows, r, decode["new"], decode["repeats"], compile=sizes.compile if affordable else False)
    rate = {mode: batch * 1e3 / times[f"{mode}_ms"] for mode in ("eager", "compiled") if f"{mode}_ms" in times}
    text = (
        f"batch {batch}, r = {r}: eager {rate['eager']:.1f} tokens/s ({times['eager_ms']:.1f} ms/step); "
        f"weight-read floor {floor_ms:.2f} ms/step ({batch * 1e3 / floor_ms:.0f} tokens/s at "
        f"{bandwidth:.0f} GB/s)"
    )
    use = None
    if "compiled" in rate:
        compiles[batch] = max(compiles.get(batch, 0.0), times["compile_s"])
        use = graph_use(model, before)
        text += (
            f"; compiled {rate['compiled']:.1f} tokens/s, {times['compiled_ms'] / floor_ms:.2f}× the floor, "
            f"{times['compiled_ms'] / times['eager_ms']:.2f}× eager's time, same tokens as eager: "
            f"{'yes' if times['same_tokens'] else 'no'}, {times['graphs']} graph(s) traced, compile "
            f"{times['compile_s']:.0f} s; {graphs_text(use)}"
        )
    else:
        text += (
            f"; compiled: not run, its compile (predicted {predicted:.0f} s from the compiles measured before) "
            f"does not fit the {ctx.seconds_left():.0f} s left"
        )
    ctx.record(
        "decode",
        text,
        ok=not (use or {}).get("failures"),
        batch=batch,
        r=r,
        floor_ms=floor_ms,
        eager_tokens_s=rate["eager"],
        compiled_tokens_s=rate.get("compiled"),
        predicted_compile_s=predicted,
        graph_use=use,
        **times,
    )


def step_train(ctx: Context) -> None:
    from contextlib import nullcontext

    import torch
    from train_step import optimizer_step
    from transformers import AutoModelForCausalLM, LlamaConfig

    import recurfit
    from recurfit.model.accounting import count_parameters, training_flops_per_token
    from recurfit.train import load_config
    from recurfit.train.memory import gb
    from recurfit.train.memory_fit import fitting_micro, planner, visible_device_memory
    from recurfit.train.metrics import PEAK_FLOPS
    from recurfit.train.optim import build_optimizers

    sizes, train = ctx.sizes, ctx.sizes.train
    overrides = ["out=unused", "data.phases=[{sources: [unused]}]", "data.validation=[unused]", *train["overrides"]]
    config = load_config(RECIPE, overrides)
    torch.manual_seed(0)
    with ctx.device:
        parent = AutoModelForCausalLM.from_config(LlamaConfig(**sizes.parent), dtype=torch.float32)
        model = recurfit.retrofit(parent, tuple(config.model.shape), adapter_init=config.model.adapter_init)
    del parent
    model.train()
    seq_len = train["seq_len"]
    memory = visible_device_memory() or train["memory"]
    plan_of = planner(config, model, seq_len, world=1, device=ctx.device.type)
    micro = fitting_micro(plan_of, config, 1, memory)
    if micro is None:
        ctx.record("train", f"no micro-batch of the recipe fits {memory / 1e9:.0f} GB by the memory plan", ok=False)
        return
    plan = plan_of(micro)
    k = config.depth.backprop_depth
    depth = (config.depth.mean_recurrence - k, k)
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16) if plan.autocast else nullcontext()
    optimizers = build_optimizers(model, config.optimizer)
    ids = torch.randint(0, sizes.parent["vocab_size"], (micro, seq_len + 1), device=ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clip = config.optimizer.grad_clip
    optimizer_step(model, ids, autocast, depth, optimizers, clip)  # warm-up: the optimizers' states, untimed
    ctx.synchronize()
    start = time.perf_counter()
    for _ in range(train["steps"]):
        optimizer_step(model, ids, autocast, depth, optimizers, clip)
    ctx.synchronize()
    seconds = (time.perf_counter() - start) / train["steps"]
    tokens_s = micro * seq_len / seconds
    flops = training_flops_per_token(count_parameters(model), depth) * tokens_s  # as recurfit train's log counts
    peaks = ctx.peaks()
    peak_flops = peaks["bf16_flops"]
    spec = next((peak for name, peak in PEAK_FLOPS.items() if name in peaks["device"]), None)
    spec_text = f" ({flops / spec:.1%} of the spec sheet's {spec / 1e12:.0f} TFLOP/s)" if spec else ""
    measured = torch.cuda.max_memory_allocated() if ctx.device.type == "cuda" else None
    memory_text = (
        f"peak memory {gb(measured)} against the plan's {gb(plan.peak)} "
        f"(plan / measured {plan.peak / measured:.3f}; target 0.85-1.15)"
        if measured
        else f"the plan's peak {gb(plan.peak)} (no allocator statistics on a CPU)"
    )
    ctx.record(
        "train",
        f"{RECIPE.name} at (n, k) = {depth}, micro-batch {micro} × {seq_len} (the largest the plan fits in "
        f"{memory / 1e9:.0f} GB), {'bf16 autocast' if plan.autocast else 'fp32'}: {seconds:.2f} s/step, "
        f"{tokens_s:,.0f} tokens/s, MFU {flops / peak_flops:.1%} of the measured bf16 peak{spec_text}; {memory_text}",
        micro=micro,
        seq_len=seq_len,
        depth=depth,
        seconds_per_step=seconds,
        tokens_s=tokens_s,
        mfu=flops / peak_flops,
        mfu_spec=flops / spec if spec else None,
        peak_bytes=measured,
        plan_bytes=plan.peak,
    )


def step_sweep(ctx: Context) -> None:
    import torch
    from torch._dynamo.utils import counters

    torch.set_grad_enabled(False)
    sweep, backend = ctx.sizes.sweep, ctx.sizes.compile
    # fp32: compiled and eager tokens must then be equal, so a difference is a defect, not a near-tie.
    model = build_retrofit(ctx, TOY_PARENT, ctx.sizes.sweep_shape, torch.float32, perturb=0.5)
    rows = random_rows(ctx, sweep["batch"], sweep["prompt"] + 3, TOY_PARENT["vocab_size"])

    def greedy(rows, r, compile, **kwargs):
        settings = dict(max_new_tokens=sweep["new"], do_sample=False, pad_token_id=0, num_steps=r)
        return model.generate(rows, compile=compile, **settings, **kwargs)

    def compiled_key(label: str, rows, r: int, **kwargs) -> None:
        graphs, before, start = counters["stats"]["unique_graphs"], graph_use(model), time.perf_counter()
        compiled = greedy(rows, r, backend, **kwargs)
        seconds = time.perf_counter() - start
        use = graph_use(model, before)
        same = torch.equal(compiled, greedy(rows, r, False, **kwargs))
        traced = counters["stats"]["unique_graphs"] - graphs
        ctx.record(
            "sweep",
            f"{label}: {seconds:.1f} s (compile and decode), {traced} graph(s) traced, tokens equal to eager: "
            f"{'yes' if same else 'no'}; {graphs_text(use)}",
            ok=same and not use["failures"],
            key=label,
            seconds=seconds,
            graphs=traced,
            same_tokens=same,
            graph_use=use,
        )

    def attempt(label: str, rows, r: int, **kwargs) -> None:  # an error is the finding: recorded, the sweep goes on
        ctx.attempt("sweep", label, compiled_key, label, rows, r, **kwargs)

    batch = sweep["batch"]
    for length in (sweep["prompt"], sweep["prompt"] + 3):  # a second prompt length: the same graphs expected
        attempt(f"warm start, batch {batch}, r = 4, prompt {length}", rows[:, :length], 4, warm_start=True)
    for r in sweep["depths"]:  # new depths at a compiled batch size: no new trace, a capture each
        attempt(f"batch {batch}, r = {r}", rows[:, : sweep["prompt"]], r)


STEP_FUNCTIONS = {
    "device": step_device,
    "correctness": step_correctness,
    "decode": step_decode,
    "train": step_train,
    "sweep": step_sweep,
}
