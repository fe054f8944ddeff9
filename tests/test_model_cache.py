"""The step-aware KV cache: cached equals uncached, padding, the latest-step rule, memory policies, generate."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    GREEDY_TOKENS,
    PADDED_ROWS,
    close,
    generate_adaptive,
    model_with_state_for_cache,
    prompts_for_cache,
)

from recurfit.model.cache import RecurrentCache
from recurfit.model.compat import cache_kwargs


@pytest.mark.parametrize("r", [1, 3])
def test_incremental_decoding_equals_the_full_forward(family, r):
    model = model_with_state_for_cache(family)
    ids, mask = prompts_for_cache(length=12)  # longer than the sliding windows (5)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, num_steps=r).logits
        cache = RecurrentCache(model.config)
        pieces = [model(ids[:, :8], attention_mask=mask[:, :8], num_steps=r, **cache_kwargs(cache)).logits]
        for t in range(8, 12):
            pieces.append(
                model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], num_steps=r, **cache_kwargs(cache)).logits
            )
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], **close(1e-5, 1e-5))
    assert len(cache.layers) == 6 + 2 * (r - 1) and cache.get_seq_length() == 12


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_generate_with_cache_equals_without(family):
    model = model_with_state_for_cache(family)
    ids, mask = prompts_for_cache()
    for r in (1, 4):
        kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, num_steps=r, pad_token_id=0)
        cached = model.generate(ids, use_cache=True, **kwargs)
        assert torch.equal(cached, model.generate(ids, use_cache=False, **kwargs))


@pytest.mark.float32_only(PADDED_ROWS)
def test_left_padded_batch_equals_each_prompt_alone():
    model = model_with_state_for_cache("qwen3")
    ids, mask = prompts_for_cache()
    kwargs = dict(max_new_tokens=8, do_sample=False, num_steps=3, pad_token_id=0)
    batched = model.generate(ids, attention_mask=mask, **kwargs)
    for row in range(2):
        alone = ids[row : row + 1, mask[row].bool()]
        single = model.generate(alone, attention_mask=torch.ones_like(alone), **kwargs)
        assert torch.equal(batched[row, -8:], single[0, -8:])


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_beam_search_and_sampling_use_the_cache():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, num_steps=2, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))
    torch.manual_seed(1)
    a = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_steps=2, pad_token_id=0)
    torch.manual_seed(1)
    b = model.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_steps=2, pad_token_id=0, use_cache=False
    )
    assert torch.equal(a, b)


def test_changing_r_follows_the_latest_step_rule():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    P = model.config.shape[0]
    cache = RecurrentCache(model.config)
    with torch.no_grad():
        model(ids[:, :8], attention_mask=mask[:, :8], num_steps=2, **cache_kwargs(cache))
        model(ids[:, 8:9], attention_mask=mask[:, :9], num_steps=4, **cache_kwargs(cache))  # deeper than before
        model(ids[:, 9:10], attention_mask=mask[:, :10], num_steps=1, **cache_kwargs(cache))  # shallower
    for layer in range(P, P + model.config.shape[1]):
        step = [cache.layers[i] for i in cache.step_slots(layer)]
        assert len(step) == 4 and {s.get_seq_length() for s in step} == {10}
        # Steps 3 and 4 did not exist for the first 8 tokens: they hold those tokens' step 2.
        for deeper in step[2:]:
            assert torch.equal(deeper.keys[:, :, :8], step[1].keys[:, :, :8])
        # The last token ran one step: steps 2-4 hold its step 1.
        for deeper in step[1:]:
            assert torch.equal(deeper.keys[:, :, 9], step[0].keys[:, :, 9])
        assert not torch.equal(step[3].keys[:, :, 8], step[0].keys[:, :, 8])  # the 4-step token's own keys


def test_latest_policy_bounds_memory():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    caches = {policy: RecurrentCache(model.config, policy=policy) for policy in ("all", "latest")}
    with torch.no_grad():
        for cache in caches.values():
            model(ids, attention_mask=mask, num_steps=8, **cache_kwargs(cache))
    P, R, C = model.config.shape
    assert caches["all"].memory_bytes() == caches["latest"].memory_bytes() * (P + 8 * R + C) // (P + R + C)
    assert len(caches["latest"].layers) == P + R + C
    # On the prefill itself nothing is approximated: the last step's keys are in both.
    for layer in range(P, P + R):
        torch.testing.assert_close(
            caches["latest"].layers[layer].keys, caches["all"].layers[caches["all"].slot(layer, 8)].keys
        )


def test_a_foreign_cache_is_refused():
    from transformers import DynamicCache

    model = model_with_state_for_cache("llama")
    with pytest.raises(TypeError, match="RecurrentCache"):
        model(prompts_for_cache()[0], **cache_kwargs(DynamicCache()))


def test_exit_at_step_m_equals_running_m_steps_with_the_cache():
    """Stopping every row at step m must equal decoding with num_steps=m on the same cache."""
    model = model_with_state_for_cache("mistral")
    ids, mask = prompts_for_cache()
    adaptive = generate_adaptive(model, ids, mask, "state", threshold=1e9, min_steps=4)
    assert torch.all(adaptive.steps_per_token[:, 1:] == 4)
    cache = RecurrentCache(model.config)
    tokens, current_mask = ids, mask
    eos = torch.tensor(model.generation_config.eos_token_id, device=ids.device).flatten()
    finished = torch.zeros(ids.shape[0], 1, dtype=torch.bool, device=ids.device)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, num_steps=12, **cache_kwargs(cache)).logits
        for _ in range(6):
            # as generate: a row that has produced EOS gets padding (0) from then on
            token = torch.where(finished, 0, logits[:, -1].argmax(-1, keepdim=True))
            finished |= torch.isin(token, eos)
            tokens = torch.cat([tokens, token], 1)
            current_mask = torch.cat([current_mask, torch.ones_like(token)], 1)
            logits = model(token, attention_mask=current_mask, num_steps=4, **cache_kwargs(cache)).logits
    assert torch.equal(adaptive.sequences, tokens)


def test_latest_policy_is_an_approximation_once_the_state_matters():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    logits = {}
    for policy in ("all", "latest"):
        cache = RecurrentCache(model.config, policy=policy)
        with torch.no_grad():
            model(ids[:, :8], attention_mask=mask[:, :8], num_steps=4, **cache_kwargs(cache))
            logits[policy] = model(ids[:, 8:9], attention_mask=mask[:, :9], num_steps=4, **cache_kwargs(cache)).logits
    assert (logits["all"] - logits["latest"]).abs().max() > 1e-2  # earlier tokens seen at step 4, not step s
