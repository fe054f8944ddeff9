"""Compiled decoding: `generate(compile=True)` gives eager `generate`'s tokens, traced once per (batch size, r)."""

from __future__ import annotations

import pytest
import torch
from conftest import GREEDY_TOKENS, model_with_state_for_cache, prompts_for_cache, tiny_parent

import recurfit
from recurfit.generation.exit import ExitRule
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


def test_one_trace_per_batch_size_and_depth_and_none_per_token():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()  # counts the graphs dynamo makes and runs them eagerly (no inductor cost here)
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    first = greedy(model, ids, mask, 2, new=10, compile=counter)
    assert counter.frame_count == 1  # nine one-token steps, one trace
    assert torch.equal(first, greedy(model, ids, mask, 2, new=10))
    assert torch.equal(greedy(model, ids, mask, 2, new=10, compile=counter), first)
    greedy(model, ids[:, 2:], mask[:, 2:], 2, new=6, compile=counter)  # another prompt length: the same buffers
    assert counter.frame_count == 1
    greedy(model, ids, mask, 3, new=6, compile=counter)
    assert counter.frame_count == 2  # a new r is a new graph, traced once


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
    assert counter.frame_count == 1 and out.shape == (2, ids.shape[1] + 5)
    draws = _truncated_normal_by_inverse_cdf(torch.zeros(4096), 0.5)
    assert draws.abs().max() <= 1.5 and abs(draws.std().item() - 0.5 * 0.9866) < 0.02  # TruncNormal(±3σ)'s std


def test_compiled_decoding_refuses_what_it_cannot_do():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    with pytest.raises(ValueError, match="fixed depth"):
        greedy(model, ids, mask, 2, exit_rule=ExitRule.parse("kl:5e-4"), compile="eager")
    with pytest.raises(ValueError, match="fixed depth"):
        greedy(model, ids, mask, 2, num_beams=2, compile="eager")
