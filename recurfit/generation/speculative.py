"""Self-speculative decoding: the model drafts at a small recurrence and verifies at the full one.

    repeat:
        draft   `lookahead` tokens one at a time at r = `draft_steps` (cheap: P + r_d·R + C layers each)
        verify  the pending token and the drafts in ONE forward at the full r, through the same cache
        keep    the longest prefix of drafts that the full-r model agrees with, plus its own next token
        roll    the cache back over the rejected drafts

A draft token is accepted when it is the full-r argmax (greedy: the output is exactly plain greedy decoding at
the full r), or, with `accept_ratio` < 1, when p_r(draft) ≥ accept_ratio · max p_r (faster, no longer exact).
The verify forward writes every accepted token's keys at every step 1..r, as decoding them one at a time
would (the cache's cached = uncached property), so a round's cost is `lookahead` shallow forwards and one
deep forward over `lookahead + 1` tokens instead of `n + 1` deep forwards for the `n + 1` tokens it keeps.
In a batch, a round keeps the prefix every unfinished row accepted.

Drafts that are rejected cost their shallow forwards and gain nothing, and where the verifying forward costs as
many tokens' compute as it checks (a CPU, large batches) even accepted ones may not pay, so by default
(`adaptive=True`) each round drafts as many tokens as pay at the acceptance and round times measured so far
(`DraftLength`): up to `lookahead` while drafts are accepted and cheap, none (a plain full-r step) where they do
not pay, with a one-draft probe now and then to measure again.
The tokens are the same whatever the number of drafts: only the speed changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import RecurfitError
from ..model.accounting import inference_flops_per_token
from ..model.cache import RecurrentCache
from ..model.compat import cache_kwargs


@dataclass
class SpeculativeOutput:
    sequences: torch.LongTensor  # prompt and new tokens, like `generate`'s
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@torch.no_grad()
def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 128,
    num_steps: int | None = None,
    draft_steps: int = 1,
    lookahead: int = 4,
    accept_ratio: float = 1.0,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    adaptive: bool = True,
    clock=time.perf_counter,
) -> SpeculativeOutput:
    """Decode greedily at `num_steps` (default: the model's mean recurrence), drafting at `draft_steps`: at most
    `lookahead` tokens a round, as many as the measured acceptance and round times make worth it (`adaptive`;
    `clock` times the rounds), or always `lookahead`."""
    r = sum(model.model.resolve_num_steps(num_steps))  # the model's own default depth when None
    if not 1 <= draft_steps < r:
        raise RecurfitError(f"draft_steps must be between 1 and the full recurrence - 1 ({r - 1}), got {draft_steps}.")
    if lookahead < 1 or not 0 < accept_ratio <= 1:
        raise RecurfitError(f"lookahead must be >= 1 and accept_ratio in (0, 1], got {lookahead} and {accept_ratio}.")
    cache = RecurrentCache(model.config, rollback=True)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    logits = model(input_ids, attention_mask=mask, num_steps=r, **cache_kwargs(cache)).logits[:, -1]
    pending = logits.argmax(-1, keepdim=True)  # chosen at the full r, not yet in the cache
    new, finished = [pending], _ended(pending, eos_token_id)
    drafted = accepted = 0
    length_policy = DraftLength(lookahead, forward_cost(model, draft_steps) / forward_cost(model, r), adaptive, clock)
    while sum(t.shape[1] for t in new) < max_new_tokens and not finished.all():
        remaining = max_new_tokens - sum(t.shape[1] for t in new)
        length, lookahead_now = cache.get_seq_length(), min(length_policy.choose(), remaining)
        drafts = _draft(model, pending, mask, cache, draft_steps, lookahead_now)
        if lookahead_now:  # a plain step (no drafts) has nothing to roll back
            cache.truncate(length)
        block = torch.cat([pending, drafts], 1)
        mask = torch.cat([mask, torch.ones_like(block)], 1)
        logits = model(block, attention_mask=mask, num_steps=r, **cache_kwargs(cache)).logits
        keep = _agreeing_prefix(logits[:, :-1], drafts, accept_ratio, finished)
        pending = logits[:, keep].argmax(-1, keepdim=True)
        new += [drafts[:, :keep], pending]
        finished |= _ended(drafts[:, :keep], eos_token_id) | _ended(pending, eos_token_id)
        drafted, accepted = drafted + lookahead_now, accepted + keep
        length_policy.update(lookahead_now, keep)
        if keep < lookahead_now:
            mask = mask[:, : mask.shape[1] - (lookahead_now - keep)]
            cache.truncate(length + 1 + keep)
    tokens = _pad_after_eos(torch.cat(new, 1)[:, :max_new_tokens], eos_token_id, pad_token_id)
    return SpeculativeOutput(torch.cat([input_ids, tokens], 1), drafted, accepted)


def _draft(model, pending, mask, cache, draft_steps: int, lookahead: int) -> torch.LongTensor:
    """`lookahead` greedy tokens at the draft recurrence, each fed back through the cache."""
    token, drafts = pending, [pending[:, :0]]  # none: a plain step at the full r
    for _ in range(lookahead):
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        logits = model(token, attention_mask=mask, num_steps=draft_steps, **cache_kwargs(cache)).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        drafts.append(token)
    return torch.cat(drafts, 1)


def forward_cost(model, num_steps: int) -> int:
    """Parameters a forward of one token at `num_steps` reads: the body as inference runs it (its FLOPs / 2; the
    adapter's W_e half once, the core and W_s at every step) and the head. Where decoding a few tokens is bound by
    reading the weights (and by launching their layers' kernels, which scales alike), this is a round's cost
    whatever its number of tokens: `DraftLength`'s guess until it has measured the rounds."""
    return inference_flops_per_token(model, num_steps) // 2 + model.lm_head.weight.numel()


class DraftLength:
    """The number of drafts of each round, from the acceptance and the round times measured in the rounds before.

    A draft is accepted with probability α once the ones before it were (greedy drafts fail at the first
    disagreement), so a round of d drafts yields 1 + α + … + α^d tokens in the time t(d) of its d shallow forwards
    and its verifying forward over d + 1 tokens; each round takes the d in 0..lookahead with the most tokens per
    time. t(0) is a plain step.

    t(d) is measured: the decayed average of the wall times of the rounds of d drafts (recent rounds weigh most).
    Only the clock can tell it: a verifying forward over d + 1 tokens costs about one token's where decoding is
    bound by reading the weights (a GPU at small batches), d + 1 tokens' where it is bound by compute (a CPU, large
    batches), and on a CPU at batch 1 most of a plain step more from d = 1 on (matrix-matrix kernels in place of
    matrix-vector ones), then little per draft. A d not yet run is interpolated between the measured ones around it;
    past the largest, each draft adds `draft_cost` plain steps (its own forward's share of a full-depth forward's
    reads), which is also the whole model until a plain step has run. The first round drafts `lookahead` (α starts
    at one accepted draft), the second is plain, and a plain step is taken again when `MAX_WAIT` rounds passed
    without one. Once drafting does not pay, decoding goes on in plain steps and probes with one draft after 2, 4, …
    up to `MAX_WAIT` of them, so that a batch or device where drafting loses costs little more than plain decoding,
    and a change is noticed. A t(d) not measured for `STALE` rounds is priced as one not yet run once a fresher
    measurement shows that drafting pays again.
    """

    DECAY = 0.7  # weight of the counts and times so far at each round
    MAX_WAIT = 32  # plain steps between probes, and rounds between plain steps, at most
    STALE = 2 * MAX_WAIT  # rounds after which a t(d) not measured again may be forgotten (t(0) is never that old)

    def __init__(self, lookahead: int, draft_cost: float, adaptive: bool = True, clock=time.perf_counter):
        self.lookahead, self.draft_cost, self.adaptive, self.clock = lookahead, draft_cost, adaptive, clock
        self.accepted, self.rejected = 1.0, 0.0
        self.wait, self.next_wait = 0, 2
        self.times = {d: _Decayed(self.DECAY) for d in range(lookahead + 1)}  # seconds of the rounds of d drafts
        self.since_plain, self.started = 0, None
        self.rounds, self.measured_at = 0, {}  # rounds run; the round each d's time was last measured

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def measured(self) -> dict[int, float]:
        """The measured t(d). Those not measured in the last `STALE` rounds are forgotten once a fresher one shows
        that drafting pays: on a device that turned dear and cheap again, the times of larger d measured while it was
        dear would otherwise keep it at the one draft it probes with."""
        measured = {d: t.mean for d, t in self.times.items() if t.weight}
        fresh = {d: t for d, t in measured.items() if self.rounds - self.measured_at[d] <= self.STALE}
        if 0 in fresh and any(self._tokens(d) / fresh[d] > 1 / fresh[0] for d in fresh if d):
            return fresh
        return measured

    def round_time(self, d: int, measured: dict[int, float] | None = None) -> float:
        """t(d): measured, interpolated, or extrapolated at `draft_cost` plain steps a draft (see above)."""
        measured = self.measured() if measured is None else measured
        if 0 not in measured:
            return 1 + d * self.draft_cost  # in plain steps, until one is measured
        if d in measured:
            return measured[d]
        below = max(k for k in measured if k < d)
        above = [k for k in measured if k > d]
        if not above:
            return measured[below] + (d - below) * self.draft_cost * measured[0]
        above = min(above)
        return measured[below] + (measured[above] - measured[below]) * (d - below) / (above - below)

    def _tokens(self, d: int) -> float:
        """The tokens a round of d drafts yields on average at the current acceptance."""
        return sum(self.acceptance**i for i in range(d + 1))

    def best(self) -> int:
        """The number of drafts with the most expected tokens per time at the current acceptance (0: none)."""
        measured = self.measured()
        return max(range(self.lookahead + 1), key=lambda d: (self._tokens(d) / self.round_time(d, measured), -d))

    def choose(self) -> int:
        self.started = self.clock()
        if not self.adaptive:
            return self.lookahead
        if self.wait:  # plain steps until the next probe
            self.wait -= 1
            return 0
        if self.since_plain and (not self.times[0].weight or self.since_plain >= self.MAX_WAIT):
            return 0  # a plain step, to measure t(0)
        return max(self.best(), 1)  # 1 where drafting did not pay: a probe

    def update(self, drafted: int, kept: int) -> None:
        self.times[drafted].add(self.clock() - self.started)
        self.rounds += 1
        self.measured_at[drafted] = self.rounds
        if not drafted:
            self.since_plain = 0
            return
        self.since_plain += 1
        self.accepted = self.DECAY * self.accepted + kept
        self.rejected = self.DECAY * self.rejected + (kept < drafted)
        if self.best():
            self.next_wait = 2
        else:  # plain steps before the next probe, twice as many as before
            self.wait, self.next_wait = self.next_wait, min(2 * self.next_wait, self.MAX_WAIT)


class _Decayed:
    """A decayed average of measurements: each new one weighs 1, the ones before `decay` times less each time."""

    def __init__(self, decay: float):
        self.decay, self.weight, self.total = decay, 0.0, 0.0

    def add(self, value: float) -> None:
        self.weight = self.decay * self.weight + 1
        self.total = self.decay * self.total + value

    @property
    def mean(self) -> float:
        return self.total / self.weight


def _agreeing_prefix(logits, drafts, accept_ratio: float, finished) -> int:
    """How many leading drafts every unfinished row accepts; `logits[:, i]` is the full-r verdict on draft i."""
    if accept_ratio >= 1:
        agree = drafts == logits.argmax(-1)
    else:
        probs = logits.float().softmax(-1)
        agree = probs.gather(-1, drafts[..., None])[..., 0] >= accept_ratio * probs.max(-1).values
    prefix = agree.long().cumprod(-1).sum(-1)
    return int(prefix[~finished].min()) if (~finished).any() else 0


def _ended(tokens: torch.LongTensor, eos_token_id: int | None) -> torch.Tensor:
    if eos_token_id is None:
        return torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    return (tokens == eos_token_id).any(-1)


def _pad_after_eos(tokens: torch.LongTensor, eos_token_id: int | None, pad_token_id: int) -> torch.LongTensor:
    """As `generate` does: a row that produced EOS continues with padding."""
    if eos_token_id is None:
        return tokens
    after = (tokens == eos_token_id).long().cumsum(-1) - (tokens == eos_token_id).long() > 0
    return tokens.masked_fill(after, pad_token_id)
