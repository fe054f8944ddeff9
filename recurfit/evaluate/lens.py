"""A look inside the recurrence (`recurfit lens`): what the coda would predict after every step, for every token.

Each token of the prompt, then of its greedy continuation, runs all r steps through the KV cache, one token at a
time as `generate` decodes, and `readout_steps` reads the coda out after every step: what an adaptive exit rule
reads (the token's state at that step, the earlier tokens' final entries). From those readouts come, per token and
step, the top prediction and its probability, KL(p_s ‖ p_{s-1}), and, for each exit rule, the step at which the
rule's own `ExitTracker` stops the token. That step is `generate --exit`'s depth for the token when every token
before it ran all r steps; once a token stops early, the tokens after it read its last step's keys and values at
the deeper steps, so their depths under `generate --exit` can differ from the lens's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..defaults import LENS_EXIT_RULES, LENS_NEW_TOKENS
from ..errors import RecurfitError
from ..generation.exit import ExitRule, step_kl
from ..generation.text import MAX_RECURRENCE
from ..model.cache import RecurrentCache
from ..model.modeling import RecurrentForCausalLM, float32_logits


@dataclass
class Lens:
    """Per token (rows) and recurrence step (columns, step 1 first): the lens of one prompt and its continuation."""

    tokens: list[str]  # each position's token, as text: the prompt's, then the continuation's
    prompt_length: int
    rules: list[str]  # the exit rules, as written ("kl:5e-4")
    top_ids: torch.Tensor  # (tokens, r) long: the coda's top prediction for the next token after each step
    top_tokens: list[list[str]]  # the same, as text
    probabilities: torch.Tensor  # (tokens, r): the top prediction's probability
    kl: torch.Tensor  # (tokens, r): KL(p_s ‖ p_{s-1}); NaN at step 1
    exits: dict[str, list[int]]  # rule → the step at which it stops each token (r where it never does earlier)

    @property
    def recurrence(self) -> int:
        return self.top_ids.shape[1]

    def markdown(self) -> str:
        """A row per token: its top prediction after the last step, and each rule's exit step with its prediction."""
        r = self.recurrence
        header = ["#", "token", f"top at r = {r}", "p", "KL at r", *self.rules]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for i, token in enumerate(self.tokens):
            cells = [str(i + 1), _cell(token), _cell(self.top_tokens[i][-1]), f"{self.probabilities[i, -1]:.3f}"]
            cells.append(f"{self.kl[i, -1]:.2e}" if r > 1 else "–")
            cells += [
                f"{self.exits[rule][i]} {_cell(self.top_tokens[i][self.exits[rule][i] - 1])}" for rule in self.rules
            ]
            lines.append("| " + " | ".join(cells) + " |")
        continuation = len(self.tokens) - self.prompt_length
        lines += [
            "",
            f"Tokens 1-{self.prompt_length}: the prompt; {continuation} more: its greedy continuation at r = {r}. "
            "Each token's prediction is of the token after it; a rule's column: the step it stops at, and the "
            "prediction there.",
        ]
        return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """A token's text in a table cell: quoted, so that spaces show, with newlines and pipes escaped."""
    return "`" + text.replace("\n", "\\n").replace("|", "\\|").replace("`", "'") + "`"


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([token]) for token in ids]


def check_rules(rules: Sequence[str], min_steps: int) -> list[ExitRule]:
    """The exit rules as `generate --exit` parses them (one line naming the bad one otherwise)."""
    if not rules:
        raise RecurfitError("--exit needs at least one rule, e.g. kl:5e-4,state:0.01,argmax:2.")
    return [ExitRule.parse(rule, min_steps=min_steps) for rule in rules]


def check_recurrence(recurrence: int) -> None:
    if not 1 <= recurrence <= MAX_RECURRENCE:
        raise RecurfitError(f"--recurrence must be between 1 and {MAX_RECURRENCE}, got {recurrence}.")


@torch.no_grad()
def recurrence_lens(
    model: RecurrentForCausalLM,
    tokenizer,
    ids: torch.Tensor,
    recurrence: int | None = None,
    rules: Sequence[str] = LENS_EXIT_RULES,
    max_new_tokens: int = LENS_NEW_TOKENS,
    min_steps: int = 2,
    seed: int = 0,
) -> Lens:
    """The lens of the prompt `ids` (1 × length) and its greedy continuation of up to `max_new_tokens` tokens (it
    stops at the end-of-text token), each token run for `recurrence` steps (default: the model's r̄); `rules` as
    `generate --exit` takes them, each stopping no earlier than `min_steps`. The initial states s_0 are drawn from
    `seed`."""
    if not isinstance(model, RecurrentForCausalLM):
        raise RecurfitError("The lens reads a recurrent model's steps; this model has a fixed depth.")
    r = model.config.mean_recurrence if recurrence is None else recurrence
    check_recurrence(r)
    parsed = check_rules(rules, min_steps)
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise RecurfitError(
            f"The lens reads one prompt of at least one token (ids of shape 1 × length), got {tuple(ids.shape)}."
        )
    model.eval()
    sequence = ids[0].tolist()
    prompt_length = len(sequence)
    cache = RecurrentCache(model.config)
    generator = torch.Generator(model.device).manual_seed(seed)
    stops = _stop_tokens(model, tokenizer)
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]] = []
    position = 0
    while position < len(sequence):
        logits, states, next_token = _read_token(model, cache, sequence[: position + 1], r, generator)
        log_p = F.log_softmax(logits, dim=-1)
        top = log_p.max(-1)
        kl = torch.cat([torch.full((1,), float("nan"), device=log_p.device), step_kl(log_p[1:], log_p[:-1])])
        rows.append((top.indices, top.values.exp(), kl, [_exit_step(rule, logits, states) for rule in parsed]))
        position += 1
        continuing = position == len(sequence) and len(sequence) - prompt_length < max_new_tokens
        if continuing and next_token not in stops:
            sequence.append(next_token)
    top_ids = torch.stack([row[0] for row in rows]).cpu()
    return Lens(
        tokens=token_texts(tokenizer, sequence),
        prompt_length=prompt_length,
        rules=list(rules),
        top_ids=top_ids,
        top_tokens=[token_texts(tokenizer, row) for row in top_ids.tolist()],
        probabilities=torch.stack([row[1] for row in rows]).cpu(),
        kl=torch.stack([row[2] for row in rows]).cpu(),
        exits={rule: [row[3][i] for row in rows] for i, rule in enumerate(rules)},
    )


def _stop_tokens(model, tokenizer) -> set[int]:
    """The tokens that end a continuation: the model's generation config's, as `generate` stops on them."""
    stops = model.generation_config.eos_token_id
    stops = tokenizer.eos_token_id if stops is None else stops
    return set(stops) if isinstance(stops, (list, tuple)) else {stops}


def _read_token(model, cache, sequence: list[int], r: int, generator):
    """One decoding forward of the last token of `sequence` (the cache holds the others) at r steps, read out after
    every step: the logits (r × vocabulary, float32 as an exit rule reads them), the states s_0..s_r
    (r + 1 × hidden) and the greedy next token (from the model's own logits, as `generate` picks it)."""
    body = model.model
    token = torch.tensor([sequence[-1:]], device=model.device)
    hidden_size = model.config.text_config.hidden_size
    s0 = body.initial_state(torch.zeros(1, 1, hidden_size, device=model.device), generator)
    out = body(
        input_ids=token,
        attention_mask=torch.ones(1, len(sequence), dtype=torch.long, device=model.device),
        cache=cache,
        num_steps=r,
        initial_state=s0,
        output_hidden_states=True,
        readout_steps=range(1, r),
    )
    hidden = torch.cat([*(out.readout_hidden_states or ()), out.last_hidden_state], dim=1)[0]
    next_token = int(model.lm_head(out.last_hidden_state[:, -1]).argmax(-1))
    return float32_logits(model.lm_head, hidden), torch.cat([s0, *out.hidden_states], dim=1)[0], next_token


def _exit_step(rule: ExitRule, logits: torch.Tensor, states: torch.Tensor) -> int:
    """The step at which `rule`'s tracker stops a token whose steps read `logits` (r × vocabulary) from the states
    `states` (s_0..s_r): the tracker `generate --exit` runs, fed the lens's readouts instead of its own probes."""
    tracker = rule.start(1, states.device)
    for step in range(1, len(logits) + 1):
        read = logits[step - 1].view(1, 1, -1)
        tracker.check(step, states[step - 1].view(1, 1, -1), states[step].view(1, 1, -1), lambda *_, read=read: read)
        if bool(tracker.done.all()):
            break
    return int(tracker.steps[0])
