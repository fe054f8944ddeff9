"""Compiled decoding: prelude → r × (adapter + core) → coda → head as one graph per (batch size, r).

Eager decoding of a depth-recurrent model is launch-bound: every token runs P + r·R + C decoder layers of a dozen
small ops each, and the dynamic cache does host bookkeeping at every layer call. With a `StaticRecurrentCache`
every shape of a decoding step is fixed (one token per row, buffers of a fixed length) and nothing in it reads a
host value, so the step compiles once per batch size and r: `decoding_cache` attaches a `torch.compile`d step to
such a cache, and the model's forward hands each one-token call to it. On CUDA, `mode="reduce-overhead"` replays
the step as a CUDA graph. Prompts (prefill) run eagerly into the same cache.

Caches are kept per model, batch size, length bucket, r and policy, so later `generate` calls (chat turns, lm-eval
batches) reuse a compiled step instead of tracing again.
"""

from __future__ import annotations

import torch

from .compat import cache_kwargs
from .static_cache import StaticRecurrentCache

MIN_LENGTH_BUCKET = 256  # cache lengths are powers of two from here: prompts of nearby lengths share one graph


class CompiledStep:
    """One decoding step through `model` into `cache`, compiled; called by the model's forward for one-token calls."""

    def __init__(self, model, cache: StaticRecurrentCache, compile: bool | str | object = True):
        self.model, self.cache = model, cache
        # CUDA graphs replay the step without a launch per kernel. `compile` may name another torch.compile backend.
        mode = "reduce-overhead" if model.device.type == "cuda" and compile is True else None
        backend = "inductor" if compile is True else compile
        self._compiled = torch.compile(self._step, fullgraph=True, dynamic=False, mode=mode, backend=backend)

    def _step(self, token: torch.LongTensor, new_real: torch.Tensor, num_steps: int, warm_start: bool):
        output = self.model(
            token, attention_mask=new_real, num_steps=num_steps, warm_start=warm_start, **cache_kwargs(self.cache)
        )
        return output.logits

    def __call__(self, token, new_real, num_steps: int, warm_start: bool) -> torch.Tensor:
        """Next-token logits (batch, 1, vocab). Each r is traced once (the loop unrolls)."""
        if num_steps > self.cache.max_steps:
            raise ValueError(f"this compiled cache holds {self.cache.max_steps} steps; asked for {num_steps}.")
        return self._compiled(token, new_real, num_steps, warm_start)


def decoding_cache(
    model,
    batch_size: int,
    length: int,
    num_steps: int | None,
    policy: str = "all",
    compile: bool | str | object = True,
) -> StaticRecurrentCache:
    """A reset `StaticRecurrentCache` for `batch_size` rows of up to `length` tokens at up to `num_steps`
    recurrences (None: the model's mean recurrence), with a compiled decoding step when `compile` is set; the same
    one (and its compiled step) as an earlier call with the same model, batch size, length bucket, r and policy."""
    num_steps = num_steps or model.config.mean_recurrence
    bucket = max(MIN_LENGTH_BUCKET, 1 << (length - 1).bit_length())
    caches = model.__dict__.setdefault("_decoding_caches", {})  # on the model: freed with it
    key = (batch_size, bucket, num_steps, policy, compile if isinstance(compile, (bool, str)) else id(compile))
    if key not in caches:
        cache = StaticRecurrentCache(model.config, batch_size, bucket, num_steps, policy, model.dtype, model.device)
        cache.compiled_step = CompiledStep(model, cache, compile) if compile else None
        caches[key] = cache
    cache = caches[key]
    cache.reset()
    return cache
