"""Decoding beyond plain `generate`: exit specs, the body's output, adaptive depth that skips settled rows,
warm starts, and the generate command's refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    GREEDY_TOKENS,
    model_with_state,
    prompts,
)


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_speculative_greedy_equals_plain_greedy_at_the_full_recurrence(family):
    from recurfit.generation.speculative import speculative_generate

    model = model_with_state(family)
    with torch.no_grad():
        model.model.adapter.weight[:, :64] *= 0.1  # a state that settles: shallow drafts are sometimes right
    ids, mask = prompts(length=9)  # the drafts run past the sliding windows (5), which the rollback must handle
    plain = model.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_steps=6, pad_token_id=0, eos_token_id=None
    )
    fast = speculative_generate(model, ids, mask, max_new_tokens=10, num_steps=6, draft_steps=1, lookahead=3)
    assert torch.equal(fast.sequences, plain)
    assert 0 < fast.acceptance_rate < 1  # some drafts kept, some rolled back: both paths ran


def test_speculative_decoding_stops_rows_at_eos_as_generate_does():
    from recurfit.generation.speculative import speculative_generate

    model = model_with_state("qwen2")
    ids, mask = prompts(length=9)
    kwargs = dict(max_new_tokens=10, do_sample=False, num_steps=6, pad_token_id=0)
    eos = int(model.generate(ids, attention_mask=mask, eos_token_id=None, **kwargs)[0, -7])  # row 0's 4th new token
    plain = model.generate(ids, attention_mask=mask, eos_token_id=eos, **kwargs)
    fast = speculative_generate(
        model, ids, mask, max_new_tokens=10, num_steps=6, draft_steps=1, lookahead=4, eos_token_id=eos
    )
    assert torch.equal(fast.sequences[:, : plain.shape[1]], plain) and (plain[0, -6:] == 0).all()


def test_speculative_accept_ratio_keeps_more_drafts():
    from recurfit.generation.speculative import speculative_generate

    model = model_with_state("llama")
    ids, mask = prompts(length=9)
    exact = speculative_generate(model, ids, mask, max_new_tokens=12, num_steps=6, draft_steps=1, lookahead=4)
    loose = speculative_generate(
        model, ids, mask, max_new_tokens=12, num_steps=6, draft_steps=1, lookahead=4, accept_ratio=1e-6
    )
    assert loose.acceptance_rate == 1.0 > exact.acceptance_rate
