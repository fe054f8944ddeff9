"""Generation throughput through vLLM against recurfit's batched `generate`, in one run.

    .venv-vllm/bin/python benchmarks/serve.py [MODEL]      # default: the embedded SmolLM2 retrofitted to (4,8,4)
    .venv-vllm/bin/python benchmarks/serve.py RUN/final --device cuda --dtype bf16       # on a GPU

Needs vLLM (scripts/setup-vllm.sh). `--prompts` prompts of `--prompt-length` tokens (English passages from
embedded:prose) each get `--new-tokens` greedy tokens at every r in `--depths`: first through recurfit's
`generate` (one batch of all prompts, the `all` cache), then through `vllm.LLM` on the saved folder with
`hf_overrides={"mean_recurrence": r}` (vLLM's scheduler batches them itself). Prints tokens/s for both, their
ratio, vLLM's load time (not counted), and how many rows came out identical. The machine is shared and noisy:
after one recurfit pass per r, `--repeats` rounds alternate vLLM and recurfit at each r (one engine at a
time, shut down before recurfit runs: an idle engine's worker keeps a core busy), and the summary takes each
side's fastest round. Without MODEL the untrained
retrofit has s_0 = 0 (state_init_std 0), so both engines compute the same function and the rows can be compared.
Each vLLM engine runs in its own process (vLLM's default), so that its CPU worker's thread binding leaves
recurfit's threads in this process alone.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

# vLLM's CPU worker otherwise drops to one thread ("Reducing Torch threads ... for serving"); recurfit's torch
# takes the cores by default. Both get every core, through the environment the engine processes inherit.
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import torch  # noqa: E402

import recurfit  # noqa: E402
from recurfit.data.sources import embedded_prose  # noqa: E402
from recurfit.model.cache import RecurrentCache  # noqa: E402
from recurfit.model.compat import cache_kwargs  # noqa: E402
from recurfit.model.loading import load_model, load_tokenizer, save_tokenizer  # noqa: E402

DTYPES = {"fp32": ("float32", torch.float32), "bf16": ("bfloat16", torch.bfloat16)}


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    rows = []
    for text in embedded_prose():
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == count:
            return rows
    raise SystemExit("not enough passages of that length")


def model_folder(args, root: str) -> str:
    """MODEL, or the embedded SmolLM2 retrofitted to --shape with s_0 = 0, saved with its tokenizer."""
    if args.model:
        return args.model
    shape = tuple(int(x) for x in args.shape.split(","))
    model = recurfit.retrofit(load_model(None, dtype=torch.float32), shape, state_init_std=0.0)
    model.save_pretrained(root)
    save_tokenizer(load_tokenizer(None), root)
    return root


@torch.no_grad()
def recurfit_run(model, batch, r: int, new_tokens: int, device) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(batch, device=device)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_steps=r,
        eos_token_id=None,
        pad_token_id=0,
        **cache_kwargs(RecurrentCache(model.config)),
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()


def vllm_engine(folder, r: int, args):
    import vllm

    start = time.perf_counter()
    extra = {"kv_cache_memory_bytes": int(args.kv_cache_gib * (1 << 30))} if args.device == "cpu" else {}
    llm = vllm.LLM(
        folder,
        dtype=DTYPES[args.dtype][0],
        enforce_eager=args.device == "cpu",
        max_model_len=args.prompt_length + args.new_tokens,
        hf_overrides={"mean_recurrence": r},
        seed=0,
        **extra,
    )
    return llm, time.perf_counter() - start


def vllm_run(llm, batch, new_tokens: int) -> tuple[float, list[list[int]]]:
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="a recurfit model folder (default: embedded retrofit, untrained)")
    parser.add_argument("--shape", default="4,8,4", help="the embedded parent's retrofit (without MODEL)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--depths", default="4,8")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="vLLM's KV cache on a CPU, per engine")
    parser.add_argument("--repeats", type=int, default=1, help="rounds alternating vLLM and recurfit")
    args = parser.parse_args()
    depths = [int(x) for x in args.depths.split(",")]
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as root:
        folder = model_folder(args, root)
        batch = prompts(load_tokenizer(folder), args.prompts, args.prompt_length)
        model = load_model(folder, dtype=DTYPES[args.dtype][1], device=device)
        tokens = args.prompts * args.new_tokens
        print(f"{folder}: {args.prompts} prompts x {args.new_tokens} new tokens, {args.dtype} on {device}")
        times = {(engine, r): [] for engine in ("recurfit", "vLLM") for r in depths}

        def record(engine: str, r: int, seconds: float) -> None:
            times[engine, r].append(seconds)
            print(f"r={r} {engine}: {tokens / seconds:.1f} tok/s ({seconds:.1f} s, torch threads "
                  f"{torch.get_num_threads()})", flush=True)  # fmt: skip

        rows = {}
        for r in depths:
            seconds, rows[r] = recurfit_run(model, batch, r, args.new_tokens, device)
            record("recurfit", r, seconds)
        for _ in range(args.repeats):
            for r in depths:
                llm, loaded = vllm_engine(folder, r, args)
                print(f"r={r} vLLM engine loaded in {loaded:.1f} s", flush=True)
                seconds, served = vllm_run(llm, batch, args.new_tokens)
                record("vLLM", r, seconds)
                same = sum(a == b for a, b in zip(served, rows[r]))
                print(f"r={r} rows identical to recurfit's: {same}/{len(served)}", flush=True)
                llm.llm_engine.engine_core.shutdown()  # an idle engine's worker still takes a core
                del llm
                record("recurfit", r, recurfit_run(model, batch, r, args.new_tokens, device)[0])
        for r in depths:
            ours, theirs = min(times["recurfit", r]), min(times["vLLM", r])
            print(
                f"summary r={r}: recurfit {tokens / ours:.1f} tok/s, vLLM {tokens / theirs:.1f} tok/s, "
                f"ratio {ours / theirs:.2f}x (fastest of {len(times['recurfit', r])} and {len(times['vLLM', r])})"
            )


if __name__ == "__main__":
    main()
