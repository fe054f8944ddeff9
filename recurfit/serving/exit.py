"""Adaptive exit per request: each generated token stops recurring once its request's exit rule says it settled.

    SamplingParams(extra_args={"num_steps": 32, "exit": "kl:5e-4", "min_depth": 2})   # offline (vllm.LLM)
    {"vllm_xargs": {"num_steps": 32, "exit": "kl:5e-4"}}                               # OpenAI server

`exit` is the rule as `recurfit generate --exit` writes it (`ExitRule.parse`: "kl:5e-4", "state:0.01",
"argmax:2"; "none" turns a server default off), `min_depth` the steps a token runs before the rule is asked (as
`--min-steps`, default 2), and the request's depth (`num_steps`, or the default) is the cap. A server's default rule
is the folder's `exit` (and `min_depth`) in config.json, or `--hf-overrides '{"exit": "kl:5e-4"}'`. How often the
host asks which tokens stopped is the server's `exit_check_every` (as `generate --exit-check-every`; default 1): it
changes no token and no exit depth, only the steps at which stopped tokens leave the batch (between checks they
stay in it, frozen), so it is the engine's setting, not a request's.

As in `generate`, the rule applies to generated tokens only (a prompt runs every step of its depth), and a token
that stopped at step k is read by later tokens at step k at every deeper step: under the `all` cache policy its
step-k keys and values are written into the caches of steps k+1..cap (`recurfit.serving.steps`); under `latest`
its one cache already holds them. The exit depth of each generated token is kept for the latest requests
(`RequestExits.record`, by prompt).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..defaults import EXIT_CRITERIA
from ..errors import RecurfitError
from ..generation.exit import ExitRule

EXIT = "exit"  # the keys in SamplingParams.extra_args (vllm_xargs on the server)
MIN_DEPTH = "min_depth"
NO_EXIT = "none"
CHECK_EVERY = "exit_check_every"  # the server's setting (config.json or --hf-overrides)
KL, STATE, ARGMAX = (EXIT_CRITERIA.index(name) for name in ("kl", "state", "argmax"))
DEFAULT_MIN_DEPTH = ExitRule.__dataclass_fields__["min_steps"].default
DEFAULT_CHECK_EVERY = ExitRule.__dataclass_fields__["check_every"].default
NEVER = np.iinfo(np.int64).max  # a prompt length no position reaches: the row's tokens never exit


@dataclass(frozen=True)
class ServedExit:
    """A server's default rule (the folder's `exit` and `min_depth`) and how it reads a request's own."""

    default: str | None = None
    min_depth: int = DEFAULT_MIN_DEPTH
    check_every: int = DEFAULT_CHECK_EVERY  # core steps between the host's reads of which tokens stopped

    @classmethod
    def of(cls, config) -> ServedExit:
        default = getattr(config, EXIT, None)
        min_depth = getattr(config, MIN_DEPTH, None)
        check_every = getattr(config, CHECK_EVERY, None)
        check_every = DEFAULT_CHECK_EVERY if check_every is None else check_every
        if type(check_every) is not int or check_every < 1:
            raise ValueError(
                f"recurfit on vLLM: {CHECK_EVERY} (config.json or --hf-overrides) must be an integer >= 1, the core "
                f"steps between the host's checks of which tokens stopped, got {check_every!r}."
            )
        served = cls(default, DEFAULT_MIN_DEPTH if min_depth is None else min_depth, check_every)
        problem = served.problem({})
        if problem:
            raise ValueError(f"recurfit on vLLM: the served default exit rule (config's exit, min_depth): {problem}")
        return served

    def rule(self, extra_args: dict | None) -> ExitRule | None:
        """The rule a request asks for (or the server's default); None for none. A ValueError naming the field and
        the fix for anything else."""
        args = extra_args or {}
        spec = args.get(EXIT, self.default)
        min_depth = args.get(MIN_DEPTH, self.min_depth)
        if type(min_depth) is not int or min_depth < 1:
            raise ValueError(
                f"min_depth (vllm_xargs / SamplingParams.extra_args) must be an integer >= 1, got {min_depth!r}."
            )
        if spec is None or spec == NO_EXIT:
            return None
        if not isinstance(spec, str):
            raise ValueError(
                f"exit (vllm_xargs / SamplingParams.extra_args) must be a string such as 'kl:5e-4', got {spec!r}."
            )
        try:
            return ExitRule.parse(spec, min_steps=min_depth)
        except RecurfitError as problem:
            raise ValueError(
                f"exit (vllm_xargs / SamplingParams.extra_args) takes CRITERION[:VALUE] as `recurfit generate --exit` "
                f"does (kl:5e-4, state:0.01, argmax:2, or '{NO_EXIT}'): {problem}"
            ) from None

    def problem(self, extra_args: dict | None) -> str | None:
        try:
            self.rule(extra_args)
        except ValueError as problem:
            return str(problem)
        return None

    def salt(self, extra_args: dict | None) -> str:
        """The part of a request's cache salt its rule writes: blocks holding tokens that stopped early are shared
        only between requests of the same rule and minimum depth."""
        try:
            rule = self.rule(extra_args)
        except ValueError:  # checked at the frontend: one that reached the engine unchecked runs without exit
            rule = None
        if rule is None:
            return ""
        value = rule.patience if rule.criterion == "argmax" else rule.threshold
        return f"-exit-{rule.criterion}:{value!r}-min{rule.min_steps}"


class RequestExits:
    """Each batch row's exit rule (the V1 runner's table, kept beside the rows' depths by `RequestDepth`; Model
    Runner V2's model state keeps one by slot), expanded to each forward's tokens (`for_tokens`)."""

    RECORDED = 1024  # requests whose exit depths `record` keeps, latest first out last

    def __init__(self, rows: int, served: ServedExit):
        self.served = served
        self.criterion = np.full(rows, -1, dtype=np.int64)  # -1: no rule
        self.threshold = np.zeros(rows, dtype=np.float64)
        self.patience = np.zeros(rows, dtype=np.int64)
        self.min_steps = np.zeros(rows, dtype=np.int64)
        self.prompt = np.zeros(rows, dtype=np.int64)  # prompt lengths: tokens at or past it are generated
        self.logs: list[list[int] | None] = [None] * rows
        self.record: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self.asked = self.waits = 0  # steps that asked a rule, and of them the ones the host read (`TokenExits`)

    def add(self, row: int, extra_args: dict | None, prompt: list[int] | None) -> None:
        """A request at `row`: its rule (checked at the frontend; one that reached the worker unchecked runs without
        exit rather than ending the engine) and its prompt's length."""
        try:
            rule = self.served.rule(extra_args)
        except ValueError:
            rule = None
        self.criterion[row] = -1 if rule is None else EXIT_CRITERIA.index(rule.criterion)
        if rule is not None:
            self.threshold[row], self.patience[row], self.min_steps[row] = rule.threshold, rule.patience, rule.min_steps
        # A prompt given as embeddings has no length here: its tokens then never exit (as if without a rule).
        self.prompt[row] = len(prompt) if prompt is not None else NEVER
        self.logs[row] = None
        if rule is not None and prompt is not None:
            self.logs[row] = self.record.setdefault(tuple(prompt), [])
            self.record.move_to_end(tuple(prompt))
            while len(self.record) > self.RECORDED:
                self.record.popitem(last=False)

    def move(self, first: int, second: int, swap: bool) -> None:
        for table in (self.criterion, self.threshold, self.patience, self.min_steps, self.prompt):
            table[[first, second] if swap else [second]] = table[[second, first] if swap else [first]]
        if swap:
            self.logs[first], self.logs[second] = self.logs[second], self.logs[first]
        else:
            self.logs[second] = self.logs[first]

    def for_tokens(self, lengths: np.ndarray) -> TokenRules | None:
        """The rules of a forward's tokens (rows' `lengths` tokens each, in order), or None when no row has one."""
        rows = len(lengths)
        if not (self.criterion[:rows] >= 0).any():
            return None
        # A row of several tokens is a prompt's chunk, or a preempted request recomputed as one prefill with its
        # generated tokens (exit is refused beside speculation): those run at the cap, as `generate` runs a prompt,
        # so each request's tokens in a forward share one depth, which the narrowed attention metadata relies on.
        prompt = np.where(lengths == 1, self.prompt[:rows], NEVER)
        columns = (self.criterion, self.threshold, self.patience, self.min_steps, prompt)
        tokens = (np.repeat(column[:rows], lengths) for column in columns)
        return TokenRules(*tokens, self.logs[:rows], lengths, self.served.check_every, self)


@dataclass
class TokenRules:
    """The exit rules of one forward's tokens, on the host (`RequestExits.for_tokens`)."""

    criterion: np.ndarray
    threshold: np.ndarray
    patience: np.ndarray
    min_steps: np.ndarray
    prompt: np.ndarray
    logs: list
    lengths: np.ndarray
    check_every: int = DEFAULT_CHECK_EVERY
    table: RequestExits | None = None  # where they came from: `TokenExits.log` adds its waits to its count


class TokenExits:
    """One forward's exits: which tokens may stop (generated tokens of requests with a rule: `live` until they do),
    each one's depth (`depths`, its cap until it stops at a step; the step loop reads it), and what the rules compare
    from one step to the next (`check`), as recurfit.generation.exit.ExitTracker does per row.

    Everything a step decides stays on the device; the host reads it once every `check_every` steps (`changed`), and
    the step loop then drops the stopped tokens from the batch. Between reads a stopped token stays in the batch,
    frozen (`frozen`): the loop keeps its state and the keys and values of its last step, as `generate` freezes rows
    with `check_every` > 1."""

    def __init__(self, rules: TokenRules, positions: torch.Tensor, depths: torch.Tensor, read_logits):
        device, count = depths.device, len(rules.criterion)
        self.caps = depths.clone()
        self.depths = depths.clone()
        on = lambda column, dtype=torch.int64: torch.as_tensor(column, dtype=dtype).to(device)  # noqa: E731
        self.criterion = on(rules.criterion)
        self.threshold = on(rules.threshold, torch.float32)
        self.patience, self.min_steps = on(rules.patience), on(rules.min_steps)
        generated = on(rules.prompt) <= positions[..., :count]
        self.live = torch.zeros_like(self.depths, dtype=torch.bool)
        self.live[:count] = (self.criterion >= 0) & generated
        self.follow(None)
        self.tokens = self.local  # the tokens that may exit, in order
        self.slot = torch.full_like(self.depths, -1)
        self.slot[self.tokens] = torch.arange(self.tokens.numel(), device=device)
        self.criteria = {int(c) for c in np.unique(rules.criterion[rules.criterion >= 0])}
        self.reads_state = STATE in self.criteria
        self.read_logits = read_logits
        self.rules, self.check_every, self.changed = rules, rules.check_every, False
        self.previous_log_p = self.previous_token = None
        self.stable = torch.zeros(self.tokens.numel(), dtype=torch.int64, device=device)
        self.asked_steps = self.waits = 0  # steps that asked a rule; the host's reads of their decisions (`changed`)

    @classmethod
    def of(cls, rules: TokenRules | None, positions, depths, read_logits) -> TokenExits | None:
        exits = None if rules is None else cls(rules, positions, depths, read_logits)
        return exits if exits is not None and exits.tokens.numel() else None

    def follow(self, rows: torch.Tensor | None) -> None:
        """The step loop runs `rows` of the batch from now on (None: all): the tokens among them still live are the
        ones `check` asks (`candidates`; `local`, their indices into the rows: a wait on the device where the loop
        narrows anyway)."""
        self.local = (self.live if rows is None else self.live[rows]).nonzero().squeeze(1)
        self.candidates = self.local if rows is None else rows[self.local]
        self.running = len(self.live) if rows is None else rows.numel()

    def frozen(self) -> torch.Tensor | None:
        """A bool per row the loop runs: the tokens that stopped since it last narrowed (it keeps them as they were);
        None where none can be (checked at every step, a stopped token leaves the batch at the next)."""
        if self.check_every == 1 or self.local.numel() == 0:
            return None
        frozen = torch.zeros(self.running, dtype=torch.bool, device=self.live.device)
        return frozen.index_copy(0, self.local, ~self.live[self.candidates])

    def check(self, step: int, previous: torch.Tensor, state: torch.Tensor, probe) -> None:
        """After core step `step` (1-based) over the rows `follow` named (`previous` and `state` hold those rows
        only): stop the live tokens whose rule settled (`depths` set to `step`), on the device. At every
        `check_every`-th step the host reads whether any stopped since the loop narrowed (`changed`).
        `probe(local)` gives the final hidden states of `local` (indices into the rows) at `state`."""
        local, tokens = self.local, self.candidates
        self.changed = False
        if local.numel() == 0:
            return
        self.asked_steps += 1
        criterion, slot = self.criterion[tokens], self.slot[tokens]
        settled = torch.zeros_like(local, dtype=torch.bool)
        if self.reads_state:
            now, before = state[local].float(), previous[local].float()
            change = (now - before).norm(dim=-1) / now.norm(dim=-1).clamp_min(1e-12)
            settled |= (criterion == STATE) & (change < self.threshold[tokens])
        if self.criteria & {KL, ARGMAX}:
            logits = self.read_logits(probe(local)).float()
            settled |= self._settled_distribution(step, logits, criterion, slot, tokens)
        live = self.live[tokens]
        stopped = settled & live & (step >= self.min_steps[tokens])
        self.depths[tokens] = torch.where(stopped, step, self.depths[tokens])
        self.live[tokens] = live & ~stopped
        if step % self.check_every == 0:
            self.changed = not bool(self.live[tokens].all())  # the one wait on the device per check
            self.waits += 1

    def _settled_distribution(self, step, logits, criterion, slot, tokens) -> torch.Tensor:
        """kl: KL(p_s ‖ p_{s-1}) < threshold; argmax: the most likely token held for `patience` steps."""
        log_p = F.log_softmax(logits, dim=-1)
        token = logits.argmax(-1)
        if self.previous_log_p is None:
            self.previous_log_p = log_p.new_zeros((self.tokens.numel(), log_p.shape[-1]))
            self.previous_token = torch.zeros_like(self.stable)
        settled = torch.zeros_like(criterion, dtype=torch.bool)
        if step > 1:  # every live token ran the step before (a token stops for good)
            kl = (log_p.exp() * (log_p - self.previous_log_p[slot])).sum(-1)
            settled |= (criterion == KL) & (kl < self.threshold[tokens])
            held = token == self.previous_token[slot]
            self.stable[slot] = torch.where(held, self.stable[slot] + 1, torch.zeros_like(token))
        settled |= (criterion == ARGMAX) & (self.stable[slot] >= self.patience[tokens])
        self.previous_log_p[slot], self.previous_token[slot] = log_p, token
        return settled

    def stopped(self) -> torch.Tensor:
        """A bool per token: it stopped before its cap."""
        return self.depths < self.caps

    def log(self) -> None:
        """Each generated token's exit depth appended to its request's record (`RequestExits.record`), and the
        forward's steps that asked a rule and waits to the table's counts."""
        if self.rules.table is not None:
            self.rules.table.asked += self.asked_steps
            self.rules.table.waits += self.waits
        depths = self.depths[self.tokens].tolist()
        starts = np.concatenate([[0], np.cumsum(self.rules.lengths)])
        owners = np.searchsorted(starts, self.tokens.cpu().numpy(), side="right") - 1
        for owner, depth in zip(owners, depths):
            log = self.rules.logs[owner]
            if log is not None:
                log.append(depth)
