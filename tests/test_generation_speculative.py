"""Self-speculative decoding (`recurfit/generation/speculative.py`): plain greedy tokens, EOS, the acceptance
ratio, and the number of drafts adapting to the acceptance."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    GREEDY_TOKENS,
    model_with_state,
    prompts,
    tiny_parent,
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


def speculative_against_plain(model, **kwargs) -> dict:
    """Plain greedy decoding and self-speculative decoding with fixed and adaptive drafts, on the same prompts."""
    from recurfit.generation.speculative import speculative_generate

    ids, mask = prompts(length=9)
    settings = dict(max_new_tokens=40, num_steps=6)
    plain = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None, **settings)
    runs = {"plain": plain}
    for adaptive in (False, True):
        run = speculative_generate(model, ids, mask, draft_steps=1, lookahead=4, adaptive=adaptive, **settings)
        runs["adaptive" if adaptive else "fixed"] = run
    return runs


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_adaptive_drafting_stops_where_drafts_are_rejected_and_keeps_the_tokens():
    model = model_with_state("llama")
    with torch.no_grad():
        model.model.adapter.weight[:, :64] *= 3  # the state dominates: 1-step drafts are (nearly) never right
    runs = speculative_against_plain(model)
    fixed, adaptive = runs["fixed"], runs["adaptive"]
    assert torch.equal(fixed.sequences, runs["plain"]) and torch.equal(adaptive.sequences, runs["plain"])
    assert fixed.acceptance_rate < 0.05 and fixed.drafted > 100  # 4 drafts every round, 39 rounds
    # The first round's 4, one more while the estimate falls, then 1-draft probes after 2, 4, 8, 16 plain steps.
    assert adaptive.drafted <= 10


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_adaptive_drafting_keeps_the_full_lookahead_where_drafts_are_accepted():
    import recurfit

    model = recurfit.retrofit(tiny_parent("llama"), (2, 2, 2)).eval()  # identity adapter: every depth agrees
    runs = speculative_against_plain(model)
    fixed, adaptive = runs["fixed"], runs["adaptive"]
    assert torch.equal(adaptive.sequences, runs["plain"]) and adaptive.acceptance_rate == 1.0
    assert adaptive.drafted == fixed.drafted >= 4 * 7  # 8 rounds of up to 4 drafts and the verifier's token


def test_draft_length_backs_off_while_rejected_and_recovers_when_accepted():
    from recurfit.generation.speculative import DraftLength

    policy = DraftLength(lookahead=4, draft_cost=0.15)
    choices = []
    for _ in range(120):  # every draft rejected
        choices.append(policy.choose())
        policy.update(choices[-1], 0)
    assert choices[0] == 4 and set(choices[1:]) == {0, 1}
    # Plain steps between one-draft probes: twice as many after each rejected probe, at most MAX_WAIT.
    runs = "".join(map(str, choices[1:])).strip("0").split("1")
    waits = [len(run) for run in runs if run]
    assert waits[:5] == [2, 4, 8, 16, 32] and set(waits[5:]) == {DraftLength.MAX_WAIT}
    recovered = []
    for _ in range(DraftLength.MAX_WAIT + 6):  # every draft accepted from now on
        recovered.append(policy.choose())
        policy.update(recovered[-1], recovered[-1])
    assert recovered[-1] == 4 and recovered.count(0) <= DraftLength.MAX_WAIT
