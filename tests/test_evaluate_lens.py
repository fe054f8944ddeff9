"""Tests of `recurfit/evaluate/lens.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import char_tokenizer, model_with_state

from recurfit.errors import RecurfitError
from recurfit.evaluate.lens import recurrence_lens
from recurfit.generation import GenerationSettings, generate_text
from recurfit.model.cache import RecurrentCache
from recurfit.model.compat import cache_kwargs

R = 8
NEW = 3  # tokens of continuation
PROMPT = [[5, 17, 30, 8, 22, 40, 9]]
# Each criterion at a threshold that stops some continuation tokens before step R and lets others run on (the
# test asserts both): the KL between steps falls from about 3e-2 to 3e-4 over 8 steps on this model, and the
# state's relative change from 1 to about 0.07, crossing 0.2 between steps 6 (0.23) and 7 (0.11).
RULES = ("kl:1e-3", "state:0.2", "argmax:2")
# A KL of steps whose log-probabilities lie near log(1/97) = -4.6, where float32 resolves 4.8e-7: its rounding is a
# few of those.
KL_ROUNDING = 2e-6


@pytest.fixture(scope="module")
def read():
    """A retrofit whose adapter reads the state and whose s_0 is zeros (so `generate` draws the same s_0), its lens
    over PROMPT and NEW tokens of continuation."""
    model, tokenizer = model_with_state("llama"), char_tokenizer()
    lens = recurrence_lens(model, tokenizer, torch.tensor(PROMPT), R, rules=RULES, max_new_tokens=NEW)
    return model, tokenizer, lens


def test_the_lens_reads_every_step_as_readout_steps_and_the_logits_give_them(read):
    """Each token's top prediction, its probability and the KL between steps are those of `readout_steps` (steps
    1..R-1) and the logits (step R) of the model's own forward, with the sequence before the token prefilled as
    `generate` prefills a prompt. The lens reads token by token: prefilling sums the attention in another order, a
    float32 rounding difference: at most 2.1e-8 on these probabilities (bound 1e-6) and 5.3e-7 on the KLs (bound
    KL_ROUNDING), measured on an AMD EPYC."""
    model, _, lens = read
    sequence = PROMPT[0] + lens.top_ids[len(PROMPT[0]) - 1 : -1, -1].tolist()
    assert len(lens.tokens) == len(sequence) == len(PROMPT[0]) + NEW
    # The prompt's first token, one inside it, its last, and the continuation's tokens
    for position in (0, 3, *range(len(PROMPT[0]) - 1, len(sequence))):
        cache = RecurrentCache(model.config)
        with torch.no_grad():
            if position:
                model(torch.tensor([sequence[:position]]), num_steps=R, **cache_kwargs(cache))
            out = model(
                torch.tensor([sequence[position : position + 1]]),
                num_steps=R,
                readout_steps=range(1, R),
                **cache_kwargs(cache),
            )
        log_p = F.log_softmax(torch.cat([*out.readout_logits, out.logits])[:, -1].float(), dim=-1)
        torch.testing.assert_close(lens.probabilities[position], log_p.exp().max(-1).values, rtol=0, atol=1e-6)
        assert torch.equal(lens.top_ids[position], log_p.argmax(-1))
        kl = (log_p[1:].exp() * (log_p[1:] - log_p[:-1])).sum(-1)
        torch.testing.assert_close(lens.kl[position, 1:], kl, rtol=0, atol=KL_ROUNDING)
        assert torch.isnan(lens.kl[position, 0])
    # Depth matters on this model: the top prediction changes between steps somewhere.
    assert any(len(set(row)) > 1 for row in lens.top_ids.tolist())


def test_the_continuation_is_generates_greedy_text(read):
    model, tokenizer, lens = read
    settings = GenerationSettings(recurrence=R, max_new_tokens=NEW)
    generated = generate_text(model, tokenizer, torch.tensor(PROMPT), settings)
    continuation = lens.top_ids[len(PROMPT[0]) - 1 :, -1].tolist()  # each token's prediction at step R
    assert tokenizer.decode(continuation, skip_special_tokens=True).strip() == generated.text


@pytest.mark.parametrize("rule", RULES)
def test_each_rules_exit_step_is_generate_exits_depth_for_that_token(read, rule):
    """`generate --exit` on the sequence up to each continuation token: the prompt runs all R steps, and the next
    token's depth is the step at which the rule stopped it, which the lens reports for that token."""
    model, tokenizer, lens = read
    prompt_length = len(PROMPT[0])
    sequence = PROMPT[0] + lens.top_ids[prompt_length - 1 : -1, -1].tolist()
    depths = []
    for position in range(prompt_length, len(sequence)):
        settings = GenerationSettings(recurrence=R, exit=rule, max_new_tokens=2)
        depths.append(generate_text(model, tokenizer, torch.tensor([sequence[:position]]), settings).steps_per_token[1])
    assert depths == lens.exits[rule][prompt_length:]
    assert min(depths) < R and max(depths) > 2  # the rule stops some tokens early, and not all at once


def test_a_bad_rule_or_recurrence_is_refused_before_any_step():
    model, tokenizer = model_with_state("llama"), char_tokenizer()
    ids = torch.tensor(PROMPT)
    with pytest.raises(RecurfitError, match="CRITERION one of kl, state, argmax"):
        recurrence_lens(model, tokenizer, ids, R, rules=["entropy:3"])
    with pytest.raises(RecurfitError, match="--recurrence must be between 1 and 1024, got 0"):
        recurrence_lens(model, tokenizer, ids, 0)
