"""Compiled decoding: a token's prelude, one recurrence step and its coda + head, each compiled once.

Eager decoding of a depth-recurrent model is launch-bound: every token runs P + r·R + C decoder layers of a dozen
small ops each, and the dynamic cache does host bookkeeping at every layer call. With a `StaticRecurrentCache`
every shape of a decoding step is fixed (one token per row, buffers of a fixed length) and nothing in it reads a
host value, so its pieces compile: `CompiledDecoder` holds three graphs,

    prelude:  embed, positions and masks, prelude layers, s_0 (or the previous token's s_r: warm start)
    step:     s_i = core(adapter(s_{i-1}, e)), writing into the slots `cache.begin_step` chose on the host
    coda:     coda layers, final norm, head; s_r kept in the cache's state buffer

and runs the step graph r times from the host. No graph depends on r, so compile time does not grow with it and a
new r costs no compile (one graph of the whole unrolled loop took minutes at r = 32). On CUDA,
`mode="reduce-overhead"` replays each piece as a CUDA graph. Prompts (prefill) run eagerly into the same cache.

Dynamo keeps its graphs, and its recompile budget (8 by default, a hard error under `fullgraph=True`), per code
object. Each decoder compiles copies of the three functions with code objects of their own, one decoder per batch
size, length bucket, policy and backend, so a sweep over many shapes never exhausts a shared budget. Decoders and
caches are kept per model for later `generate` calls (chat turns, lm-eval batches); only the most recently used
`KEPT_CACHES` caches stay allocated, since one cache of a 1B model at batch 32, r = 32 and 2048 tokens holds
about 16 GiB of keys and values.
"""

from __future__ import annotations

import types
from collections import OrderedDict

import torch

from .attention import packed_sdpa
from .compat import CACHE_ARG, cache_kwargs
from .static_cache import StaticRecurrentCache

MIN_LENGTH_BUCKET = 256  # cache lengths are powers of two from here: prompts of nearby lengths share one graph
KEPT_CACHES = 2  # static caches kept allocated per model, least recently used freed first


def _prelude(body, cache, token: torch.LongTensor, new_real: torch.Tensor):
    """e, s_0 and the layers' inputs (masks, rotary embeddings, positions) of one token per row."""
    embedded, layer_kwargs = body._prepare(token, None, new_real, None, cache, {})
    e = body._apply_layers(body.prelude, 0, embedded, **layer_kwargs)
    return e, body.initial_state(e), {name: value for name, value in layer_kwargs.items() if name != CACHE_ARG}


def _warm_prelude(body, cache, token: torch.LongTensor, new_real: torch.Tensor):
    """As `_prelude`, with s_0 the previous token's s_r (warm start)."""
    e, _, layer_kwargs = _prelude(body, cache, token, new_real)
    return e, cache.state, layer_kwargs


def _step(body, cache, state: torch.Tensor, e: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
    """One recurrence step into the slots of the step `cache.begin_step` chose."""
    return body._core_step(state, e, {**layer_kwargs, **cache_kwargs(cache)})


def _coda(model, cache, state: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
    """Next-token logits from s_r; s_r kept for a warm start, the cache advanced by the token."""
    cache.keep_final_state(state)
    cache.end_forward()
    return model.lm_head(model.model._coda(state, {**layer_kwargs, **cache_kwargs(cache)}))


def own_code(function: types.FunctionType) -> types.FunctionType:
    """`function` with a code object of its own: its own dynamo graphs and recompile budget."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)


def _graphs_of(code: types.CodeType) -> list:
    """The graphs dynamo holds for `code` (its cache entries)."""
    return torch._dynamo.eval_frame._debug_get_cache_entry_list(code)


class CompiledDecoder:
    """One decoding step of one token per row, compiled in pieces; called by the model's forward.

    Each piece is called with inputs of one shape, dtype and device only (the decoder's batch size, length bucket
    and policy; caches of any r), so it compiles one graph, and while that graph is its only one its guards are
    not evaluated (`skip_guard_eval_unsafe`): they would only re-check what cannot change, at r + 2 calls a token
    (measured on the CPU: a sixth of a tiny model's decoding time at r = 16). A warm start has a prelude of its own
    rather than a branch on a flag, which would be a second graph that skipped guards could not choose between.
    After `torch._dynamo.reset()` a piece has no graph, and is traced again with its guards."""

    def __init__(self, model, compile: bool | str | object = True):
        # CUDA graphs replay each piece without a launch per kernel. `compile` may name another torch.compile backend.
        mode = "reduce-overhead" if model.device.type == "cuda" and compile is True else None
        backend = "inductor" if compile is True else compile
        options = dict(fullgraph=True, dynamic=False, mode=mode, backend=backend)
        self._code, self._pieces = {}, {}
        for piece in (_prelude, _warm_prelude, _step, _coda):
            own = own_code(piece)
            self._code[piece.__name__], self._pieces[piece.__name__] = own.__code__, torch.compile(own, **options)

    def _run(self, name: str, *args):
        if len(_graphs_of(self._code[name])) == 1:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._pieces[name](*args)
        return self._pieces[name](*args)

    def __call__(self, model, cache: StaticRecurrentCache, token, new_real, num_steps: int, warm_start: bool):
        """Next-token logits (batch, 1, vocab) after `num_steps` recurrences."""
        if num_steps > cache.max_steps:
            raise ValueError(f"this compiled cache holds {cache.max_steps} steps; asked for {num_steps}.")
        prelude = "_warm_prelude" if warm_start and cache.final_state is not None else "_prelude"
        with packed_sdpa(model):  # grouped-query attention without copies of K and V (recurfit.model.attention)
            e, state, layer_kwargs = self._run(prelude, model.model, cache, token, new_real)
            for step in range(1, num_steps + 1):
                cache.begin_step(step)
                state = self._run("_step", model.model, cache, state, e, layer_kwargs)
            cache.end_core(num_steps)
            return self._run("_coda", model, cache, state, layer_kwargs)


def decoding_cache(
    model,
    batch_size: int,
    length: int,
    num_steps: int | None,
    policy: str = "all",
    compile: bool | str | object = True,
) -> StaticRecurrentCache:
    """A reset `StaticRecurrentCache` for `batch_size` rows of up to `length` tokens at up to `num_steps`
    recurrences (None: the model's mean recurrence), with a compiled decoder when `compile` is set: the same cache
    as an earlier call with the same model, batch size, length bucket, r and policy while it is among the
    `KEPT_CACHES` most recently used, and the same decoder (no new compile) for any r."""
    num_steps = num_steps or model.config.mean_recurrence
    bucket = max(MIN_LENGTH_BUCKET, 1 << (length - 1).bit_length())
    backend = compile if isinstance(compile, (bool, str)) else id(compile)
    caches: OrderedDict = model.__dict__.setdefault("_decoding_caches", OrderedDict())  # on the model: freed with it
    key = (batch_size, bucket, num_steps, policy, backend)
    if key not in caches:
        while len(caches) >= KEPT_CACHES:
            caches.popitem(last=False)
        cache = StaticRecurrentCache(model.config, batch_size, bucket, num_steps, policy, model.dtype, model.device)
        if compile:
            decoders = model.__dict__.setdefault("_compiled_decoders", {})
            shape = (batch_size, bucket, policy, backend)
            cache.compiled_step = decoders.get(shape) or decoders.setdefault(shape, CompiledDecoder(model, compile))
        caches[key] = cache
    caches.move_to_end(key)
    cache = caches[key]
    cache.reset()
    return cache
