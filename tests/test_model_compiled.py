"""Compiled decoding: `generate(compile=True)` gives eager `generate`'s tokens, traced once per (batch size, r)."""

from __future__ import annotations

import pytest
import torch
from conftest import GREEDY_TOKENS, AdapterProducts, model_with_state_for_cache, prompts_for_cache, tiny_parent

import recurfit
from recurfit.generation.exit import ExitRule
from recurfit.model import compiled
from recurfit.model.compiled import TokenGraph, graph_counts
from recurfit.model.modeling import _truncated_normal_by_inverse_cdf


def greedy(model, ids, mask, r, new=8, **kwargs):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, num_steps=r, pad_token_id=0, **kwargs
    )


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_the_compiled_step_gives_eager_generates_tokens():
    model = model_with_state_for_cache("qwen3")  # QK-norm and a sliding window: the most varied layer inputs
    ids, mask = prompts_for_cache()  # a left-padded row
    assert torch.equal(greedy(model, ids, mask, 3, compile=True), greedy(model, ids, mask, 3))
    # r left out: the model's mean recurrence, in the static cache as in the eager pass
    mean = model.config.mean_recurrence
    assert torch.equal(greedy(model, ids, mask, None, compile="eager"), greedy(model, ids, mask, mean))


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_grouped_query_attention_decodes_compiled_without_copies_of_keys_and_values(monkeypatch):
    """transformers' SDPA packs a single query token's heads onto the key/value heads only when not compiling, and
    under torch.compile copies K and V (`repeat_kv`) heads / kv heads times over the whole static buffer at every
    layer call. The compiled step attends over the kv heads themselves, with eager decoding's tokens, and leaves
    the model's backend as it was."""
    import transformers.integrations.sdpa_attention as sdpa

    traced_repeats = []
    repeat_kv = sdpa.repeat_kv

    def counted(hidden_states, n_rep):
        if torch.compiler.is_compiling():
            traced_repeats.append(n_rep)
        return repeat_kv(hidden_states, n_rep)

    monkeypatch.setattr(sdpa, "repeat_kv", counted)
    torch._dynamo.reset()  # the pieces are traced here, through the counting repeat_kv
    model = model_with_state_for_cache("llama")
    text = model.config.text_config
    assert text.num_key_value_heads < text.num_attention_heads and text._attn_implementation == "sdpa"
    ids, mask = prompts_for_cache()  # a left-padded row
    compiled = greedy(model, ids, mask, 3, compile=True)
    assert traced_repeats == []
    assert text._attn_implementation == "sdpa"
    assert torch.equal(compiled, greedy(model, ids, mask, 3))


def test_packed_attention_equals_transformers_sdpa():
    """One query token with a mask shared by the heads: the packed heads give SDPA's output with repeated K and V
    (float32, to rounding); anything else is transformers' own function."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from recurfit.model.attention import packed_sdpa_attention_forward

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    key, value = torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    mask = torch.rand(2, 1, 1, 10) > 0.3
    mask[..., 0] = True
    for query, attention_mask in ((torch.randn(2, 6, 1, 8), mask), (torch.randn(2, 6, 4, 8), mask.expand(2, 1, 4, 10))):
        packed, _ = packed_sdpa_attention_forward(module, query, key, value, attention_mask, scaling=0.3)
        repeated, _ = sdpa_attention_forward(
            SimpleNamespace(num_key_value_groups=1, is_causal=True),
            query,
            key.repeat_interleave(3, dim=1),
            value.repeat_interleave(3, dim=1),
            attention_mask,
            scaling=0.3,
        )
        assert packed.shape == repeated.shape == (2, query.shape[2], 6, 8)
        torch.testing.assert_close(packed, repeated)


def test_three_graphs_per_batch_size_whatever_the_depth_and_none_per_token():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()  # counts the graphs dynamo makes and runs them eagerly (no inductor cost here)
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    first = greedy(model, ids, mask, 2, new=10, compile=counter)
    assert counter.frame_count == 3  # prelude, one recurrence step, coda: nine one-token steps, three traces
    assert torch.equal(first, greedy(model, ids, mask, 2, new=10))
    assert torch.equal(greedy(model, ids, mask, 2, new=10, compile=counter), first)
    greedy(model, ids[:, 2:], mask[:, 2:], 2, new=6, compile=counter)  # another prompt length: the same buffers
    assert counter.frame_count == 3
    # a new r runs the same step graph more often: no new trace, and eager's tokens at that r
    assert torch.equal(greedy(model, ids, mask, 5, new=6, compile=counter), greedy(model, ids, mask, 5, new=6))
    assert counter.frame_count == 3
    torch._dynamo.reset()  # the graphs dropped under the kept decoder: traced again (guards were skipped)
    assert torch.equal(greedy(model, ids, mask, 2, new=10, compile=counter), first)
    assert counter.frame_count == 6


def test_the_prelude_graph_multiplies_the_adapters_embedded_half_and_the_step_graph_only_the_states():
    """W_e e is the same at every step of a token: the prelude graph computes it once, and each run of the step
    graph multiplies only the state by W_s (r + 1 products of width h per token, not r of width 2h)."""
    torch._dynamo.reset()
    model = model_with_state_for_cache("llama")
    hidden, r, new = model.config.text_config.hidden_size, 3, 5
    products = AdapterProducts(model.model.adapter)
    widths = {}

    def backend(graph, example_inputs):  # runs each graph eagerly, recording the adapter's products in it
        def run(*args):
            with products:
                output = graph(*args)
            widths.setdefault(graph, []).append(products.widths[:])
            products.widths.clear()
            return output

        return run

    ids, mask = prompts_for_cache()
    assert torch.equal(greedy(model, ids, mask, r, new=new, compile=backend), greedy(model, ids, mask, r, new=new))
    per_graph = sorted(calls for calls in widths.values() if any(calls))
    # the first token comes from the (eager) prompt; each later one runs the prelude once and the step r times
    assert per_graph == [[[hidden]] * (new - 1), [[hidden]] * ((new - 1) * r)]


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_a_sweep_of_twelve_batch_sizes_and_depths_compiles_each_shape_once():
    """lm-eval sweeps r with uneven last batches. Dynamo's recompile budget (8 graphs per code object, a hard
    error under fullgraph) must not be shared by all shapes: each batch size compiles its own three graphs."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    for batch in range(1, 13):
        rows, rows_mask = ids.repeat(6, 1)[:batch], mask.repeat(6, 1)[:batch]
        r = 1 + batch % 4
        got = greedy(model, rows, rows_mask, r, new=3, compile=counter)
        assert torch.equal(got, greedy(model, rows, rows_mask, r, new=3)), (batch, r)
    assert counter.frame_count == 3 * 12


HOST_SYNCS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero"}  # operators that wait on the device


class RecordedOperators(torch.utils._python_dispatch.TorchDispatchMode):
    """Every operator dispatched under it, with the tensors it ran on and its outputs. What it writes is put back
    when the mode exits (a CUDA graph's capture runs nothing), and what it made anew is filled with NaN (or -1):
    read before a replay has written it, it shows."""

    def __init__(self):
        super().__init__()
        self.operators, self.overwritten = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in HOST_SYNCS:
            raise RuntimeError(f"operation not permitted when stream is capturing ({func})")
        for argument, value in zip(func._schema.arguments, [*args, *kwargs.values()], strict=False):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor):
                self.overwritten.append((value, value.clone()))
        outputs = func(*args, **kwargs)
        self.operators.append((func, args, kwargs, outputs))
        return outputs

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for tensor, before in reversed(self.overwritten):
            tensor.copy_(before)
        inputs = {
            t.untyped_storage().data_ptr() for _, args, kwargs, _ in self.operators for t in tensors(args, kwargs)
        }
        for _, _, _, outputs in self.operators:
            for made in (t for t in tensors(outputs) if t.untyped_storage().data_ptr() not in inputs):
                made.fill_(float("nan") if made.is_floating_point() else -1)


def tensors(*values) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


class CapturedOnTheCPU(TokenGraph):
    """`TokenGraph` with a CUDA graph's rules, on the CPU (graphs compiled by a backend that runs them eagerly, so
    that every operator is dispatched): capturing records the operators a token dispatches, on the tensors they
    ran on, and leaves the tensors as they were; a replay runs those operators again on those same tensors,
    writing each result where the capture's went, without the decoder's Python (its choice of slots, its guards).
    A token that reached the captured work other than through the graph's input buffers, or through host state,
    replays the capture's values; a host sync fails the capture, as under CUDA."""

    @staticmethod
    def serves(model, compile) -> bool:
        return True

    def _capture(self, decode):
        with RecordedOperators() as recorded:
            logits = decode()
        self.operators = recorded.operators
        return logits

    def _replay(self) -> None:
        for func, args, kwargs, outputs in self.operators:
            for before, after in zip(tensors(outputs), tensors(func(*args, **kwargs)), strict=True):
                if (before.data_ptr(), before.stride()) != (after.data_ptr(), after.stride()):
                    before.copy_(after)


def teacher_forced_logits(model, cache, ids, mask, prompt: int, r: int, **kwargs) -> torch.Tensor:
    """The logits of each token past `prompt`, fed one at a time through `cache` after the prompt."""
    from recurfit.model.compat import cache_kwargs

    def forward(end: int, width: int):
        step = dict(num_steps=r, **cache_kwargs(cache), **kwargs)
        return model(ids[:, end - width : end], attention_mask=mask[:, :end], **step).logits[:, -1]

    with torch.no_grad():
        forward(prompt, prompt)
        return torch.stack([forward(end, 1) for end in range(prompt + 1, ids.shape[1] + 1)])


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_each_token_replays_the_one_graph_captured_for_its_cache_and_depth(monkeypatch):
    """A key's (cache, r, prelude) first token runs uncaptured, its second is captured, and every later token, in
    this and later calls, replays that capture: eager's logits for tokens fed one at a time (random ones, which a
    replay reading a stale token or position would miss), and no capture past a key's first."""
    from torch._dynamo.testing import CompileCounter

    monkeypatch.setattr(compiled, "TokenGraph", CapturedOnTheCPU)
    counter = CompileCounter()
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache(length=16)
    for r, warm_start in ((2, False), (3, True)):
        for prompt in (8, 11):  # a second prompt length: the same cache, so the same graphs
            eager = compiled.decoding_cache(model, 2, 16, r, compile=False)
            expected = teacher_forced_logits(model, eager, ids, mask, prompt, r, warm_start=warm_start)
            cache = compiled.decoding_cache(model, 2, 16, r, compile=counter)
            got = teacher_forced_logits(model, cache, ids, mask, prompt, r, warm_start=warm_start)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # 8 + 5 tokens at each depth: a key's first uncaptured, its second captured, the rest replayed
    assert graph_counts(model) == {"ran": 2, "captured": 2, "replayed": 2 * 12, "exit runs": 0, "failures": {}}
    assert counter.frame_count == 4  # prelude, warm prelude, step, coda: traced once each
    assert torch.equal(greedy(model, ids, mask, 2, compile=counter), greedy(model, ids, mask, 2))  # recurfit's loop


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_tokens_under_an_exit_rule_replay_captured_segments_and_stop_at_the_checks(monkeypatch):
    """Under an exit rule a key's second token captures its segments (prelude and the first `check_every` steps,
    each later run of steps, the end of the token after each run) and later tokens replay them: uncompiled
    `generate`'s tokens and depths, with no core step outside a replay, and after each run the host's check ends
    the token once every row has settled (the runs replayed are those the deepest row needed)."""
    from torch._dynamo.testing import CompileCounter

    monkeypatch.setattr(compiled, "TokenGraph", CapturedOnTheCPU)
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    rule, every, r, new = ExitRule.parse("argmax:1", check_every=2), 2, 7, 6
    eager = greedy(model, ids, mask, r, new=new, exit_rule=rule, return_dict_in_generate=True)
    got = greedy(model, ids, mask, r, new=new, exit_rule=rule, return_dict_in_generate=True, compile=CompileCounter())
    assert torch.equal(got.sequences, eager.sequences)
    assert torch.equal(got.steps_per_token, eager.steps_per_token)
    deepest = eager.steps_per_token[:, 2:].max(0).values  # the replayed tokens (the prompt's and the first ran)
    assert deepest.min() < r  # some replayed token stops before its last run
    counts = graph_counts(model)
    runs = int(sum((deepest + every - 1) // every - 1))  # after the first run, those up to the deepest row's step
    assert counts == {"ran": 1, "captured": 1, "replayed": new - 2, "exit runs": runs, "failures": {}}


class SyncingOnTheCPU(CapturedOnTheCPU):
    """A capture that meets a host sync, as a token that read a device value on the host would."""

    def _capture(self, decode):
        return super()._capture(lambda: decode() + torch.ones(()).item())


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_a_key_whose_capture_fails_says_why_and_decodes_without_a_graph(monkeypatch):
    monkeypatch.setattr(compiled, "TokenGraph", SyncingOnTheCPU)
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    assert torch.equal(greedy(model, ids, mask, 2, compile="eager"), greedy(model, ids, mask, 2))
    counts = graph_counts(model)
    assert counts["ran"] == 7 and counts["captured"] == counts["replayed"] == 0  # tried once, at the second token
    ((where, why),) = counts["failures"].items()
    assert where == (2, compiled.MIN_LENGTH_BUCKET, "all", 2, "_prelude")
    assert why.startswith("RuntimeError: operation not permitted when stream is capturing")


class OverwrittenOutputs:
    """A compile backend whose graphs' outputs do not outlive their token, on the CPU: graphs run eagerly, and when a
    token's first graph (the decoder's prelude, compiled first) runs again, every tensor the graphs handed out for
    the previous token is overwritten with NaN, as a CUDA graph's replay reuses its outputs' memory. Outputs that
    alias an input (a cache buffer) are not the graphs' own and stay. (`CapturedOnTheCPU` emulates the capture
    compiled decoding makes.)"""

    def __init__(self):
        self.graphs, self.handed_out = 0, []

    def __call__(self, graph, example_inputs):
        index, self.graphs = self.graphs, self.graphs + 1

        def run(*inputs):
            if index == 0:
                for tensor in self.handed_out:
                    tensor.fill_(float("nan"))
                self.handed_out.clear()
            outputs = graph(*inputs)
            owned = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
            self.handed_out += [
                t
                for t in outputs
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.untyped_storage().data_ptr() not in owned
            ]
            return outputs

        return run


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_warm_start_survives_graphs_whose_outputs_are_overwritten():
    """Warm start reads the previous token's s_r. Kept as a graph's output, it could be overwritten before it is
    read (CUDA graphs reuse their outputs' memory); the cache keeps it in a buffer of its own, written in place.
    Prompts of other lengths reuse the graphs (fixed strides)."""
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    backend = OverwrittenOutputs()
    for cut in (0, 3):
        eager = greedy(model, ids[:, cut:], mask[:, cut:], 2, warm_start=True)
        assert torch.equal(greedy(model, ids[:, cut:], mask[:, cut:], 2, warm_start=True, compile=backend), eager)
    assert backend.graphs == 3
    assert not torch.equal(eager, greedy(model, ids[:, 3:], mask[:, 3:], 2))  # the warm start changes the tokens


def test_bf16_weights_decode_compiled_with_a_float32_state():
    """A bf16 model's compiled pieces run under autocast with a float32 stream, and a warm start carries the float32
    state from token to token in the cache's buffer: the logits and tokens of eager decoding through the same static
    cache (the same ops, run by dynamo). Eager decoding with a dynamic cache attends over other lengths, so its bf16
    logits may differ by one rounding, enough to break a tie the other way."""
    from torch._dynamo.testing import CompileCounter

    from recurfit.model.compat import CACHE_ARG
    from recurfit.model.compiled import decoding_cache

    model = model_with_state_for_cache("llama").to(torch.bfloat16)
    ids, mask = prompts_for_cache()
    counter = CompileCounter()
    compiled = greedy(model, ids, mask, 3, new=10, warm_start=True, compile=counter)  # recurfit's loop
    logged = dict(warm_start=True, output_logits=True, return_dict_in_generate=True)  # transformers' loop
    with_logits = greedy(model, ids, mask, 3, new=10, compile=counter, **logged)
    static = decoding_cache(model, len(ids), ids.shape[1] + 10, 3, compile=False)
    eager = greedy(model, ids, mask, 3, new=10, **{CACHE_ARG: static}, **logged)
    assert torch.equal(compiled, eager.sequences) and torch.equal(with_logits.sequences, eager.sequences)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(with_logits.logits, eager.logits, strict=True))
    assert counter.frame_count == 3
    (cache,) = (c for c in model._decoding_caches.values() if c.compiled_step is not None)
    assert cache.state.dtype == torch.float32 and cache.keys[0].dtype == torch.bfloat16


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_compiled_decoding_stops_rows_at_eos_and_samples_like_eager():
    from torch._dynamo.testing import CompileCounter

    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    free = greedy(model, ids, mask, 2, new=12)
    eos = int(free[0, ids.shape[1] + 2])  # row 0's third new token
    counter = CompileCounter()
    assert torch.equal(
        greedy(model, ids, mask, 2, new=12, eos_token_id=eos, compile=counter),
        greedy(model, ids, mask, 2, new=12, eos_token_id=eos),
    )
    sampled = {}
    for compile in (False, counter):
        torch.manual_seed(3)
        sampled[compile] = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=True,
            temperature=0.9,
            top_p=0.9,
            num_steps=2,
            pad_token_id=0,
            compile=compile,
        )
    assert torch.equal(sampled[False], sampled[counter])


def test_a_random_initial_state_compiles_into_the_step():
    """With σ > 0 (every real retrofit) s_0 is drawn inside the graph, by the inverse CDF of the truncated normal."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = recurfit.retrofit(tiny_parent("llama"), (2, 2, 2), adapter_init="random").eval()
    assert model.config.state_init_std > 0
    ids, mask = prompts_for_cache()
    counter = CompileCounter()
    out = greedy(model, ids, mask, 2, new=5, compile=counter)  # fullgraph: a graph break would raise here
    assert counter.frame_count == 3 and out.shape == (2, ids.shape[1] + 5)
    draws = _truncated_normal_by_inverse_cdf(torch.zeros(4096), 0.5)
    assert draws.abs().max() <= 1.5 and abs(draws.std().item() - 0.5 * 0.9866) < 0.02  # TruncNormal(±3σ)'s std


def test_compiled_decoding_refuses_what_it_cannot_do():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    with pytest.raises(ValueError, match="one beam"):
        greedy(model, ids, mask, 2, num_beams=2, compile="eager")


# ------------------------------------------------------------ recurfit's decoding loop around the compiled step


def decode(model, ids, mask, new, loop=True, monkeypatch=None, compile="eager", **kwargs):
    """`generate` with recurfit's loop (`loop=True`), transformers' loop around the same compiled step
    (`loop=False`), or eagerly (`compile=False`)."""
    if not loop:
        monkeypatch.setattr(recurfit.model.modeling, "loop_may_run", lambda args, kwargs: False)
    try:
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new, num_steps=2, pad_token_id=0, compile=compile, **kwargs
        )
    finally:
        if not loop:
            monkeypatch.undo()


def hf_loop_refused(monkeypatch):
    """transformers' loop (`GenerationMixin._sample`) raises when entered; returns the calls it refused."""
    from transformers import GenerationMixin

    entered = []
    monkeypatch.setattr(GenerationMixin, "_sample", lambda *args, **kwargs: entered.append(1) or 1 / 0)
    return entered


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_the_loop_ends_rows_at_eos_at_different_steps_as_generate(monkeypatch):
    """Rows reach EOS at different steps, the last past the first 16-token chunk: finished rows are padded, and the
    output ends at the token where the last row finished (the loop ran on to the end of its chunk), as generate's."""
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache(batch=3)
    mask[2, :2] = 0
    prompt = ids.shape[1]
    free = decode(model, ids, mask, 40, compile=False, do_sample=False)[:, prompt:].tolist()
    late = next(token for i, token in enumerate(free[-1]) if i > 16 and token not in free[-1][:i])
    eos = [free[0][0], late]  # the first row's first token; the last row's first new token past the first chunk
    expected = decode(model, ids, mask, 40, compile=False, do_sample=False, eos_token_id=eos)
    assert 16 + 2 <= expected.shape[1] - prompt < 32
    assert (expected[:, prompt:] == 0).any(-1).tolist() == [True, True, False]  # rows 0 and 1 ended early
    entered = hf_loop_refused(monkeypatch)
    assert torch.equal(decode(model, ids, mask, 40, do_sample=False, eos_token_id=eos), expected)
    assert entered == []
    monkeypatch.undo()
    assert torch.equal(decode(model, ids, mask, 40, False, monkeypatch, do_sample=False, eos_token_id=eos), expected)


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_the_loop_makes_exactly_max_new_tokens(monkeypatch):
    """Also at batch 1, where the loop's inputs to the graphs it shares with transformers' loop must have the same
    strides (skipped guards: another stride is a recompile, an error)."""
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    for rows in (2, 1):
        for new in (1, 21):  # 21: one chunk of 16 and part of another
            expected = decode(model, ids[:rows], mask[:rows], new, compile=False, do_sample=False)
            assert expected.shape[1] == ids.shape[1] + new
            assert torch.equal(decode(model, ids[:rows], mask[:rows], new, do_sample=False), expected)
            got = decode(model, ids[:rows], mask[:rows], new, False, monkeypatch, do_sample=False)
            assert torch.equal(got, expected)


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_the_loop_samples_generates_tokens_under_a_seed_and_leaves_the_generator_as_generate(monkeypatch):
    """temperature, top-k and top-p: transformers' warpers in its order, then its draw. A call whose rows all end
    early undoes the draws of the tokens past the end, so the next call under the same seed draws as generate's."""
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    settings = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    torch.manual_seed(7)
    free = decode(model, ids, mask, 24, compile=False, **settings)
    eos = free[:, ids.shape[1] + 2].tolist()  # each row's third token: every row ends by then

    def two_calls(**kwargs):
        torch.manual_seed(7)
        first = decode(model, ids, mask, 24, **settings, eos_token_id=eos, **kwargs)
        return first, decode(model, ids, mask, 24, **settings, **kwargs), torch.rand(1)

    expected = two_calls(compile=False)
    assert expected[0].shape[1] <= ids.shape[1] + 3  # the loop runs on to the end of its first chunk
    assert all(map(torch.equal, two_calls(loop=False, monkeypatch=monkeypatch), expected))
    entered = hf_loop_refused(monkeypatch)
    assert all(map(torch.equal, two_calls(), expected))
    assert entered == []


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_requests_the_loop_does_not_decode_alike_run_transformers_loop(monkeypatch):
    """Another logits processor, a dict output or a streamer: transformers' loop around the compiled step."""
    from transformers import GenerationMixin
    from transformers.generation.streamers import BaseStreamer

    class Streamer(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    entered, sample = [], GenerationMixin._sample
    monkeypatch.setattr(
        GenerationMixin, "_sample", lambda *args, **kwargs: entered.append(1) or sample(*args, **kwargs)
    )
    for request in (dict(repetition_penalty=1.3), dict(return_dict_in_generate=True), dict(streamer=Streamer())):
        expected = decode(model, ids, mask, 6, compile=False, do_sample=False, **request)
        got = decode(model, ids, mask, 6, do_sample=False, **request)
        if not isinstance(got, torch.Tensor):
            got, expected = got.sequences, expected.sequences
        assert torch.equal(got, expected), request
        assert len(entered) == 2, request
        entered.clear()
