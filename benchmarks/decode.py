"""Decoding with the step-aware KV cache: speed, cache memory, and the quality cost of the cheaper options.

    python benchmarks/decode.py [MODEL]          # default: the embedded SmolLM2 retrofitted to (4,8,4)

Teacher-forced decoding of English passages (embedded:prose): each sequence's first `--prompt` tokens are a
prefill, then the next `--decode` tokens are fed one at a time through the cache, scoring each prediction.
1. Speed: milliseconds per decoded token at r ∈ {1, 4, 16, 32}, and the parent's, against the effective
   depth ratio (prelude + r·core + coda) / parent layers; cache memory per policy.
2. Memory policy: the `latest` cache's negative log-likelihood and next-token agreement against `all`.
3. Adaptive exit: mean recurrences per token and NLL for KL thresholds, against fixed r.
Use a trained model for 2 and 3: an untrained identity-adapter retrofit ignores its state, so every step
computes the same thing and no option can cost anything.
"""

from __future__ import annotations

import argparse
import time

import torch

import recurfit
from recurfit.cache import RecurrentCache
from recurfit.data.sources import embedded_prose
from recurfit.loading import load_model, load_tokenizer


def passages(tokenizer, count: int, length: int) -> torch.Tensor:
    rows = []
    for text in embedded_prose():
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == count:
            return torch.tensor(rows)
    raise SystemExit("not enough passages of that length")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def teacher_forced(model, ids, prompt: int, **kwargs) -> dict:
    """Prefill `prompt` tokens, then decode the rest one token at a time through the cache."""
    recurrent = isinstance(model, recurfit.RecurrentForCausalLM)
    policy = kwargs.pop("policy", "all")
    cache = RecurrentCache(model.config, policy=policy) if recurrent else None
    extra = dict(kwargs) if recurrent else {}
    if not recurrent:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    mask = torch.ones_like(ids)
    out = model(ids[:, :prompt], attention_mask=mask[:, :prompt], past_key_values=cache, use_cache=True, **extra)
    logits, nll, predictions, steps = out.logits[:, -1], [], [], []
    synchronize(ids.device)
    start = time.perf_counter()
    for t in range(prompt, ids.shape[1]):
        nll.append(torch.nn.functional.cross_entropy(logits.float(), ids[:, t], reduction="none"))
        predictions.append(logits.argmax(-1))
        out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache, use_cache=True, **extra)
        logits = out.logits[:, -1]
        if recurrent:
            steps.append(out.steps_per_token.float())
    synchronize(ids.device)
    seconds = time.perf_counter() - start
    memory = cache.memory_bytes() if recurrent else sum(l.keys.nbytes + l.values.nbytes for l in cache.layers)
    return {
        "nll": torch.stack(nll).mean().item(),
        "predictions": torch.stack(predictions),
        "ms_per_token": 1e3 * seconds / (ids.shape[1] - prompt),
        "memory_mib": memory / 2**20,
        "steps": torch.stack(steps).mean().item() if steps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="a recurfit model folder (default: embedded retrofit, untrained)")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--depths", default="1,4,16,32")
    parser.add_argument("--exit-thresholds", default="1e-2,1e-3,1e-4")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    parent = load_model(None, dtype=torch.float32)
    model = recurfit.retrofit(parent, (4, 8, 4)) if args.model is None else load_model(args.model, dtype=torch.float32)
    model, parent = model.eval().to(args.device), parent.to(args.device)
    tokenizer = load_tokenizer(args.model)
    ids = passages(tokenizer, args.sequences, args.prompt + args.decode).to(args.device)
    P, R, C = model.config.shape
    print(f"{args.model or 'embedded SmolLM2 (4,8,4), untrained'}; {args.sequences} sequences, prefill {args.prompt}, "
          f"decode {args.decode} tokens, CPU threads {torch.get_num_threads()}, torch {torch.__version__}\n")

    base = teacher_forced(parent, ids, args.prompt)
    layers = parent.config.num_hidden_layers
    print(f"1. speed   parent ({layers} layers): {base['ms_per_token']:.1f} ms/token, cache {base['memory_mib']:.1f} MiB")
    print("   r   ms/token  ratio to parent  depth ratio  cache all (MiB)  cache latest (MiB)")
    depths = [int(r) for r in args.depths.split(",")]
    full = {}
    for r in depths:
        full[r] = teacher_forced(model, ids, args.prompt, num_steps=r)
        latest = teacher_forced(model, ids, args.prompt, num_steps=r, policy="latest")
        full[r]["latest"] = latest
        ratio = full[r]["ms_per_token"] / base["ms_per_token"]
        print(f"  {r:>2}  {full[r]['ms_per_token']:8.1f}  {ratio:15.2f}  {(P + r * R + C) / layers:11.2f}  "
              f"{full[r]['memory_mib']:15.1f}  {latest['memory_mib']:18.1f}")

    print("\n2. memory policy: latest against all (teacher-forced)")
    print("   r   NLL all  NLL latest  next-token agreement")
    for r in depths:
        a, b = full[r], full[r]["latest"]
        agree = (a["predictions"] == b["predictions"]).float().mean().item()
        print(f"  {r:>2}  {a['nll']:7.3f}  {b['nll']:10.3f}  {agree:20.1%}")

    top = max(depths)
    print(f"\n3. adaptive exit (KL between consecutive steps, at most r = {top}, min 2 steps)")
    print("   threshold  mean steps/token  NLL     agreement with fixed r")
    for threshold in (float(t) for t in args.exit_thresholds.split(",")):
        run = teacher_forced(model, ids, args.prompt, num_steps=top, exit_criterion="kl", exit_threshold=threshold)
        agree = (run["predictions"] == full[top]["predictions"]).float().mean().item()
        print(f"   {threshold:9.0e}  {run['steps']:16.1f}  {run['nll']:6.3f}  {agree:22.1%}")
    for r in depths:
        print(f"   fixed r={r:<3}{r:16.1f}  {full[r]['nll']:6.3f}")


if __name__ == "__main__":
    main()
