"""Compiled decoding: a token's prelude, one recurrence step and its coda + head, each compiled once.

Eager decoding of a depth-recurrent model is launch-bound: every token runs P + r·R + C decoder layers of a dozen
small ops each, and the dynamic cache does host bookkeeping at every layer call. With a `StaticRecurrentCache`
every shape of a decoding step is fixed (one token per row, buffers of a fixed length) and nothing in it reads a
host value, so its pieces compile: `CompiledDecoder` holds three graphs,

    prelude:  embed, positions and masks, prelude layers, the adapter's W_e e, s_0 (or the previous token's s_r)
    step:     s_i = core(W_s s_{i-1} + W_e e), writing into the slots `cache.begin_step` chose on the host
    coda:     coda layers, final norm, head; s_r kept in the cache's state buffer

and runs the step graph r times from the host. No graph depends on r, so compile time does not grow with it and a
new r costs no compile (one graph of the whole unrolled loop took minutes at r = 32). Prompts (prefill) run eagerly
into the same cache.

On CUDA a whole token (prelude, r steps, coda) is then captured as one `torch.cuda.CUDAGraph` per cache, r and
prelude, and replayed for every later token with those (`TokenGraph`, the way gpt-fast and vLLM capture a decoding
step): one launch per token instead of a few hundred, and replay by construction. A replay repeats the recorded
kernels on the addresses they were recorded with, so everything a token reads or writes has a fixed address: the
weights, the cache's buffers, each step's slots (chosen on the host at capture, the same at every later token), the
graph's own input buffers (the token and its padding flag, copied in before each replay) and its intermediates and
logits (its private memory pool; the logits are copied out after the replay). Host work (choosing slots, dynamo's
guards) runs at capture only. CUDA graph trees (`mode="reduce-overhead"`) are not used: they would record one node
per compiled call, and a node replays only while its inputs keep their recorded addresses, which the step's inputs
do not (another step's slots at every call).

Dynamo keeps its graphs, and its recompile budget (8 by default, a hard error under `fullgraph=True`), per code
object. Each decoder compiles copies of the three functions with code objects of their own, one decoder per batch
size, length bucket, policy and backend, so a sweep over many shapes never exhausts a shared budget. Decoders and
caches are kept per model for later `generate` calls (chat turns, lm-eval batches); only the most recently used
`KEPT_CACHES` caches stay allocated, since one cache of a 1B model at batch 32, r = 32 and 2048 tokens holds
about 16 GiB of keys and values.

Under an exit rule a token's steps are a fourth piece, `_exit_step`, over the whole batch with settled rows frozen
in it, and the host asks once per `check_every` steps whether all have settled (`CompiledDecoder`); on CUDA the
token is captured in segments between those checks (`ExitGraphs`).

`decoding_loop` is `generate(compile=True)`'s loop around the decoder, handed to transformers' `generate` as its
`custom_generate`: transformers prepares the request (generation config, special tokens, logits warpers, stopping
criteria) and the loop calls the decoder once per token, picks the token as transformers' loop does, and reads the
device (have all rows finished?) once per `CHECK_EVERY` tokens instead of once per token, with none of transformers'
per-token bookkeeping (model kwargs, input preparation, a growing `input_ids`). Requests it does not do the same
way (other logits processors or stopping criteria, a streamer, scores or a dict as output) go to transformers' loop.
"""

from __future__ import annotations

import functools
import types
from collections import Counter, OrderedDict
from collections.abc import Callable

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.generation import (
    EosTokenCriteria,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..defaults import EXIT_CRITERIA
from .attention import packed_sdpa
from .compat import CACHE_ARG, cache_kwargs
from .static_cache import StaticRecurrentCache

MIN_LENGTH_BUCKET = 256  # cache lengths are powers of two from here: prompts of nearby lengths share one graph
KEPT_CACHES = 2  # static caches kept allocated per model, least recently used freed first
CHECK_EVERY = 16  # tokens between `decoding_loop`'s looks (on the host) at whether every row has finished

# What `decoding_loop` does as transformers' loop does. The warpers read only a token's scores (not the sequence so
# far); they and the stops come from transformers' own preparation, in its order and with its settings.
LOOP_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
LOOP_STOPS = (MaxLengthCriteria, EosTokenCriteria)
# The model kwargs `generate` passes that the loop reads or may drop (the compiled step keeps positions itself);
# with any other, transformers' loop passes it on to `forward` at every token.
LOOP_MODEL_KWARGS = {
    CACHE_ARG, "attention_mask", "position_ids", "use_cache", "logits_to_keep", "num_steps", "warm_start", "steps_log",
    "exit_rule",
}  # fmt: skip
# Arguments transformers does not hand a `custom_generate` callable (it keeps only the callable's own): a request
# with one runs transformers' loop. So do positional ones past `prefix_allowed_tokens_fn` (the fifth), which are
# `synced_gpus`, `assistant_model` and `streamer`.
HF_LOOP_ARGUMENTS = (
    "streamer",
    "assistant_model",
    "synced_gpus",
    "tokenizer",
    "assistant_tokenizer",
    "custom_generate",
)
MAX_LOOP_POSITIONALS = 5


def _prelude(body, cache, token: torch.LongTensor, new_real: torch.Tensor):
    """The adapter's part in e (W_e e: the same at every step, so computed here once), s_0 and the layers' inputs
    (masks, rotary embeddings, positions) of one token per row."""
    embedded, layer_kwargs = body._prepare(token, None, new_real, None, cache, {})
    e = body._apply_layers(body.prelude, 0, embedded, **layer_kwargs)
    inputs = {name: value for name, value in layer_kwargs.items() if name != CACHE_ARG}
    return body.embedded_part(e), body.initial_state(e), inputs


def _warm_prelude(body, cache, token: torch.LongTensor, new_real: torch.Tensor):
    """As `_prelude`, with s_0 the previous token's s_r (warm start)."""
    part, _, layer_kwargs = _prelude(body, cache, token, new_real)
    return part, cache.state, layer_kwargs


def _step(body, cache, state: torch.Tensor, part: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
    """One recurrence step into the slots of the step `cache.begin_step` chose: W_s s plus the prelude's W_e e."""
    return body._core_step(state, None, {**layer_kwargs, **cache_kwargs(cache)}, part=part)


def _exit_step(model, cache, tracker, state: torch.Tensor, part: torch.Tensor, layer_kwargs: dict, head_logits):
    """One recurrence step under an exit rule, over every row: rows that settled keep their state, and their keys
    and values at this step are their latest step's (`cache.begin_step` was given `tracker.done` as the frozen
    rows); then the rule's check, reading the coda and head at the new state for `kl` and `argmax` as `generate`'s
    exit probe reads them (`head_logits`: `modeling.float32_logits`; the coda's keys and values at the new position
    are overwritten by the token's final coda). Every row runs, so the step has one
    shape, one graph, and replays; settled rows cost their share of the step (see `CompiledDecoder`)."""
    kwargs = {**layer_kwargs, **cache_kwargs(cache)}
    stepped = model.model._core_step(state, None, kwargs, part=part)
    stepped = torch.where(tracker.done[:, None, None], state, stepped)
    tracker.check(state, stepped, lambda now: head_logits(model.lm_head, model.model._coda(now, kwargs)))
    return stepped


def _coda(model, cache, state: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
    """Next-token logits from s_r; s_r kept for a warm start, the cache advanced by the token."""
    cache.keep_final_state(state)
    cache.end_forward()
    return model.lm_head(model.model._coda(state, {**layer_kwargs, **cache_kwargs(cache)}))


def own_code(function: types.FunctionType) -> types.FunctionType:
    """`function` with a code object of its own: its own dynamo graphs and recompile budget."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)


def exit_piece(criterion: str) -> str:
    return f"_exit_step:{criterion}"


def _graphs_of(code: types.CodeType) -> list:
    """The graphs dynamo holds for `code` (its cache entries)."""
    return torch._dynamo.eval_frame._debug_get_cache_entry_list(code)


class TokenGraph:
    """Work of one token captured as one CUDA graph, replayed for every later token of its key (see the module's
    docstring): a whole token at a fixed depth, or one segment of a token under an exit rule (`ExitGraphs`).
    `decode(*inputs)` is run once, under capture, on the graph's own copies of `inputs`: a replay reads whatever
    was last copied into them, and writes its output where the capture put it (read it before the next replay)."""

    @staticmethod
    def serves(model, compile) -> bool:
        """Whether tokens of `model` compiled with `compile` are captured: inductor's kernels on a GPU."""
        return model.device.type == "cuda" and compile is True

    def __init__(self, decode: Callable, *inputs: torch.Tensor):
        self.inputs = [tensor.clone() for tensor in inputs]
        self.output = self._capture(lambda: decode(*self.inputs))

    def _capture(self, decode: Callable[[], object]) -> object:
        """Record `decode`'s kernels without running them; return its output (written by each replay)."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # a private memory pool: the intermediates' addresses stay the graph's
            return decode()

    def _replay(self) -> None:
        self.graph.replay()

    def __call__(self, *inputs: torch.Tensor):
        for buffer, value in zip(self.inputs, inputs, strict=True):
            buffer.copy_(value)
        self._replay()
        return self.output


class ExitGraphs:
    """One key's tokens under an exit rule as CUDA graphs of segments: the prelude with the first `check_every`
    steps, each later run of `check_every` steps, and per place the loop may stop (after each run) the rest of
    the token (the latest-step copies into deeper slots, coda, head). Between runs the host reads whether every
    row settled (one wait per `check_every` steps, as uncompiled `generate`) and replays the next run or the
    stop. Each segment reads the one before's outputs where its capture found them (kept alive here), so a token
    replays its segments with no copies between them; every segment runs the whole batch (settled rows frozen),
    so the batch of the decoding loop is the one size any segment is captured at, and no narrowed step runs
    outside a graph. All segments are captured at a key's second token, then replayed for it."""

    def __init__(self, decoder: CompiledDecoder, model, cache, prelude: str, num_steps: int, tracker, token, new_real):
        self.tracker, self.ends = tracker, decoder.run_ends(num_steps, tracker)
        graph = TokenGraph  # looked up here: tests replace it with a CPU emulation
        with packed_sdpa(model):
            self.head = graph(
                lambda tok, real: decoder.exit_head(model, cache, prelude, tracker, tok, real, self.ends[0]),
                token,
                new_real,
            )
            part, state, layer_kwargs = self.head.output
            self.runs, self.stops = [], []
            for begin, end in zip(self.ends, self.ends[1:], strict=False):
                self.stops.append(graph(functools.partial(decoder.exit_stop, model, cache, state, layer_kwargs, begin)))
                run = functools.partial(
                    decoder.exit_steps, model, cache, tracker, state, part, layer_kwargs, begin, end
                )
                self.runs.append(graph(run))
                state = self.runs[-1].output
            self.stops.append(graph(functools.partial(decoder.exit_stop, model, cache, state, layer_kwargs, end)))

    def __call__(self, token, new_real) -> tuple[torch.Tensor, int]:
        """The token's logits, and how many runs of steps it replayed after the first."""
        self.head(token, new_real)
        for index, run in enumerate(self.runs):
            if bool(self.tracker.done.all()):  # the host's one wait per `check_every` steps
                return self.stops[index](), index
            run()
        return self.stops[-1](), len(self.runs)


WARMED_UP = "warmed up"  # a key whose first token ran uncaptured: its next one is captured
UNCAPTURED = "uncaptured"  # a key whose capture failed: its tokens run without a graph


class CompiledDecoder:
    """One decoding step of one token per row, compiled in pieces; called by the model's forward.

    Each piece is called with inputs of one shape, dtype and device only (the decoder's batch size, length bucket
    and policy; caches of any r), so it compiles one graph, and while that graph is its only one its guards are
    not evaluated (`skip_guard_eval_unsafe`): they would only re-check what cannot change, at r + 2 calls a token
    (measured on the CPU: a sixth of a tiny model's decoding time at r = 16). A warm start has a prelude of its own
    rather than a branch on a flag, which would be a second graph that skipped guards could not choose between.
    After `torch._dynamo.reset()` a piece has no graph, and is traced again with its guards.

    Under an exit rule (`decode(..., exit_rule=...)`), each step is `_exit_step` over the whole batch: settled rows
    stay in it, frozen (their state by a `torch.where`, their keys and values by a masked write), as uncompiled
    `generate` keeps them with `check_every` > 1, rather than leaving it as it drops them with `check_every` = 1.
    The tokens and exit depths are the same either way; the fixed batch is what keeps one graph per step (no
    recompile as rows settle) and lets a CUDA graph of it replay, at the price of computing settled rows until the
    whole batch has settled. The host reads whether it has once per `check_every` steps (`run_ends`), the only
    wait on the device in a token.

    Where `TokenGraph.serves` (inductor on a GPU), a key's (cache, r, prelude; the criterion and `check_every`
    under an exit rule) first token runs the pieces uncaptured (they compile and tune there, outside any capture),
    its second is captured, and every later one replays that graph (under an exit rule, its segments:
    `ExitGraphs`). `counts` says how many tokens each way went ("ran" uncaptured, "captured", "replayed": a capture
    is replayed at once, so captured tokens count as replayed too) and, under exit rules, how many runs of
    `check_every` steps replayed tokens needed past their first ("exit runs"); `failures` says why a key's capture
    failed (its tokens then run uncaptured)."""

    def __init__(self, model, compile: bool | str | object = True):
        # `compile` may name another torch.compile backend.
        backend = "inductor" if compile is True else compile
        options = dict(fullgraph=True, dynamic=False, backend=backend)
        self._code, self._pieces = {}, {}
        pieces = {piece.__name__: piece for piece in (_prelude, _warm_prelude, _step, _coda)}
        # One exit step per criterion: its code differs by criterion (which the tracker's Python reads), and a code
        # object of its own keeps each to one graph (guards skipped, no recompile between rules).
        pieces.update({exit_piece(criterion): _exit_step for criterion in EXIT_CRITERIA})
        for name, piece in pieces.items():
            own = own_code(piece)
            self._code[name], self._pieces[name] = own.__code__, torch.compile(own, **options)
        self.captures = TokenGraph.serves(model, compile)
        from .modeling import float32_logits  # (modeling imports this module) the exit probe's head, as eager's

        self._head_logits = float32_logits
        self.counts: Counter = Counter()
        self.failures: dict[tuple, str] = {}

    def _run(self, name: str, *args):
        if len(_graphs_of(self._code[name])) == 1:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._pieces[name](*args)
        return self._pieces[name](*args)

    def _token(self, model, cache: StaticRecurrentCache, prelude: str, num_steps: int, token, new_real):
        with packed_sdpa(model):  # grouped-query attention without copies of K and V (recurfit.model.attention)
            part, state, layer_kwargs = self._run(prelude, model.model, cache, token, new_real)
            for step in range(1, num_steps + 1):
                cache.begin_step(step)
                state = self._run("_step", model.model, cache, state, part, layer_kwargs)
            cache.end_core(num_steps)
            return self._run("_coda", model, cache, state, layer_kwargs)

    # ------------------------------------------------------------ a token under an exit rule

    @staticmethod
    def run_ends(num_steps: int, tracker) -> list[int]:
        """The steps after which the host asks whether every row has settled, as uncompiled `generate` asks (at
        multiples of `check_every`); the last is `num_steps`, where the token ends anyway."""
        return [*range(tracker.rule.check_every, num_steps, tracker.rule.check_every), num_steps]

    def exit_head(self, model, cache, prelude: str, tracker, token, new_real, end: int):
        """The prelude and steps 1 … `end` of a token under an exit rule: (W_e e, the state, the layers' inputs)."""
        part, state, layer_kwargs = self._run(prelude, model.model, cache, token, new_real)
        tracker.reset()
        return part, self.exit_steps(model, cache, tracker, state, part, layer_kwargs, 0, end), layer_kwargs

    def exit_steps(self, model, cache, tracker, state, part, layer_kwargs, begin: int, end: int) -> torch.Tensor:
        """Steps `begin` + 1 … `end` under the tracker's rule."""
        name = exit_piece(tracker.criterion)
        for step in range(begin + 1, end + 1):
            cache.begin_step(step, frozen=tracker.done)
            state = self._run(name, model, cache, tracker, state, part, layer_kwargs, self._head_logits)
        return state

    def exit_stop(self, model, cache, state, layer_kwargs, steps_run: int) -> torch.Tensor:
        """The end of a token whose loop stopped after `steps_run` steps: deeper slots, coda, head."""
        cache.end_core(steps_run)
        return self._run("_coda", model, cache, state, layer_kwargs)

    def _exit_token(self, model, cache, prelude: str, num_steps: int, tracker, token, new_real) -> torch.Tensor:
        """A token under an exit rule, uncaptured: its loop ends at the first check that finds every row settled."""
        ends = self.run_ends(num_steps, tracker)
        with packed_sdpa(model):
            part, state, layer_kwargs = self.exit_head(model, cache, prelude, tracker, token, new_real, ends[0])
            for begin, end in zip(ends, ends[1:], strict=False):
                if bool(tracker.done.all()):  # the host's one wait per `check_every` steps
                    return self.exit_stop(model, cache, state, layer_kwargs, begin)
                state = self.exit_steps(model, cache, tracker, state, part, layer_kwargs, begin, end)
            return self.exit_stop(model, cache, state, layer_kwargs, ends[-1])

    def _tracker(self, model, cache: StaticRecurrentCache, exit_rule):
        """The cache's exit buffers (fixed addresses for its captures), bound to `exit_rule`."""
        if cache.exit_tracker is None:
            vocabulary = model.lm_head.weight.shape[0]
            cache.exit_tracker = exit_rule.start_static(cache.real.shape[0], vocabulary, cache.real.device)
        cache.exit_tracker.bind(exit_rule)
        return cache.exit_tracker

    # ------------------------------------------------------------ the model's call

    def __call__(
        self, model, cache: StaticRecurrentCache, token, new_real, num_steps: int, warm_start: bool, exit_rule=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits (batch, 1, vocab) after `num_steps` recurrences, or under `exit_rule` at most that many,
        with each row's steps (None at a fixed depth: `num_steps` each)."""
        if num_steps > cache.max_steps:
            raise ValueError(f"this compiled cache holds {cache.max_steps} steps; asked for {num_steps}.")
        prelude = "_warm_prelude" if warm_start and cache.final_state is not None else "_prelude"
        # One step leaves nothing to exit from (every row runs it, as uncompiled `generate`'s would).
        tracker = None if exit_rule is None or num_steps == 1 else self._tracker(model, cache, exit_rule)
        rule = () if tracker is None else (tracker.criterion, exit_rule.check_every)
        key = (num_steps, prelude, *rule)
        graph = cache.token_graphs.get(key) if self.captures else UNCAPTURED
        if graph == WARMED_UP:
            graph = cache.token_graphs[key] = self._capture(model, cache, prelude, num_steps, tracker, token, new_real)
        steps = None if tracker is None else tracker.steps
        if isinstance(graph, ExitGraphs):
            self.counts["replayed"] += 1
            logits, runs = graph(token, new_real)
            self.counts["exit runs"] += runs
            return logits.clone(), steps.clone()  # the next replay overwrites the graph's own
        if isinstance(graph, TokenGraph):
            self.counts["replayed"] += 1
            return graph(token, new_real).clone(), None
        if graph is None:
            cache.token_graphs[key] = WARMED_UP  # compiled and tuned by this token: the next one is captured
        self.counts["ran"] += 1
        if tracker is None:
            return self._token(model, cache, prelude, num_steps, token, new_real), None
        return self._exit_token(model, cache, prelude, num_steps, tracker, token, new_real), steps.clone()

    def _capture(self, model, cache: StaticRecurrentCache, prelude: str, num_steps: int, tracker, token, new_real):
        """A `TokenGraph` (`ExitGraphs` under an exit rule) of this key's tokens, or UNCAPTURED (with the reason in
        `failures`) if capture failed."""
        try:
            if tracker is None:
                graph = TokenGraph(functools.partial(self._token, model, cache, prelude, num_steps), token, new_real)
            else:
                graph = ExitGraphs(self, model, cache, prelude, num_steps, tracker, token, new_real)
        except Exception as error:  # reported by `graph_counts`; the key's tokens run uncaptured
            rule = () if tracker is None else (tracker.criterion, tracker.rule.check_every)
            where = (cache.real.shape[0], cache.max_length, cache.policy, num_steps, prelude, *rule)
            self.failures[where] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            return UNCAPTURED
        self.counts["captured"] += 1
        return graph


def graph_counts(model) -> dict:
    """The compiled decoders' token counts summed over `model`'s decoders (see `CompiledDecoder`), and each failed
    capture's reason by (batch, length bucket, policy, r, prelude; the exit criterion and `check_every`)."""
    decoders = model.__dict__.get("_compiled_decoders", {}).values()
    counts = sum((decoder.counts for decoder in decoders), Counter())
    failures = {key: why for decoder in decoders for key, why in decoder.failures.items()}
    named = ("ran", "captured", "replayed", "exit runs")
    return {**{name: counts[name] for name in named}, "failures": failures}


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


def loop_may_run(args: tuple, kwargs: dict) -> bool:
    """Whether `generate(*args, **kwargs)` may hand its decoding to `decoding_loop` (which then checks the
    prepared request) rather than run transformers' loop."""
    return len(args) <= MAX_LOOP_POSITIONALS and all(kwargs.get(name) is None for name in HF_LOOP_ARGUMENTS)


def _loop_decodes(model, input_ids, processors, stops, config: GenerationConfig, model_kwargs: dict) -> bool:
    """Whether `decoding_loop` gives transformers' output for this prepared request: warpers only, stops at the
    length and EOS only, the sequences alone as output, one compiled token at a time, model kwargs it knows, the
    prompt on the model's device (transformers' loop keeps its tokens where the prompt is)."""
    cache = model_kwargs.get(CACHE_ARG)
    return (
        input_ids.device == model.device
        and all(type(processor) in LOOP_WARPERS for processor in processors)
        and all(type(stop) in LOOP_STOPS for stop in stops)
        and not config.return_dict_in_generate
        and getattr(config, "prefill_chunk_size", None) is None
        and model_kwargs.get("use_cache", True)
        and model_kwargs.keys() <= LOOP_MODEL_KWARGS
        and getattr(cache, "compiled_step", None) is not None
    )


def decoding_loop(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    **model_kwargs,
) -> torch.LongTensor:
    """transformers' greedy / sampling loop (`GenerationMixin._sample`) for a compiled static cache, with the same
    output: the prompt eagerly as transformers runs it, then one compiled step per token into a preallocated buffer.
    A row that has emitted EOS gets `pad_token_id` from then on; whether every row has finished is read once per
    `CHECK_EVERY` tokens, and the tokens (and random draws) past the step where the last row finished are undone.
    Requests it does not decode the same way go to transformers' loop (see `_loop_decodes`)."""
    if not _loop_decodes(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
        return GenerationMixin._sample(
            model,
            input_ids,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            generation_config=generation_config,
            **model_kwargs,
        )
    prompt, new = input_ids.shape[1], max(generation_config.max_length - input_ids.shape[1], 1)  # >= 1, as theirs
    sequences = torch.cat([input_ids, input_ids.new_zeros(input_ids.shape[0], new)], dim=1)
    logits = model(**model.prepare_inputs_for_generation(input_ids, **model_kwargs), return_dict=True).logits
    step = _TokenStep(model, model_kwargs, input_ids)
    eos = next((stop for stop in stopping_criteria if isinstance(stop, EosTokenCriteria)), None)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    emitted = torch.zeros((), dtype=torch.long, device=input_ids.device)  # tokens transformers' loop would make
    draws = _Draws(input_ids.device)
    for index in range(new):
        scores = logits_processor(sequences[:, : prompt + index], logits[:, -1].to(copy=True, dtype=torch.float32))
        tokens = _choose(scores, generation_config.do_sample)
        if eos is not None:  # finished rows get padding, as in transformers' loop
            pad = generation_config._pad_token_tensor  # generate's pad token (EOS where none was set)
            tokens = tokens * unfinished + pad * (1 - unfinished)
        emitted += unfinished.any()
        sequences[:, prompt + index] = tokens
        if eos is not None:
            unfinished &= ~eos(sequences[:, : prompt + index + 1], None)
        draws.record(index)
        if (index + 1) % CHECK_EVERY == 0:
            if not unfinished.any():  # the one host sync of a chunk
                break
            draws.forget()  # rows run on: every token so far is kept
        if index + 1 < new:
            logits = step(tokens)
    made = int(emitted)
    draws.undo_after(made - 1)
    if isinstance(model_kwargs.get("steps_log"), list):  # the prompt's forward logged its own row already
        model_kwargs["steps_log"] += step.log[: made - 1]
    return sequences[:, : prompt + made].contiguous()


def _choose(scores: torch.Tensor, sample: bool) -> torch.LongTensor:
    """The next token per row from the warped scores, drawn as transformers' sampling draws it."""
    if sample:
        return torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)


class _TokenStep:
    """The decoder's call for one new token per row, with the inputs `forward`'s compiled path gives it: the
    model's depth and exit rule, contiguous tokens and a new-token mask of generate's mask dtype (the two loops
    share graphs, which fail on another dtype or stride). `log` holds each token's steps per row (on the device)."""

    def __init__(self, model, model_kwargs: dict, input_ids: torch.LongTensor):
        self.model, self.cache = model, model_kwargs[CACHE_ARG]
        self.steps = sum(model.model.resolve_num_steps(model_kwargs.get("num_steps")))
        self.warm_start = model_kwargs.get("warm_start", False)
        self.exit_rule = model_kwargs.get("exit_rule")
        mask = model_kwargs.get("attention_mask")
        dtype = torch.long if mask is None else mask.dtype
        self.new_real = torch.ones(input_ids.shape[0], 1, dtype=dtype, device=input_ids.device)  # contiguous
        self.fixed = torch.full((input_ids.shape[0],), self.steps, device=input_ids.device)
        self.log: list[torch.Tensor] = []

    def __call__(self, tokens: torch.LongTensor) -> torch.Tensor:
        logits, steps = self.cache.compiled_step(
            self.model, self.cache, tokens.view(-1, 1), self.new_real, self.steps, self.warm_start, self.exit_rule
        )
        self.log.append(self.fixed if steps is None else steps)
        return logits


class _Draws:
    """The random generator's state after each token, so that tokens made past the end can be undone: a later
    draw (the next `generate` under the same seed) continues where transformers' loop would have left it."""

    def __init__(self, device: torch.device):
        self.rng = torch if device.type == "cpu" else torch.get_device_module(device)
        self.device = () if device.type == "cpu" else (device,)
        self.states: dict[int, torch.Tensor] = {}

    def record(self, index: int) -> None:
        self.states[index] = self.rng.get_rng_state(*self.device)

    def forget(self) -> None:
        self.states.clear()

    def undo_after(self, index: int) -> None:
        if index + 1 in self.states:
            self.rng.set_rng_state(self.states[index], *self.device)
