"""The loss sweep over test recurrence: one pass with a readout at each r, against a forward per r.

    python benchmarks/loss_sweep.py [MODEL] [--recurrence 1,2,4,8,16,32] [--device cuda --dtype bfloat16]

Default model: the embedded SmolLM2 retrofitted to (4,8,4). Both ways score the same windows of English
prose (embedded:prose) from the same s_0, so they must agree to rounding; the script checks that, then prints
the wall time of each and their ratio, measured in this one run (alternating, best of --repeats), next to the
ratio the layer counts predict: (P + max(r)·R + |r|·C) / Σ_r (P + r·R + C), plus one LM head per r in both.
"""

from __future__ import annotations

import argparse
import time

import torch

import recurfit
from recurfit.evaluate.loss import Examples, batches, load_examples, summed_nll, sweep_nll
from recurfit.model.loading import load_model, load_tokenizer


def separate_forwards(model, ids, mask, steps, s0) -> dict:
    return {
        r: summed_nll(model(ids, attention_mask=mask, num_steps=r, initial_state=s0).logits, ids, mask) for r in steps
    }


def timed(function, device) -> tuple[float, dict]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="a recurfit model folder (default: embedded SmolLM2, (4,8,4))")
    parser.add_argument("--recurrence", default="1,2,4,8,16,32", help="test-time recurrences r")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    steps = [int(s) for s in args.recurrence.split(",")]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    model = load_model(args.model, dtype=torch.float32)
    if args.model is None:
        model = recurfit.retrofit(model, (4, 8, 4), adapter_init="random").eval()
    model = model.to(device, dtype)
    examples = load_examples("embedded:prose", load_tokenizer(args.model), args.seq_len)
    examples = Examples([s for s in examples.sequences if len(s) == args.seq_len + 1][: args.sequences], "prose")
    ids, mask = (t.to(device) for t in next(batches(examples, args.sequences)))
    s0 = model.model.initial_state(model.model.embed(ids), torch.Generator(device).manual_seed(0))

    one_pass = lambda: sweep_nll(model, ids, mask, steps, initial_state=s0)  # noqa: E731
    separate = lambda: separate_forwards(model, ids, mask, steps, s0)  # noqa: E731
    one_pass(), separate()  # warm-up
    best, results = {"one pass": float("inf"), "separate": float("inf")}, {}
    for _ in range(args.repeats):
        for name, function in (("one pass", one_pass), ("separate", separate)):
            seconds, results[name] = timed(function, device)
            best[name] = min(best[name], seconds)
    worst = max((results["one pass"][r] - results["separate"][r]).abs().max().item() for r in steps)
    per_token = worst / args.seq_len

    P, R, C = model.config.shape
    predicted = (P + max(steps) * R + len(steps) * C) / sum(P + r * R + C for r in steps)
    print(
        f"model {args.model or 'embedded SmolLM2 (4,8,4)'} on {device} {args.dtype}; r ∈ {steps}; "
        f"{args.sequences} × {args.seq_len} tokens"
    )
    print(f"agreement: max |Δ summed NLL| = {worst:.2e} ({per_token:.1e} per token)")
    print(f"one pass: {best['one pass']:.2f} s   separate forwards: {best['separate']:.2f} s")
    print(
        f"ratio one pass / separate: {best['one pass'] / best['separate']:.3f}   "
        f"(layer-count prediction {predicted:.3f})"
    )


if __name__ == "__main__":
    main()
