"""Decoding with the step-aware KV cache: speed, cache memory, and the quality and speed of each decoding mode.

    python benchmarks/decode.py [MODEL]          # default: the embedded SmolLM2 retrofitted to (4,8,4)
    python benchmarks/decode.py --parent tinyllama --device cuda --dtype bf16 --sequences 32   # GPU check

Teacher-forced decoding of English passages (embedded:prose): each sequence's first `--prompt` tokens are a
prefill, then the next `--decode` tokens are fed one at a time through the cache, scoring each prediction.
1. Speed: milliseconds per decoded token at r ∈ {1, 4, 16, 32}, and the parent's, against the effective
   depth ratio (prelude + r·core + coda) / parent layers; cache memory per policy.
2. Memory policy: the `latest` cache's negative log-likelihood and next-token agreement against `all`.
3. Adaptive exit: mean recurrences per token, NLL and agreement with fixed r for KL thresholds, each with a
   cold s_0 and warm-started from the previous token's final state.
4. Self-speculative decoding (free-running greedy): tokens/s and acceptance at r ∈ `--spec-depths` against
   plain greedy decoding at the same r, with `--lookahead` drafts every round (fixed) and with as many as the
   measured acceptance pays for (adaptive, the default), and whether the outputs are identical.
5. Adaptive depth in a batch of `--batch` sequences: time per token against fixed r, as a ratio to the
   compute the rows' own depths predict (the core runs only on rows still recurring).
6. Compiled decoding (`generate(compile=True)`: static cache; prelude, one recurrence step and coda compiled once
   per batch size) against eager `generate` (dynamic cache): free-running greedy time per token at batches
   `--compile-batches` and r ∈ `--compile-depths`, the tokens compared, graphs traced, the one-time compile cost
   (each row from a cold start: no graph kept from the row before), the time of its matrix products alone
   (each weight matrix a token reads, applied in decoding order), and the weights-read floor (at `--bandwidth`,
   or the bandwidth measured here with `--bandwidth measure`).
`--parent tinyllama` retrofits TinyLlama-1.1B's shape with random weights (no download) and decodes random
tokens: its times are real, its NLL and agreement are not. `--perturb-adapter ε` adds ε times a random matrix
(entries of variance 1 / 2h) to the retrofit's identity adapter [0 | I], so that the depths compute different
things: drafts are then rejected more the larger ε (about 1: acceptance ≈ 0). `--bandwidth` (GB/s, measured)
adds the time per token that reading the weights once per layer call takes at that bandwidth, the decode floor
at batch 1.
`--text word-problems` takes the passages from recurfit's generated word problems instead of prose (for a model
trained on them, as the GPU check's part 6 trains one on a device with no prose).
Use a trained model for 2, 3 and 5: an untrained identity-adapter retrofit ignores its state, so every step
computes the same thing, no option can cost anything, and every row exits at the same step.
Times are medians over the decoded tokens of this one run, modes interleaved (the machine is noisy).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from device_peaks import copy_bandwidth, median_seconds  # benchmarks/ is on the path when this file runs

import recurfit
from recurfit.data.sources import embedded_prose, math_problems
from recurfit.generation import ExitRule
from recurfit.generation.speculative import speculative_generate
from recurfit.model.cache import RecurrentCache
from recurfit.model.compat import cache_kwargs
from recurfit.model.loading import load_model, load_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def passages(tokenizer, count: int, length: int, skip: int = 0, vocab_size: int = 32000, text: str = "prose"):
    """English passages of `length` tokens; random tokens (seeded by `skip`) when there is no tokenizer; with
    `text="word-problems"`, consecutive windows of generated word problems (seed 1; training runs draw seed 0)."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(skip)
        return torch.randint(3, vocab_size, (count, length), generator=generator)
    if text == "word-problems":
        stream = tokenizer(" ".join(math_problems((skip + count) * length, seed=1)), add_special_tokens=False).input_ids
        return torch.tensor(stream[skip * length : (skip + count) * length]).view(count, length)
    rows = []
    for text in embedded_prose():
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == skip + count:
            return torch.tensor(rows[skip:])
    raise SystemExit("not enough passages of that length")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def teacher_forced(model, ids, prompt: int, cache=None, keep_logits: bool = False, **kwargs) -> dict:
    """Prefill `prompt` tokens, then decode the rest one token at a time through the cache (a fresh dynamic one,
    or `cache`: e.g. a static cache with a compiled step, `recurfit.model.compiled.decoding_cache`); with
    `keep_logits`, also every decoded position's logits (float32, positions × batch × vocab)."""
    recurrent = isinstance(model, recurfit.RecurrentForCausalLM)
    policy = kwargs.pop("policy", "all")
    per_row = kwargs.pop("steps_per_row", False)
    extra = dict(kwargs) if recurrent else {}
    if cache is None and recurrent:
        cache = RecurrentCache(model.config, policy=policy)
    elif cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    mask = torch.ones_like(ids)
    out = model(ids[:, :prompt], attention_mask=mask[:, :prompt], **cache_kwargs(cache), use_cache=True, **extra)
    logits, nll, predictions, steps, seconds, kept = out.logits[:, -1], [], [], [], [], []
    for t in range(prompt, ids.shape[1]):
        nll.append(torch.nn.functional.cross_entropy(logits.float(), ids[:, t], reduction="none"))
        predictions.append(logits.argmax(-1))
        if keep_logits:
            kept.append(logits.float().clone())  # a CUDA graph's output is overwritten by its next replay
        synchronize(ids.device)
        start = time.perf_counter()
        out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **cache_kwargs(cache), use_cache=True, **extra)
        synchronize(ids.device)
        seconds.append(time.perf_counter() - start)
        logits = out.logits[:, -1]
        if recurrent:
            steps.append(out.steps_per_token.float())
    memory = (
        cache.memory_bytes() if recurrent else sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    )
    return {
        "nll": torch.stack(nll).mean().item(),
        "predictions": torch.stack(predictions),
        "ms_per_token": 1e3 * statistics.median(seconds),
        "memory_mib": memory / 2**20,
        "steps": torch.stack(steps).mean().item() if steps else None,
        **({"steps_per_row": torch.stack(steps)} if per_row else {}),
        **({"logits": torch.stack(kept)} if keep_logits else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="a recurfit model folder (default: embedded retrofit, untrained)")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--depths", default="1,4,16,32")
    parser.add_argument("--exit-thresholds", default="1e-2,1e-3,1e-4")
    parser.add_argument("--spec-depths", default="8,16,32", help="full recurrences for speculative decoding")
    parser.add_argument("--draft-steps", type=int, default=2)
    parser.add_argument("--lookahead", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="batch for the adaptive-depth measurement")
    parser.add_argument("--batch-threshold", default="1e-3", help="KL threshold for the batch measurement")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--parent", default="embedded", help="embedded | tinyllama (random weights) | a folder")
    parser.add_argument("--random-tokens", action="store_true", help="decode random tokens (tinyllama: always)")
    parser.add_argument(
        "--text", choices=("prose", "word-problems"), default="prose", help="what the prompts and passages are"
    )
    parser.add_argument("--shape", default="4,8,4", help="the retrofit of the parent (without MODEL)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument(
        "--perturb-adapter", type=float, default=0.0, help="ε: the retrofit's adapter [0 | I] + ε·noise"
    )
    parser.add_argument("--sections", default="1,2,3,4,5,6", help="which of the measurements above to run")
    parser.add_argument(
        "--bandwidth", help="memory bandwidth in GB/s for the decode floor, or `measure` to measure it here"
    )
    parser.add_argument("--compile-batches", default="1,8", help="batch sizes for section 6")
    parser.add_argument("--compile-depths", default="4,32", help="recurrences for section 6")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.bandwidth == "measure":
        args.bandwidth = copy_bandwidth(2.0, 5, torch.device(args.device)) / 1e9
        print(f"measured memory bandwidth: {args.bandwidth:.1f} GB/s (copying 2 GiB, bytes read + written)")
    elif args.bandwidth is not None:
        args.bandwidth = float(args.bandwidth)

    model, parent, tokenizer = models(args)
    ids = passages(
        tokenizer, args.sequences, args.prompt + args.decode, vocab_size=parent.config.vocab_size, text=args.text
    )
    ids = ids.to(args.device)
    P, R, C = model.config.shape
    sections = {int(x) for x in args.sections.split(",")}
    print(
        f"{args.model or f'{args.parent} {model.config.shape}, untrained'}; {args.sequences} sequences, prefill "
        f"{args.prompt}, decode {args.decode} tokens, {args.device} {args.dtype}, CPU threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}\n"
    )

    base = teacher_forced(parent, ids, args.prompt)
    layers = parent.config.num_hidden_layers
    print(
        f"1. speed   parent ({layers} layers): {base['ms_per_token']:.1f} ms/token, cache {base['memory_mib']:.1f} MiB"
        + (f", weights-read floor {weight_floor_ms(parent, args.bandwidth):.2f} ms" if args.bandwidth else "")
    )
    print(
        "   r   ms/token  ratio to parent  depth ratio  cache all (MiB)  cache latest (MiB)"
        + ("  floor (ms)  ms / floor" if args.bandwidth else "")
    )
    depths = [int(r) for r in args.depths.split(",")]
    full = {}
    for r in depths:
        full[r] = teacher_forced(model, ids, args.prompt, num_steps=r)
        latest = teacher_forced(model, ids, args.prompt, num_steps=r, policy="latest")
        full[r]["latest"] = latest
        ratio = full[r]["ms_per_token"] / base["ms_per_token"]
        floor = ""
        if args.bandwidth:
            ms = weight_floor_ms(model, args.bandwidth, r)
            floor = f"  {ms:10.2f}  {full[r]['ms_per_token'] / ms:9.2f}"
        print(
            f"  {r:>2}  {full[r]['ms_per_token']:8.1f}  {ratio:15.2f}  {(P + r * R + C) / layers:11.2f}  "
            f"{full[r]['memory_mib']:15.1f}  {latest['memory_mib']:18.1f}{floor}"
        )
    if sections & {2, 3}:
        policy_and_exit(model, ids, full, depths, args)
    if 4 in sections:
        speculative(model, ids[:, : args.prompt], args)
    if 5 in sections:
        batched_exit(model, tokenizer, args)
    if 6 in sections:
        compiled(model, ids[:, : args.prompt], args)


def models(args):
    """The retrofit (MODEL, or the parent retrofitted to --shape), the parent, and the tokenizer (None: random)."""
    dtype = DTYPES[args.dtype]
    if args.parent == "tinyllama":
        from train_step import parent_model  # benchmarks/ is on the path when this file runs

        parent, tokenizer = parent_model("tinyllama"), None
    else:
        folder = None if args.parent == "embedded" else args.parent
        parent = load_model(folder, dtype=torch.float32)
        tokenizer = None if args.random_tokens else load_tokenizer(args.model or folder)
    shape = tuple(int(x) for x in args.shape.split(","))
    model = recurfit.retrofit(parent, shape) if args.model is None else load_model(args.model, dtype=torch.float32)
    if args.perturb_adapter:
        perturb_adapter(model, args.perturb_adapter)
    return model.eval().to(args.device, dtype), parent.eval().to(args.device, dtype), tokenizer


def perturb_adapter(model, epsilon: float) -> None:
    """Add ε times a random matrix (entries of variance 1 / 2h, seed 0) to the adapter, so that depths differ."""
    weight = model.model.adapter.weight
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) / weight.shape[1] ** 0.5
    with torch.no_grad():
        weight += epsilon * noise.to(weight.device, weight.dtype)


def weight_floor_ms(model, bandwidth_gbs: float, r: int | None = None) -> float:
    """Milliseconds to read, at the measured bandwidth, the weights one decoded token touches: each layer once
    per call (the adapter and core r times) and the LM head; the embedding reads one row only."""

    def nbytes(modules) -> int:
        return sum(p.nbytes for module in modules for p in module.parameters())

    if r is None:  # the parent
        layers = nbytes(model.model.layers)
    else:
        body = model.model
        layers = nbytes([*body.prelude, *body.coda]) + r * nbytes([body.adapter, *body.core])
    return (layers + model.lm_head.weight.nbytes) / (bandwidth_gbs * 1e9) * 1e3


def policy_and_exit(model, ids, full, depths, args) -> None:
    print("\n2. memory policy: latest against all (teacher-forced)")
    print("   r   NLL all  NLL latest  next-token agreement")
    for r in depths:
        a, b = full[r], full[r]["latest"]
        agree = (a["predictions"] == b["predictions"]).float().mean().item()
        print(f"  {r:>2}  {a['nll']:7.3f}  {b['nll']:10.3f}  {agree:20.1%}")

    top = max(depths)
    print(f"\n3. adaptive exit (KL between consecutive steps, at most r = {top}, min 2 steps), cold and warm s_0")
    print("   threshold  start  mean steps/token  NLL     agreement with fixed r")
    for threshold in (float(t) for t in args.exit_thresholds.split(",")):
        for warm in (False, True):
            rule = ExitRule("kl", threshold)
            run = teacher_forced(model, ids, args.prompt, num_steps=top, exit_rule=rule, warm_start=warm)
            agree = (run["predictions"] == full[top]["predictions"]).float().mean().item()
            start = "warm" if warm else "cold"
            print(f"   {threshold:9.0e}  {start:5}  {run['steps']:16.1f}  {run['nll']:6.3f}  {agree:22.1%}")
    for r in depths:
        print(f"   fixed r={r:<3}{r:23.1f}  {full[r]['nll']:6.3f}")


def speculative(model, prompts, args) -> None:
    """Free-running greedy decoding at each depth: plain, and self-speculative with a fixed and an adaptive number
    of drafts per round (modes interleaved in each repeat, so all see the same machine load)."""
    print(
        f"\n4. self-speculative decoding: draft at r = {args.draft_steps}, lookahead {args.lookahead}, "
        f"{prompts.shape[0]} sequences, {args.decode} new tokens"
    )
    print(
        "   r   plain tok/s  fixed tok/s  speed-up  acceptance  adaptive tok/s  speed-up  acceptance  "
        "drafts/token  identical output"
    )
    modes = {"fixed": dict(adaptive=False), "adaptive": dict(adaptive=True)}
    for r in (int(r) for r in args.spec_depths.split(",")):
        kwargs = dict(max_new_tokens=args.decode, num_steps=r)
        seconds = {name: [] for name in ("plain", *modes)}
        outputs = {}
        for _ in range(args.repeats):
            synchronize(prompts.device)
            start = time.perf_counter()
            plain = model.generate(prompts, do_sample=False, pad_token_id=0, eos_token_id=None, **kwargs)
            synchronize(prompts.device)
            seconds["plain"].append(time.perf_counter() - start)
            for name, mode in modes.items():
                start = time.perf_counter()
                outputs[name] = speculative_generate(
                    model, prompts, draft_steps=args.draft_steps, lookahead=args.lookahead, **mode, **kwargs
                )
                synchronize(prompts.device)
                seconds[name].append(time.perf_counter() - start)
        tokens = prompts.shape[0] * args.decode
        rate = {name: tokens / statistics.median(times) for name, times in seconds.items()}
        same = all(torch.equal(plain, output.sequences) for output in outputs.values())
        fixed, adaptive = outputs["fixed"], outputs["adaptive"]
        print(
            f"  {r:>2}  {rate['plain']:11.1f}  {rate['fixed']:11.1f}  {rate['fixed'] / rate['plain']:8.2f}  "
            f"{fixed.acceptance_rate:10.0%}  {rate['adaptive']:14.1f}  {rate['adaptive'] / rate['plain']:8.2f}  "
            f"{adaptive.acceptance_rate:10.0%}  {adaptive.drafted / args.decode:12.2f}  {'yes' if same else 'no':>16}"
        )


def batched_exit(model, tokenizer, args) -> None:
    """A batch whose rows exit at different depths: measured time per token against the predicted compute."""
    r = max(int(d) for d in args.depths.split(","))
    vocab_size = model.config.text_config.vocab_size
    ids = passages(tokenizer, args.batch, args.prompt + args.decode, args.sequences, vocab_size, args.text)
    ids = ids.to(args.device)
    rule = ExitRule("kl", float(args.batch_threshold))
    fixed, adaptive = [], []
    for _ in range(args.repeats):
        fixed.append(teacher_forced(model, ids, args.prompt, num_steps=r)["ms_per_token"])
        run = teacher_forced(model, ids, args.prompt, num_steps=r, exit_rule=rule, steps_per_row=True)
        adaptive.append(run["ms_per_token"])
    P, R, C = model.config.shape
    depths = run["steps_per_row"]  # (tokens, batch)
    # Cost per token and row in decoder-layer units: prelude, coda and head once; the core at the row's own
    # depth; the KL probe (coda and head) at each step the row ran. Against fixed r. Batch × deepest row is
    # what a batch cost before settled rows were dropped.
    head = model.lm_head.weight.numel() / sum(p.numel() for p in model.model.core[0].parameters())

    def layers(steps):
        return P + C + head + steps * (R + C + head)

    fixed_layers = P + C + head + r * R
    predicted = layers(depths.float().mean()) / fixed_layers
    batch_max = layers(depths.max(-1).values.float().mean()) / fixed_layers
    measured = statistics.median(adaptive) / statistics.median(fixed)
    print(f"\n5. adaptive depth in a batch of {args.batch} (KL < {args.batch_threshold}, at most r = {r})")
    print(
        f"   steps per token: mean {depths.float().mean():.1f}, per row from {depths.float().mean(0).min():.1f} to "
        f"{depths.float().mean(0).max():.1f}; deepest row per token {depths.max(-1).values.float().mean():.1f}"
    )
    print(
        f"   ms/token fixed r={r}: {statistics.median(fixed):.1f}, adaptive: {statistics.median(adaptive):.1f}; "
        f"measured ratio {measured:.2f}, predicted from the rows' depths {predicted:.2f} "
        f"(measured / predicted {measured / predicted:.2f}); batch × deepest row would be {batch_max:.2f}"
    )


def products_ms(model, r: int, batch: int, repeats: int = 5) -> float:
    """Milliseconds per token of a decode's matrix products alone, the median of `repeats`: every weight matrix
    a token reads, in decoding order (the prelude, the adapter's input half once, the adapter's state half and the
    core r times, the coda, the LM head), each applied to `batch` rows. A floor that needs no bandwidth: where a
    CPU's cache holds the core's weights between steps, re-reading them costs less than the copy bandwidth says."""
    body = model.model

    def weights(layers) -> list[torch.Tensor]:
        return [m.weight for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]

    adapter = getattr(body.adapter, "weight", None)
    once, step = ([], []) if adapter is None else ([adapter[:, adapter.shape[0] :]], [adapter[:, : adapter.shape[0]]])
    order = [*weights(body.prelude), *once, *(step + weights(body.core)) * r, *weights(body.coda), model.lm_head.weight]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device) for w in order}

    def products(_):
        for weight in order:
            torch.nn.functional.linear(inputs[weight.shape[1]], weight)

    with torch.no_grad():
        return 1e3 * median_seconds(products, repeats, model.device)


def timed_greedy(model, rows, r: int, compile: bool, tokens: int):
    synchronize(rows.device)
    start = time.perf_counter()
    out = model.generate(rows, do_sample=False, pad_token_id=0, max_new_tokens=tokens, num_steps=r, compile=compile)
    synchronize(rows.device)
    return out, time.perf_counter() - start


def decode_ms(model, rows, r: int, new: int, repeats: int, compile: bool | str = False) -> dict:
    """Free-running greedy ms per new token (the prefill's time taken out) at r, eager and, when `compile` is
    set (True, or a torch.compile backend), compiled, interleaved so that both see the same machine load: each
    one's median, whether their tokens are the same, the graphs dynamo traced and the one-time compile seconds."""
    from torch._dynamo.utils import counters

    run = functools.partial(timed_greedy, model, rows, r)
    modes = [False, compile] if compile else [False]
    graphs, first = counters["stats"]["unique_graphs"], None
    if compile:
        _, first = run(compile, new)  # traces and compiles the step
    graphs = counters["stats"]["unique_graphs"] - graphs
    per_token, tokens = {mode: [] for mode in modes}, {}
    for _ in range(repeats):
        for mode in modes:
            out, whole = run(mode, new)
            _, prefill = run(mode, 1)
            per_token[mode].append((whole - prefill) / (new - 1))
            tokens.setdefault(mode, out)
    result = {"eager_ms": 1e3 * statistics.median(per_token[False])}
    if compile:
        compiled_ms = 1e3 * statistics.median(per_token[compile])
        result.update(
            compiled_ms=compiled_ms,
            same_tokens=torch.equal(tokens[False], tokens[compile]),
            graphs=graphs,
            compile_s=first - compiled_ms / 1e3 * new,
        )
    return result


def forget_compiled(model) -> None:
    """Drop every compiled graph and static cache, so that the next compiled `generate` compiles from scratch."""
    torch._dynamo.reset()
    for kept in ("_compiled_decoders", "_decoding_caches"):
        model.__dict__.pop(kept, None)


def compiled(model, prompts, args) -> None:
    """Free-running greedy decoding, eager against compiled, at each batch size and r."""
    new = args.decode
    print(f"\n6. compiled decoding against eager: prefill {prompts.shape[1]}, {new} new tokens, greedy")
    print(
        "   batch   r  eager ms/token  compiled ms/token  compiled / eager  same tokens  graphs  compile (s)"
        + "  products (ms)  compiled / products"
        + ("  floor (ms)  compiled / floor" if args.bandwidth else "")
    )
    for batch in (int(b) for b in args.compile_batches.split(",")):
        rows = prompts[torch.arange(batch, device=prompts.device) % prompts.shape[0]]
        for r in (int(d) for d in args.compile_depths.split(",")):
            forget_compiled(model)  # each row's compile from cold: its r's own cost
            times = decode_ms(model, rows, r, new, args.repeats, compile=True)
            eager_ms, compiled_ms = times["eager_ms"], times["compiled_ms"]
            line = (
                f"  {batch:>6}  {r:>2}  {eager_ms:14.1f}  {compiled_ms:17.1f}  {compiled_ms / eager_ms:16.2f}  "
                f"{'yes' if times['same_tokens'] else 'no':>11}  {times['graphs']:6}  {times['compile_s']:11.1f}"
            )
            products = products_ms(model, r, batch)
            line += f"  {products:13.1f}  {compiled_ms / products:19.2f}"
            if args.bandwidth:
                floor = weight_floor_ms(model, args.bandwidth, r)
                line += f"  {floor:10.2f}  {compiled_ms / floor:16.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
