"""Self-speculative decoding (`recurfit/generation/speculative.py`): plain greedy tokens, EOS, the acceptance
ratio, and the number of drafts adapting to the acceptance and to the measured round times."""

from __future__ import annotations

import random

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
    # 3 drafts every round (not adaptive: which drafts an adaptive round takes follows this CPU's clock)
    fast = speculative_generate(
        model, ids, mask, max_new_tokens=10, num_steps=6, draft_steps=1, lookahead=3, adaptive=False
    )
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


class LayerCalls:
    """A clock that counts decoder-layer calls: a device where a forward costs the weights it reads, whatever its
    number of tokens (bandwidth-bound decoding), so that the adaptive drafts do not depend on this CPU's timings."""

    def __init__(self, model):
        self.calls = 0
        for layer in model.modules():
            if type(layer).__name__.endswith("DecoderLayer"):
                layer.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1

    def __call__(self) -> float:
        return float(self.calls)


def speculative_against_plain(model, **kwargs) -> dict:
    """Plain greedy decoding and self-speculative decoding with fixed and adaptive drafts, on the same prompts."""
    from recurfit.generation.speculative import speculative_generate

    clock = LayerCalls(model)
    ids, mask = prompts(length=9)
    settings = dict(max_new_tokens=40, num_steps=6)
    plain = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None, **settings)
    runs = {"plain": plain}
    for adaptive in (False, True):
        run = speculative_generate(
            model, ids, mask, draft_steps=1, lookahead=4, adaptive=adaptive, clock=clock, **settings
        )
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
    # fixed: 8 rounds of up to 4 drafts and the verifier's token; adaptive: the same but for one plain step (its
    # second round, which measures t0), so at most one round's drafts fewer
    assert fixed.drafted >= 4 * 7 and fixed.drafted - 4 <= adaptive.drafted < fixed.drafted


class RoundClock:
    """A clock on which each round takes `cost(d)` seconds, d the drafts the policy chose for it."""

    def __init__(self, cost):
        self.cost, self.now = cost, 0.0

    def __call__(self) -> float:
        return self.now

    def run(self, policy, rounds: int, kept) -> list[tuple[int, int]]:
        """(drafts, kept) of each round, `kept(d)` drafts kept of d."""
        record = []
        for _ in range(rounds):
            drafts = policy.choose()
            self.now += self.cost(drafts)
            record.append((drafts, kept(drafts)))
            policy.update(*record[-1])
        return record


def test_draft_length_backs_off_while_rejected_and_recovers_when_accepted():
    from recurfit.generation.speculative import DraftLength

    clock = RoundClock(lambda d: 1 + 0.15 * d)  # bandwidth-bound: a draft adds its own forward only
    policy = DraftLength(lookahead=4, draft_cost=0.15, clock=clock)
    choices = [d for d, _ in clock.run(policy, 120, kept=lambda d: 0)]  # every draft rejected
    assert choices[0] == 4 and set(choices[1:]) == {0, 1}
    # Plain steps between one-draft probes: twice as many after each rejected probe, at most MAX_WAIT.
    runs = "".join(map(str, choices[1:])).strip("0").split("1")
    waits = [len(run) for run in runs if run]
    assert waits[:5] == [2, 4, 8, 16, 32] and set(waits[5:]) == {DraftLength.MAX_WAIT}
    recovered = [d for d, _ in clock.run(policy, DraftLength.MAX_WAIT + 6, kept=lambda d: d)]  # all accepted now
    assert recovered[-1] == 4 and recovered.count(0) <= DraftLength.MAX_WAIT
    clock.run(policy, 40, kept=lambda d: d)
    # Rejected again: once the drafts fall to one, the back-off starts over from 2 plain steps (4, 8, …; a periodic
    # plain step may come between), not from the MAX_WAIT it had reached.
    again = "".join(str(d) for d, _ in clock.run(policy, 60, kept=lambda d: 0))
    waits = [len(run) for run in again[again.rindex("2") + 1 :].split("1") if run]
    assert max(waits[:3]) <= 8, again


def drafts_on(clock, policy, rounds: int) -> str:
    """The drafts of each of `rounds` rounds, every draft accepted, as a string of digits."""
    return "".join(str(d) for d, _ in clock.run(policy, rounds, kept=lambda d: d))


def test_draft_length_follows_a_device_whose_round_times_change():
    """A device that turns compute-bound mid-run (a batch that grows): while drafting pays, a plain step still runs
    every MAX_WAIT rounds or sooner (t(0) is measured again); once drafts cost each token's compute, drafting stops
    within a few rounds, since recent rounds weigh most in t(d) (an average over the whole run would keep drafting 4
    for some 70 rounds, its 100 cheap rounds outweighing the new ones)."""
    from recurfit.generation.speculative import DraftLength

    costs = [lambda d: 1 + 0.1 * d]  # bandwidth-bound: a draft adds 0.1 of a plain step
    clock = RoundClock(lambda d: costs[0](d))
    policy = DraftLength(lookahead=4, draft_cost=0.1, clock=clock)
    cheap = drafts_on(clock, policy, 100)
    plain_runs = [len(run) for run in cheap[1:].split("0")[1:-1]]
    assert set(cheap) == {"0", "4"} and plain_runs and max(plain_runs) <= DraftLength.MAX_WAIT, cheap
    costs[0] = lambda d: 1 + 2 * d  # compute-bound: 4 drafts cost 9 plain steps for 5 tokens
    dear = drafts_on(clock, policy, 60)
    assert set(dear[10:]) <= {"0", "1"}, dear  # plain steps and one-draft probes only


def test_draft_length_drafts_the_full_lookahead_again_when_a_device_turns_cheap_again():
    """Bandwidth-bound, compute-bound, then bandwidth-bound again (a batch that grows and shrinks): drafting stops
    while drafts are dear, and when they are cheap again the one-draft probes pay, so the policy drafts; it must reach
    the lookahead again, not stay at one draft because t(2)..t(4) still hold the times measured while drafts were
    dear (forgotten after `STALE` rounds unmeasured). Every draft is kept: 4 drafts give 5 tokens in 1.4 plain steps,
    1 draft 2 tokens in 1.1, so one draft a round would decode at 51 % of the possible rate."""
    from recurfit.generation.speculative import DraftLength

    costs = [lambda d: 1 + 0.1 * d]
    clock = RoundClock(lambda d: costs[0](d))
    policy = DraftLength(lookahead=4, draft_cost=0.1, clock=clock)
    drafts_on(clock, policy, 100)
    costs[0] = lambda d: 1 + 2 * d
    drafts_on(clock, policy, 100)
    costs[0] = lambda d: 1 + 0.1 * d
    cheap_again = drafts_on(clock, policy, DraftLength.MAX_WAIT + DraftLength.STALE + 40)
    assert set(cheap_again[-40:]) <= {"0", "4"} and cheap_again[-40:].count("4") >= 38, cheap_again


def test_draft_length_interpolates_a_draft_count_not_run_between_the_measured_ones():
    """t(d) for a d not yet run lies on the line between the measured round times around it: on a CPU at batch 1
    (t(0) = 1, t(4) = 1.98 plain steps), t(2) is 1.49, where the per-draft prior (0.1 of a plain step) would say
    1.2 and try it."""
    from recurfit.generation.speculative import DraftLength

    clock = RoundClock(lambda d: 1 + 0.7 * (d > 0) + 0.07 * d)
    policy = DraftLength(lookahead=4, draft_cost=0.1, clock=clock)
    for drafts in (0, 4):
        policy.choose()
        clock.now += clock.cost(drafts)
        policy.update(drafts, drafts)
    assert [policy.round_time(d) for d in range(5)] == pytest.approx([1, 1.245, 1.49, 1.735, 1.98])


@pytest.mark.parametrize(
    "device, cost, alpha, least",
    [
        # Bandwidth-bound (a GPU at small batches): a draft adds 0.1 of a plain step. At α = 0.6 the best is 3 drafts,
        # 1.67 tokens per plain step's time (2 drafts: 1.63, 4: 1.64, 1: 1.45); the probes of the first rounds cost.
        ("bandwidth-bound", lambda d: 1 + 0.1 * d, 0.6, 1.5),
        # Compute-bound (a CPU, large batches): the verifying forward costs each token it checks, so every d > 0 loses
        # (1 draft: 1.6 / 2.1 = 0.76 tokens per plain step's time); the one-draft probes cost at most 1/32 of that.
        ("compute-bound", lambda d: 0.1 * d + (1 + d), 0.6, 0.95),
        # A CPU at batch 1: verifying more than one token costs 0.7 of a plain step more at any d (matrix-matrix
        # kernels), then 0.07 a draft. At α = 0.9, 4 drafts give 2.07 (1: 1.07); a straight line through t(0) and
        # t(4) would price 1-3 drafts too low, try them, and spend rounds there (1.91 with these draws).
        ("a CPU at batch 1", lambda d: 1 + 0.7 * (d > 0) + 0.07 * d, 0.9, 1.95),
    ],
)
def test_draft_length_drafts_only_where_the_measured_round_times_pay(device, cost, alpha, least):
    """The same prior (`draft_cost` 0.1, the bandwidth-bound guess) on three devices, each draft kept with
    probability α once the ones before it were: the tokens per time decoded, in plain steps' times, reach what the
    device allows; a policy that ignored the clock would draft 3 at α = 0.6 on every device (0.51 on the
    compute-bound one)."""
    from recurfit.generation.speculative import DraftLength

    draw = random.Random(0)

    def kept(d: int) -> int:
        accepted = 0
        while accepted < d and draw.random() < alpha:
            accepted += 1
        return accepted

    clock = RoundClock(cost)
    record = RoundClock.run(clock, DraftLength(lookahead=4, draft_cost=0.1, clock=clock), 400, kept)
    tokens_per_time = sum(k + 1 for _, k in record) / clock.now
    assert tokens_per_time >= least, (device, tokens_per_time)
