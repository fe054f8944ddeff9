"""`generate(compile=True)` with transformers' decoding loop against recurfit's own (`recurfit.model.compiled.
decoding_loop`), around the same compiled step, in one process: ms per new token and own / transformers', on a tiny
retrofit and on the embedded SmolLM2 retrofitted to (4, 8, 4), at each batch size and r.

    python benchmarks/decode_loop.py                      # tiny and embedded, batches 1,8, r 4,32, greedy
    python benchmarks/decode_loop.py --models tiny --sample

Free-running decoding of random prompts; the EOS stop is on (a token the untrained models do not emit, checked), so
both loops do their per-token EOS work. A token's time is (a call of `--new` tokens − a call of one) / (`--new` − 1):
the prefill, which both run alike, taken out. The loops alternate call by call (transformers' first on even samples,
recurfit's on odd); the ratio is the median of the paired ratios, so load from other jobs that falls on a few
samples does not move it. Each batch size compiles its graphs once (before timing), for every r.
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch
from train_step import parent_model
from transformers import AutoModelForCausalLM, LlamaConfig

import recurfit
import recurfit.model.modeling as modeling

TINY = dict(  # a tiny Llama retrofitted to (2, 2, 2): almost all host work
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024,
)  # fmt: skip
SHAPES = {"tiny": (2, 2, 2), "embedded": (4, 8, 4)}
own_loop_may_run = modeling.loop_may_run


@contextlib.contextmanager
def loop(name: str):
    """`generate(compile=True)` through recurfit's loop ("own") or transformers' ("hf")."""
    modeling.loop_may_run = own_loop_may_run if name == "own" else (lambda args, kwargs: False)
    try:
        yield
    finally:
        modeling.loop_may_run = own_loop_may_run


def retrofit(name: str):
    torch.manual_seed(0)
    parent = AutoModelForCausalLM.from_config(LlamaConfig(**TINY)) if name == "tiny" else parent_model(name)
    return recurfit.retrofit(parent.eval(), SHAPES[name]).eval()


def timed(model, rows, new: int, **settings) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = model.generate(rows, attention_mask=torch.ones_like(rows), max_new_tokens=new, compile=True, **settings)
    if rows.device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def measure(model, rows, r: int, args) -> dict:
    eos = model.config.text_config.vocab_size - 1
    settings = dict(num_steps=r, pad_token_id=0, eos_token_id=eos, do_sample=args.sample)
    if args.sample:
        settings.update(temperature=0.8, top_k=50, top_p=0.9)
    ms, outputs = {"hf": [], "own": []}, {}
    for sample in range(args.samples):
        for name in ("hf", "own") if sample % 2 == 0 else ("own", "hf"):
            with loop(name):
                torch.manual_seed(sample)
                out, whole = timed(model, rows, args.new, **settings)
                _, prefill = timed(model, rows, 1, **settings)
            ms[name].append(1e3 * (whole - prefill) / (args.new - 1))
            outputs.setdefault(name, []).append(out)
    if outputs["own"][0].shape[1] != rows.shape[1] + args.new:
        raise SystemExit(f"the model emitted the EOS token {eos}: pick another (--new tokens were not all made)")
    same = all(map(torch.equal, outputs["hf"], outputs["own"]))
    ratios = [own / hf for hf, own in zip(ms["hf"], ms["own"])]
    return dict(
        hf=statistics.median(ms["hf"]), own=statistics.median(ms["own"]), ratio=statistics.median(ratios), same=same
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,embedded")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--depths", default="4,32")
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--new", type=int, default=64, help="new tokens per call (64: four chunks of 16)")
    parser.add_argument("--samples", type=int, default=6, help="timed calls per loop, batch size and r")
    parser.add_argument("--sample", action="store_true", help="sample (temperature, top-k, top-p) instead of greedy")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"prompt {args.prompt}, {args.new} new tokens, {'sampled' if args.sample else 'greedy'}, CPU threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}"
    )
    print("model     shape      batch   r  transformers' loop (ms/token)  own loop (ms/token)  own / theirs  same")
    for name in args.models.split(","):
        model = retrofit(name)
        vocab = model.config.text_config.vocab_size
        for batch in (int(b) for b in args.batches.split(",")):
            rows = torch.randint(3, vocab - 1, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
            start = time.perf_counter()
            model.generate(rows, max_new_tokens=2, compile=True, pad_token_id=0)  # compiles this batch size
            print(f"  ({name}, batch {batch}: compiled in {time.perf_counter() - start:.0f} s)", flush=True)
            for r in (int(d) for d in args.depths.split(",")):
                m = measure(model, rows, r, args)
                print(
                    f"{name:<9} {str(model.config.shape):<10} {batch:>5}  {r:>2}  {m['hf']:29.2f}  {m['own']:19.2f}  "
                    f"{m['ratio']:12.2f}  {'yes' if m['same'] else 'no'}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
