"""Where evaluation's generation time goes: GSM8K through lm-eval, a retrofit at r against its parent.

    python benchmarks/eval_generation.py [--model DIR --parent DIR] [--limit 8] [--max-new-tokens 64] [--recurrence 4]

Runs the demo's GSM8K step (`task_sweep`, 1-shot chain of thought, lm-eval's stop sequences, batch 8) and
times every `generate` call and every decoding step inside it. Time per problem is split into
    decoding steps per batch (how long until every row has met a stop sequence or the token limit)
  × time per step (one forward of the batch, new token only)
  + the prompt's forward (prefill),
and each part is printed as a ratio of the retrofit to the parent next to the effective depth ratio
(P + r·R + C) / L. Default models: the embedded SmolLM2-135M and its (6,12,6) retrofit, untrained.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import recurfit
from recurfit.evaluate.suite import task_sweep
from recurfit.model.loading import load_model, load_tokenizer


def instrument(model) -> dict:
    """Wrap `forward` and `generate` to record prefill and per-step times and the steps each batch ran."""
    record = {"prefill": [], "step": [], "steps_per_batch": [], "generate": [], "rows": 0}
    forward, generate = model.forward, model.generate

    @functools.wraps(forward)
    def timed_forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        record["prefill" if ids.shape[1] > 1 else "step"].append(time.perf_counter() - start)
        return out

    @functools.wraps(generate)
    def timed_generate(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        record["generate"].append(time.perf_counter() - start)
        record["steps_per_batch"].append(out.shape[1] - ids.shape[1])
        record["rows"] += out.shape[0]
        return out

    model.forward, model.generate = timed_forward, timed_generate
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="recurfit model folder (default: the embedded SmolLM2 retrofitted to 6,12,6)")
    parser.add_argument("--parent", help="parent folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--recurrence", type=int, default=4, help="test recurrence r of the retrofit")
    parser.add_argument("--limit", type=int, default=8, help="GSM8K problems")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    parent = load_model(args.parent, dtype=torch.float32).eval()
    if args.model:
        model = load_model(args.model, dtype=torch.float32).eval()
    else:
        model = recurfit.retrofit(load_model(args.parent, dtype=torch.float32), (6, 12, 6)).eval()
    tokenizer = load_tokenizer(args.model or args.parent)
    warm_up = tokenizer(["Question: warm-up run " * 20] * 8, return_tensors="pt").input_ids
    for each in (model, parent):  # the first large forward of a process is slow; keep it out of both
        each.generate(warm_up, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    records = {"retrofit": instrument(model), "parent": instrument(parent)}
    start = time.perf_counter()
    task_sweep(
        model,
        tokenizer,
        tasks=["gsm8k_cot"],
        recurrences=[args.recurrence],
        name="retrofit",
        baseline=parent,
        baseline_name="parent",
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
    )
    print(
        f"GSM8K, {args.limit} problems, at most {args.max_new_tokens} new tokens, batch 8, r = {args.recurrence}, "
        f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}; {time.perf_counter() - start:.0f} s"
    )
    P, R, C = model.config.shape
    depth = (P + args.recurrence * R + C) / parent.config.num_hidden_layers
    print("               s/problem  steps/batch  ms/step  prefill s  ms/step per row")
    summary = {}
    for name, record in records.items():
        per_problem = sum(record["generate"]) / record["rows"]
        step = statistics.median(record["step"])
        summary[name] = (
            per_problem,
            statistics.mean(record["steps_per_batch"]),
            step,
            statistics.median(record["prefill"]),
        )
        print(
            f"  {name:12} {per_problem:9.2f}  {summary[name][1]:11.1f}  {1e3 * step:7.1f}  "
            f"{summary[name][3]:9.2f}  {1e3 * step / 8:15.1f}"
        )
    ratios = [a / b for a, b in zip(summary["retrofit"], summary["parent"])]
    print(
        f"  ratio        {ratios[0]:9.2f}  {ratios[1]:11.2f}  {ratios[2]:7.2f}  {ratios[3]:9.2f}   "
        f"effective depth ratio {depth:.2f}; ms/step over depth {ratios[2] / depth:.2f}"
    )


if __name__ == "__main__":
    main()
