"""The five-minute GPU check: the questions that matter most, in order, each step its own process and time limit.

On a lent GPU machine (torch and transformers as installed there, no network), from the repository root:

    python benchmarks/gpu_check.py --out "$OUT"        # the whole command; < 5 min on an H100
    python benchmarks/gpu_check.py --plan              # the steps in order, each one's limit, the total
    python benchmarks/gpu_check.py --cpu-smoke --out DIR   # CI: every step at toy sizes on the CPU

Steps, most important first (`--plan` gives their limits):
1. device: versions, the GPU, recurfit's dependencies missing there; the measured bf16 matmul peak and copy
   bandwidth (benchmarks/device_peaks.py), which the floors and MFU below use.
2. correctness: a TinyLlama-shaped (4, 8, 4) retrofit built on the device from random weights, its adapter
   perturbed from [0 | I] so that depths differ, s_0 = 0 so that every run draws the same state; teacher-forced
   on random tokens at batch 1: bf16 eager and bf16 compiled decoding against the fp32 eager reference (and
   compiled against eager): next-token agreement and the largest logit error, per r; then batch 1's decode lines
   (step 3's measurement), with the graphs this process compiled.
3. decode: the same model in bf16, free-running greedy at r = 4 and 32, batch 32 (batch 1 in step 2): tokens/s
   eager and compiled, against the weight-read floor (the bytes one token reads, every layer once per call, at the
   measured bandwidth).
4. train: one optimizer step of the paper's TinyLlama recipe (recipes/paper/tinyllama-484-fineweb.yaml: (4, 8, 4),
   r̄ = 32, k̄ = 8, Muon) at (n, k) = (24, 8), micro-batch × 1,024 tokens where the micro-batch is the largest the
   memory plan fits on this device: tokens/s, MFU against the measured bf16 peak, peak memory against the plan.
5. sweep: a toy model's compiled decoding with warm starts (each token's recurrence from the previous token's final
   state) at two prompt lengths, then at r = 1-4 from s_0, against eager; a line each.

Every compiled line says whether CUDA graphs replayed: the tokens captured, replayed and run without a graph, and
why a capture failed (recurfit.model.compiled.graph_counts). vLLM is not checked here (the device has none, and
an engine's start would not fit): vLLM on CUDA is covered by the vLLM tests' V2 model runner on the CPU.

Each step appends its results to OUT/results.jsonl as it measures them, one JSON object per line, each with a
sentence under "text"; after each step the runner adds the step's status line and rewrites OUT/summary.md (the
sentences, in order). A step killed at its limit keeps the lines it wrote; OUT/log.txt holds every step's output.

The compile budget. Decoding compiles per batch size: a token's prelude, one recurrence step and its coda + head
(recurfit/model/compiled.py), so a new r at a compiled batch size compiles nothing (its first tokens are captured as
a CUDA graph, in well under a second). Each batch size is compiled in one process only: batch 1 in the correctness
step, batch 32 in the decode step. A key is compiled only where its predicted compile fits the time its step has
left (a line says when it does not): none at a batch size this process compiled, else the longest compile measured
(at another batch size or in another process: the same graphs at other shapes); a first compile, with nothing to go
by, is tried. The limits leave room for a cold inductor compile of the TinyLlama-shaped pieces of up to
COLD_COMPILE_S in each of the two steps; they are estimates until a GPU run measures it. The sweep uses a toy
model, as its questions (warm starts and new depths replaying the captured graphs) do not depend on size; its own
limit covers no compile, so it runs on the seconds the steps before it left unused (each step may use them).

`--cpu-smoke` runs every step at toy sizes on the CPU, compiled with inductor as on the GPU (about a minute on 2
cores; no CUDA graphs on a CPU), with the packages the device lacks hidden (gpu_suite.py's MISSING_ON_DEVICE), so
that CI fails here if a step stops running; scripts/check-device.sh runs it under the GPU machine's torch and
transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from gpu_suite import MISSING_ON_DEVICE, REPO, TOY_LLAMA, importable, peaks, step_environment

RECIPE = REPO / "recipes" / "paper" / "tinyllama-484-fineweb.yaml"
# The smoke's parent, and the sweep's everywhere: a toy Llama.
TOY_PARENT = dict(
    TOY_LLAMA,
    vocab_size=256,
    num_hidden_layers=4,
    max_position_embeddings=512,
    num_attention_heads=2,
    num_key_value_heads=1,
)


@dataclass(frozen=True)
class Step:
    name: str
    seconds: int  # its time limit on an H100
    what: str


# A cold inductor compile of the TinyLlama-shaped decoder's pieces (prelude, one step, coda + head), the most the
# limits below leave room for: correctness and decode each compile one batch size, besides STARTUP_S and their runs.
COLD_COMPILE_S = 90
STARTUP_S = 15  # a step's imports and model build, before its first compile
DECODE_MARGIN_S = 10  # a decode key's eager and compiled runs besides the compile (16 tokens, twice, at r <= 32)
STEPS = (
    Step("device", 15, "versions, the GPU, measured bf16 matmul peak and copy bandwidth"),
    Step("correctness", 125, "batch 1: bf16 compiled vs eager vs fp32 decoding of a TinyLlama (4,8,4); its decoding"),
    Step("decode", 125, "batch 32: tokens/s eager and compiled at r = 4, 32 against the weight-read floor"),
    Step("train", 25, "one step of the paper's TinyLlama recipe: tokens/s, MFU, peak memory against the plan"),
    Step("sweep", 10, "a toy model: warm starts and new depths replaying CUDA graphs (on the time left over)"),
)
SMOKE_SCALE = 3  # the smoke's limits: a shared CI machine's CPU is slow to import and trace


@dataclass(frozen=True)
class Sizes:
    """What each step runs: TinyLlama-shaped on the GPU, toy sizes in the CPU smoke."""

    device: str
    dtype: str  # decoding's
    parent: dict  # LlamaConfig of the parent (random weights)
    shape: tuple[int, int, int]
    compile: bool  # generate(compile=True): inductor, with each token captured as a CUDA graph on a GPU
    peaks: dict  # device_peaks.measure's sizes
    check: dict  # correctness: batch, prompt, new tokens, eager and compiled depths
    decode: dict  # (batch, r) keys in order, prompt, new tokens, repeats
    train: dict  # seq_len, timed steps, config overrides, device memory where none is visible (bytes)
    sweep: dict = field(default_factory=lambda: dict(batch=2, depths=(1, 2, 3, 4), prompt=8, new=6))
    sweep_shape: tuple[int, int, int] = (1, 1, 1)


def full_sizes() -> Sizes:
    from train_step import TINYLLAMA

    return Sizes(
        device="cuda",
        dtype="bf16",
        parent=TINYLLAMA,
        shape=(4, 8, 4),
        compile=True,
        peaks=dict(size=8192, copy_gib=2.0, repeats=10),
        # One compile at r = 1; r = 4 and 32 run the same graphs.
        check=dict(batch=1, prompt=32, new=32, eager=(1, 4, 32), compiled=(1, 4, 32)),
        # The check's batch size is decoded in its process (its graphs compiled there), the others in the decode
        # step: batch 32's compile first, at r = 32, then r = 4 with the same graphs.
        decode=dict(keys=((1, 4), (1, 32), (32, 32), (32, 4)), prompt=128, new=16, repeats=2),
        train=dict(seq_len=1024, steps=2, overrides=(), memory=None),
    )


def smoke_sizes() -> Sizes:
    return Sizes(
        device="cpu",
        dtype="fp32",
        parent=TOY_PARENT,
        shape=(1, 2, 1),
        compile=True,  # inductor, as on the GPU (without CUDA graphs on a CPU)
        peaks=dict(size=256, copy_gib=0.01, repeats=2),
        check=dict(batch=1, prompt=8, new=6, eager=(1, 2, 4), compiled=(1, 2, 4)),
        decode=dict(keys=((1, 2), (1, 4), (2, 4), (2, 2)), prompt=8, new=6, repeats=1),
        train=dict(
            seq_len=32,
            steps=1,
            overrides=(
                "model.shape=[1,2,1]",
                "batch.micro=1",
                "batch.global=2",
                "depth.mean_recurrence=4",
                "depth.backprop_depth=2",
            ),
            memory=2 * 10**9,
        ),
    )


# ---------------------------------------------------------------- the runner


def plan_lines() -> list[str]:
    lines = [f"{i}. {step.name:<12} {step.seconds:>4} s  {step.what}" for i, step in enumerate(STEPS, 1)]
    note = "each step may also use the seconds earlier steps left unused; the total holds"
    return [*lines, note, f"total: {sum(step.seconds for step in STEPS)} s"]


def run_steps(out: Path, work: Path, smoke: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "peaks.json").unlink(missing_ok=True)  # a step's MFU must not use an earlier run's peak
    results = out / "results.jsonl"
    results.write_text("")
    append(results, step="run", status="started", smoke=smoke, commit=commit(), date=time.strftime("%Y-%m-%d %H:%M"))
    failed, scale, begin = [], SMOKE_SCALE if smoke else 1, time.monotonic()
    for i, step in enumerate(STEPS):
        # Its own limit and what the steps before it left unused: each step ends by the sum of the limits so far.
        limit = int(sum(s.seconds for s in STEPS[: i + 1]) * scale - (time.monotonic() - begin))
        start = time.monotonic()
        status = run_step(step, limit, out, work, smoke)
        seconds = time.monotonic() - start
        append(
            results,
            step=step.name,
            status=status,
            seconds=round(seconds, 1),
            limit=limit,
            text=f"{step.name}: {status} in {seconds:.0f} s (limit {limit} s)",
        )
        print(f"{step.name:<12} {status:<30} {seconds:5.0f} s", flush=True)
        write_summary(results, out / "summary.md")
        if status != "ok":
            failed.append(step.name)
    print(f"results: {results}; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


def run_step(step: Step, limit: int, out: Path, work: Path, smoke: bool) -> str:
    """The step in a process (and session) of its own, killed with its children at `limit` seconds."""
    env = {**step_environment(work, smoke), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    argv = [sys.executable, __file__, "--step", step.name, "--out", out, "--work", work]
    argv += ["--deadline", f"{time.time() + limit:.1f}", *(["--cpu-smoke"] if smoke else [])]
    with open(out / "log.txt", "a") as log:
        log.write(f"\n===== {step.name} (limit {limit} s)\n")
        log.flush()
        process = subprocess.Popen(
            [str(a) for a in argv], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # its compile workers too
            process.wait()
            return f"timed out after {limit} s"
    return "ok" if code == 0 else f"failed (exit {code})"


def append(path: Path, **fields) -> None:
    with open(path, "a") as file:
        file.write(json.dumps(fields) + "\n")


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_summary(results: Path, summary: Path) -> None:
    lines = ["# GPU check", ""]
    for record in read_results(results):
        if "text" in record:
            lines.append(f"- {record['text']}")
    summary.write_text("\n".join(lines) + "\n")


def commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:  # no git
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


# ---------------------------------------------------------------- the steps (each runs in its own process)


class Context:
    """What a step knows: its sizes, where results go, the measured peaks, and its deadline."""

    def __init__(self, out: Path, work: Path, smoke: bool, deadline: float):
        import torch

        self.out, self.work, self.smoke, self.deadline = out, work, smoke, deadline
        self.sizes = smoke_sizes() if smoke else full_sizes()
        self.device = torch.device(self.sizes.device)
        self.ok = True

    def record(self, step: str, text: str, ok: bool = True, **figures) -> None:
        """One result line, written at once (a step killed later keeps it)."""
        self.ok &= ok
        append(self.out / "results.jsonl", step=step, ok=ok, text=text, **figures)
        print(text, flush=True)

    def attempt(self, step: str, label: str, measure, *args, **kwargs) -> None:
        """`measure(*args, **kwargs)`, which records its own lines; an error is recorded as its result (the whole
        traceback goes to the log), and the step goes on to its next measurement."""
        try:
            measure(*args, **kwargs)
        except Exception as error:
            message = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
            traceback.print_exc()
            self.record(step, f"{label}: failed, {message}", ok=False, key=label, error=message)

    def results(self, step: str) -> list[dict]:
        """The result lines an earlier step wrote."""
        return [r for r in read_results(self.out / "results.jsonl") if r["step"] == step and "status" not in r]

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def peaks(self) -> dict:
        """The device step's measurements; measured here (smaller) if it did not run."""
        if (self.work / "peaks.json").exists():
            return peaks(self.work)
        from device_peaks import measure

        return measure(self.device, **{**self.sizes.peaks, "size": 2048, "copy_gib": 0.25, "repeats": 3})

    def synchronize(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()


def build_retrofit(ctx: Context, parent: dict, shape, dtype, perturb: float = 0.1):
    """A retrofit of a random Llama `parent` built on the device, adapter perturbed, s_0 = 0, in eval mode."""
    import torch
    from decode import perturb_adapter
    from transformers import AutoModelForCausalLM, LlamaConfig

    import recurfit

    torch.manual_seed(0)
    with ctx.device:
        model = recurfit.retrofit(AutoModelForCausalLM.from_config(LlamaConfig(**parent), dtype=torch.float32), shape)
    if perturb:
        perturb_adapter(model, perturb)
    model.config.state_init_std = 0.0  # every run, eager or compiled, starts from the same state
    return model.eval().to(dtype)


def random_rows(ctx: Context, batch: int, length: int, vocab: int):
    from decode import passages

    return passages(None, batch, length, vocab_size=vocab).to(ctx.device)


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
    parts = []
    for a, b in pairs:
        agree = (runs[a]["predictions"] == runs[b]["predictions"]).float().mean().item()
        error = (runs[a]["logits"] - runs[b]["logits"]).abs().max().item()
        figures[f"{a}_vs_{b}"] = {"agreement": agree, "max_logit_error": error}
        parts.append(f"{names[a]} vs {names[b]}: {agree:.1%} agree, max logit error {error:.3g}")
    tokens = batch * check["new"]
    ctx.record(
        "correctness",
        f"r = {r}, {tokens} teacher-forced tokens (logits up to {scale:.3g}): {'; '.join(parts)}{compiled}",
        ok=not figures.get("graph_use", {}).get("failures"),
        batch=batch,
        r=r,
        tokens=tokens,
        logit_scale=scale,
        compile_s=compile_s,
        **figures,
    )


def graph_use(model, before: dict | None = None) -> dict:
    """The tokens `model`'s compiled decoding captured as CUDA graphs, replayed and ran without one (since
    `before`), and why captures failed."""
    from recurfit.model.compiled import graph_counts

    now = graph_counts(model)
    failures = {str(key): why for key, why in now["failures"].items()}
    if before is None:
        return {**now, "failures": failures}
    counts = {name: now[name] - before[name] for name in ("ran", "captured", "replayed")}
    return {**counts, "failures": {key: why for key, why in failures.items() if key not in before["failures"]}}


def graphs_text(use: dict) -> str:
    text = (
        f"CUDA graphs: {use['captured']} captured, {use['replayed']} token(s) replayed, {use['ran']} run "
        "without a graph"
    )
    failed = "; ".join(f"{key}: {why}" for key, why in use["failures"].items())
    return text + (f"; captures failed: {failed}" if failed else "")


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


def predicted_compile(compiles: dict, batch: int, earlier=()) -> float | None:
    """Seconds that compiling decoding at `batch` will take in this process (None: nothing to go by), from the
    compiles measured in it (batch size -> seconds) and in `earlier` steps: none at a batch size compiled here (a
    new r runs the same graphs, captured anew in well under a second); else as long as the longest measured (the
    same graphs at other shapes, or in another process)."""
    if batch in compiles:
        return 0.0
    measured = [*compiles.values(), *earlier]
    return max(measured) if measured else None


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


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="results folder ($OUT on the device machine)")
    parser.add_argument("--plan", action="store_true", help="print the steps, their time limits and the total")
    parser.add_argument("--cpu-smoke", action="store_true", help="every step at toy sizes on the CPU (CI)")
    parser.add_argument(
        "--work", type=Path, help="scratch folder (default: recurfit-gpu-check in the temporary directory)"
    )
    parser.add_argument("--step", choices=list(STEP_FUNCTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plan:
        print("\n".join(plan_lines()))
        return 0
    if args.out is None:
        parser.error("--out is required: the folder the results go to ($OUT on the device machine)")
    work = args.work or Path(tempfile.gettempdir()) / "recurfit-gpu-check"
    if args.step:
        ctx = Context(args.out, work, args.cpu_smoke, args.deadline or float("inf"))
        STEP_FUNCTIONS[args.step](ctx)
        return 0 if ctx.ok else 1
    if not args.cpu_smoke and not cuda_visible():
        parser.error("no CUDA device is visible; on a CPU, --cpu-smoke runs the steps at toy sizes")
    return run_steps(args.out, work, args.cpu_smoke)


def cuda_visible() -> bool:
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True)
    return done.stdout.strip() == b"True"


if __name__ == "__main__":
    sys.exit(main())
