"""Adaptive exit per request: each generated token stops recurring once its request's exit rule says it settled.

    SamplingParams(extra_args={"num_steps": 32, "exit": "kl:5e-4", "min_depth": 2})   # offline (vllm.LLM)
    {"vllm_xargs": {"num_steps": 32, "exit": "kl:5e-4"}}                               # OpenAI server

`exit` is the rule as `recurfit generate --exit` writes it (`ExitRule.parse`: "kl:5e-4", "state:0.01",
"argmax:2"; "none" turns a server default off), `min_depth` the steps a token runs before the rule is asked (as
`--min-steps`, default 2), and the request's depth (`num_steps`, or the default) is the cap. A server's default rule
is the folder's `exit` (and `min_depth`) in config.json, or `--hf-overrides '{"exit": "kl:5e-4"}'`.

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
KL, STATE, ARGMAX = (EXIT_CRITERIA.index(name) for name in ("kl", "state", "argmax"))
DEFAULT_MIN_DEPTH = ExitRule.__dataclass_fields__["min_steps"].default


@dataclass(frozen=True)
class ServedExit:
    """A server's default rule (the folder's `exit` and `min_depth`) and how it reads a request's own."""

    default: str | None = None
    min_depth: int = DEFAULT_MIN_DEPTH

    @classmethod
    def of(cls, config) -> ServedExit:
        default = getattr(config, EXIT, None)
        min_depth = getattr(config, MIN_DEPTH, None)
        served = cls(default, DEFAULT_MIN_DEPTH if min_depth is None else min_depth)
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
        self.prompt[row] = len(prompt) if prompt is not None else np.iinfo(np.int64).max
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
        columns = (self.criterion, self.threshold, self.patience, self.min_steps, self.prompt)
        return TokenRules(*(np.repeat(column[:rows], lengths) for column in columns), self.logs[:rows], lengths)


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


class TokenExits:
    """One forward's exits: which tokens may stop (generated tokens of requests with a rule: `live` until they do),
    each one's depth (`depths`, its cap until it stops at a step; the step loop reads it), and what the rules compare
    from one step to the next (`check`), as recurfit.generation.exit.ExitTracker does per row."""

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
        self.tokens = self.live.nonzero().squeeze(1)  # the tokens that may exit, in order (one wait on the device)
        self.slot = torch.full_like(self.depths, -1)
        self.slot[self.tokens] = torch.arange(self.tokens.numel(), device=device)
        self.criteria = {int(c) for c in np.unique(rules.criterion[rules.criterion >= 0])}
        self.reads_state = STATE in self.criteria
        self.read_logits = read_logits
        self.rules, self.changed = rules, False
        self.previous_log_p = self.previous_token = None
        self.stable = torch.zeros(self.tokens.numel(), dtype=torch.int64, device=device)

    @classmethod
    def of(cls, rules: TokenRules | None, positions, depths, read_logits) -> TokenExits | None:
        exits = None if rules is None else cls(rules, positions, depths, read_logits)
        return exits if exits is not None and exits.tokens.numel() else None

    def check(self, step: int, previous: torch.Tensor, state: torch.Tensor, rows, probe) -> None:
        """After core step `step` (1-based) over `rows` of the batch (None: all; `previous` and `state` hold those
        rows only): stop the live tokens whose rule settled (`depths` set to `step`; `changed` says whether any
        did). `probe(local)` gives the final hidden states of `local` (indices into the rows) at `state`."""
        live = self.live if rows is None else self.live[rows]
        local = live.nonzero().squeeze(1)
        self.changed = False
        if local.numel() == 0:
            return
        tokens = local if rows is None else rows[local]
        criterion, slot = self.criterion[tokens], self.slot[tokens]
        settled = torch.zeros_like(local, dtype=torch.bool)
        if self.reads_state:
            now, before = state[local].float(), previous[local].float()
            change = (now - before).norm(dim=-1) / now.norm(dim=-1).clamp_min(1e-12)
            settled |= (criterion == STATE) & (change < self.threshold[tokens])
        if self.criteria & {KL, ARGMAX}:
            logits = self.read_logits(probe(local)).float()
            settled |= self._settled_distribution(step, logits, criterion, slot, tokens)
        stopped = tokens[settled & (step >= self.min_steps[tokens])]
        if stopped.numel():
            self.depths[stopped], self.live[stopped], self.changed = step, False, True

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
        """Each generated token's exit depth appended to its request's record (`RequestExits.record`)."""
        depths = self.depths[self.tokens].tolist()
        starts = np.concatenate([[0], np.cumsum(self.rules.lengths)])
        owners = np.searchsorted(starts, self.tokens.cpu().numpy(), side="right") - 1
        for owner, depth in zip(owners, depths):
            log = self.rules.logs[owner]
            if log is not None:
                log.append(depth)
