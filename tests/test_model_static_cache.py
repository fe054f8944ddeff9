"""The static recurrent cache: the same greedy tokens as the dynamic `RecurrentCache`, for both policies, every
family, padded batches, warm starts and a depth that changes between calls."""

from __future__ import annotations

import pytest
import torch
from conftest import GREEDY_TOKENS, close, model_with_state_for_cache, prompts_for_cache

from recurfit.model.cache import RecurrentCache
from recurfit.model.compat import cache_kwargs
from recurfit.model.static_cache import StaticRecurrentCache


def static_cache(model, ids, steps, policy="all", extra=16):
    return StaticRecurrentCache(
        model.config, ids.shape[0], ids.shape[1] + extra, steps, policy, dtype=model.dtype, device=model.device
    )


@pytest.mark.float32_only(GREEDY_TOKENS)
@pytest.mark.parametrize("policy", ["all", "latest"])
def test_generate_with_the_static_cache_equals_the_dynamic_cache(family, policy):
    model = model_with_state_for_cache(family)
    ids, mask = prompts_for_cache(length=12)  # left-padded row, longer than the sliding windows (5)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, num_steps=3, pad_token_id=0)
    dynamic = model.generate(ids, **kwargs, **cache_kwargs(RecurrentCache(model.config, policy=policy)))
    static = model.generate(ids, **kwargs, **cache_kwargs(static_cache(model, ids, 3, policy)))
    assert torch.equal(static, dynamic)


def test_incremental_logits_equal_the_full_forward():
    model = model_with_state_for_cache("qwen3")
    ids, mask = prompts_for_cache(length=12)
    cache = static_cache(model, ids[:, :8], 2, extra=4)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, num_steps=2).logits
        pieces = [model(ids[:, :8], attention_mask=mask[:, :8], num_steps=2, **cache_kwargs(cache)).logits]
        for t in range(8, 12):
            step = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], num_steps=2, **cache_kwargs(cache))
            pieces.append(step.logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], **close(1e-5, 1e-5))
    assert cache.get_seq_length() == 12


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_a_depth_that_changes_between_calls_follows_the_latest_step_rule():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache(length=10)
    logits = {}
    for name, cache in (("dynamic", RecurrentCache(model.config)), ("static", static_cache(model, ids, 4))):
        with torch.no_grad():
            model(ids[:, :8], attention_mask=mask[:, :8], num_steps=2, **cache_kwargs(cache))
            model(ids[:, 8:9], attention_mask=mask[:, :9], num_steps=4, **cache_kwargs(cache))  # deeper than before
            out = model(ids[:, 9:10], attention_mask=mask[:, :10], num_steps=1, **cache_kwargs(cache))  # shallower
        logits[name] = out.logits
    torch.testing.assert_close(logits["static"], logits["dynamic"], atol=1e-5, rtol=1e-5)


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_warm_start_with_the_static_cache_equals_the_dynamic_cache():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, num_steps=3, pad_token_id=0, warm_start=True)
    dynamic = model.generate(ids, **kwargs, **cache_kwargs(RecurrentCache(model.config)))
    assert torch.equal(model.generate(ids, **kwargs, **cache_kwargs(static_cache(model, ids, 3))), dynamic)


def test_the_static_cache_refuses_what_it_cannot_hold():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    with pytest.raises(ValueError, match="holds 2 steps"):
        model(ids, attention_mask=mask, num_steps=3, **cache_kwargs(static_cache(model, ids, 2)))


def test_a_static_cache_on_another_device_than_the_model_is_a_clear_error():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    elsewhere = StaticRecurrentCache(model.config, 2, 32, 2, device="meta")  # not the model's device, whatever it is
    with pytest.raises(ValueError, match="static cache is on meta.*device=model.device"):
        model(ids, attention_mask=mask, num_steps=2, **cache_kwargs(elsewhere))
