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

Drafts that are rejected cost their shallow forwards and gain nothing, so by default (`adaptive=True`) each round
drafts as many tokens as pay at the acceptance measured so far (`DraftLength`): up to `lookahead` while drafts are
accepted, none (a plain full-r step) where they are not, with a one-draft probe now and then to measure again.
The tokens are the same whatever the number of drafts: only the speed changes.
"""

from __future__ import annotations

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
) -> SpeculativeOutput:
    """Decode greedily at `num_steps` (default: the model's mean recurrence), drafting at `draft_steps`: at most
    `lookahead` tokens a round, as many as the measured acceptance makes worth it (`adaptive`), or always
    `lookahead`."""
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
    length_policy = DraftLength(lookahead, forward_cost(model, draft_steps) / forward_cost(model, r), adaptive)
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
    adapter's W_e half once, the core and W_s at every step) and the head. Decoding a few tokens is bound by
    reading the weights (and by launching their layers' kernels, which scales alike), so this is a round's cost
    whatever its number of tokens."""
    return inference_flops_per_token(model, num_steps) // 2 + model.lm_head.weight.numel()


class DraftLength:
    """The number of drafts of each round, from the acceptance measured in the rounds before.

    A draft is accepted with probability α once the ones before it were (greedy drafts fail at the first
    disagreement), so a round of d drafts yields 1 + α + … + α^d tokens for d draft forwards of `draft_cost` (in
    full-depth forwards) and one verifying forward; a plain step yields 1 token for 1. Each round takes the d in
    0..lookahead with the most tokens per cost. α is estimated from decayed counts of accepted drafts and of
    rejections (recent rounds weigh most), starting from one accepted draft: the first round drafts `lookahead`.
    Once drafting does not pay, decoding goes on in plain steps and probes with one draft after 2, 4, … up to
    `MAX_WAIT` of them, so that acceptance at ~0 costs little more than plain decoding and a change is noticed.
    """

    DECAY = 0.7  # weight of the counts so far at each round
    MAX_WAIT = 32  # plain steps between probes, at most

    def __init__(self, lookahead: int, draft_cost: float, adaptive: bool = True):
        self.lookahead, self.draft_cost, self.adaptive = lookahead, draft_cost, adaptive
        self.accepted, self.rejected = 1.0, 0.0
        self.wait, self.next_wait = 0, 2

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def best(self) -> int:
        """The number of drafts with the most expected tokens per cost at the current acceptance (0: none)."""
        alpha = self.acceptance

        def tokens_per_cost(d: int) -> float:
            return sum(alpha**i for i in range(d + 1)) / (1 + d * self.draft_cost)

        return max(range(self.lookahead + 1), key=lambda d: (tokens_per_cost(d), -d))

    def choose(self) -> int:
        if not self.adaptive:
            return self.lookahead
        if self.wait:  # plain steps until the next probe
            self.wait -= 1
            return 0
        return max(self.best(), 1)  # 1 where drafting did not pay: a probe

    def update(self, drafted: int, kept: int) -> None:
        if not drafted:
            return
        self.accepted = self.DECAY * self.accepted + kept
        self.rejected = self.DECAY * self.rejected + (kept < drafted)
        if self.best():
            self.next_wait = 2
        else:  # plain steps before the next probe, twice as many as before
            self.wait, self.next_wait = self.next_wait, min(2 * self.next_wait, self.MAX_WAIT)


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
