"""Compiled one-token decoding steps at r, batch 1, with and without recurfit's packed GQA attention, alternating
token by token under the same load. 'before' = a decoder of its own (compile="inductor", the
same options as compile=True on the CPU) traced and run with recurfit.model.compiled.packed_sdpa replaced by a
no-op, i.e. transformers' sdpa with repeat_kv under compile. Each timed call decodes position `prompt` (the cache
truncated back before it), so every sample attends over the same keys. The ratio is the median of paired ratios, so
load from other jobs that falls on a few samples does not move it.

    python benchmarks/decode_gqa.py --parent embedded --prompt 1000 --samples 20
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

import recurfit
import recurfit.model.compiled as compiled
from recurfit.model.compiled import decoding_cache

p = argparse.ArgumentParser()
p.add_argument("--parent", default="embedded")
p.add_argument("--shape", default="4,8,4")
p.add_argument("--r", type=int, default=32)
p.add_argument("--prompt", type=int, default=48)
p.add_argument("--samples", type=int, default=20)
a = p.parse_args()
torch.set_grad_enabled(False)
torch.manual_seed(0)
parent = parent_model(a.parent).eval()
model = recurfit.retrofit(parent, tuple(int(x) for x in a.shape.split(","))).eval()
del parent
t = model.config.text_config
rows = torch.randint(3, t.vocab_size, (1, a.prompt + 1), generator=torch.Generator().manual_seed(0))
real = compiled.packed_sdpa
BACKEND = {"before": "inductor", "after": True}


@contextlib.contextmanager
def mode_of(mode):
    compiled.packed_sdpa = real if mode == "after" else (lambda model: contextlib.nullcontext())
    try:
        yield
    finally:
        compiled.packed_sdpa = real


caches, logits = {}, {}
for mode in ("before", "after"):
    with mode_of(mode):
        cache = caches[mode] = decoding_cache(model, 1, a.prompt + 64, a.r, compile=BACKEND[mode])
        model(rows[:, :-1], cache=cache, num_steps=a.r)  # prefill (eager)
        start = time.perf_counter()
        logits[mode] = model(rows[:, -1:], cache=cache, num_steps=a.r).logits  # traces and compiles
        print(f"{mode}: first one-token call (compile) {time.perf_counter() - start:.1f} s", flush=True)
print(
    f"{a.parent} {model.config.shape}: heads {t.num_attention_heads}, kv heads {t.num_key_value_heads}, head_dim "
    f"{t.hidden_size // t.num_attention_heads}, cache length {caches['after'].max_length}, r {a.r}, batch 1, "
    f"position {a.prompt}, threads {torch.get_num_threads()}, torch {torch.__version__}",
    flush=True,
)
eager_cache = recurfit.RecurrentCache(model.config)
model(rows[:, :-1], cache=eager_cache, num_steps=a.r)
eager = model(rows[:, -1:], cache=eager_cache, num_steps=a.r).logits
same = all(bool((logits[mode].argmax(-1) == eager.argmax(-1)).all()) for mode in logits)
errors = {mode: (logits[mode] - eager).abs().max().item() for mode in logits}
print(
    f"max |logits|: {eager.abs().max():.1f}; max |logits - eager decoding's|: before {errors['before']:.2e}, "
    f"after {errors['after']:.2e}; argmax equal: {same}",
    flush=True,
)
per = {"before": [], "after": []}
for i in range(a.samples):
    for mode in ("before", "after") if i % 2 == 0 else ("after", "before"):
        with mode_of(mode):
            caches[mode].truncate(a.prompt)
            start = time.perf_counter()
            model(rows[:, -1:], cache=caches[mode], num_steps=a.r)
            per[mode].append(1e3 * (time.perf_counter() - start))
    print(f"  {i}: before {per['before'][-1]:.1f} ms, after {per['after'][-1]:.1f} ms", flush=True)
ratios = [y / x for x, y in zip(per["before"], per["after"])]
for mode in per:
    print(f"{mode}: median {statistics.median(per[mode]):.1f} ms/token, min {min(per[mode]):.1f} ms/token")
print(
    f"after / before: median of paired ratios {statistics.median(ratios):.3f}, of medians "
    f"{statistics.median(per['after']) / statistics.median(per['before']):.3f}, of minima "
    f"{min(per['after']) / min(per['before']):.3f}"
)
