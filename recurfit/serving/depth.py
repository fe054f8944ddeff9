"""Depth per request: each request names its recurrence, and the model runs each token to its own request's depth.

    SamplingParams(extra_args={"num_steps": 16})             # offline (vllm.LLM)
    {"vllm_xargs": {"num_steps": 16}}                          # OpenAI server: the request body (extra_body)

Without it a request runs at the folder's `mean_recurrence` (r̄). The server's limit is `max_recurrence`
(`--hf-overrides`, default MAX_RECURRENCE_FACTOR × r̄); under the `all` cache policy it is also how many per-step
KV caches each core layer gets, so it sets the KV memory per token.

vLLM hands a model no per-request values, so the depth travels through vLLM's own hooks:

- the engine's config hook (recurfit.serving.engine, vLLM's per-architecture hook, run when an engine's
  config is built) checks the limits and the cache and graph settings, sets the engine's scheduler and adds the
  engine's logits processor, a class per `max_recurrence` made on demand (`RequestDepthUpTo16`, …), whose
  `validate_params` (run on every request of every route before it is admitted) refuses a depth that is not an
  integer in [1, max_recurrence]: a 400 naming the field and the range on the server, a validation error offline.
  vLLM calls it with the request's parameters only, so each engine's limit is its class's own;
- under the V1 runner that processor is `RequestDepth`, whose `update_state` (run in the worker before each
  forward, with the batch's added, removed and moved requests) keeps each batch row's depth in a table the
  model reads (`table_for`, by the engine's config), expanding rows to tokens with the attention metadata's
  `query_start_loc`; under Model Runner V2, whose loader takes processors of its own interface only, it is
  `DepthParams`, which only checks, and the model's state (recurfit.serving.model_state) carries the depths;
- the engine's scheduler (recurfit.serving.scheduler) salts each request's prefix cache with its depth,
  `max_recurrence` and cache policy (`Limits.salt`), so prefix caching shares blocks only between requests that
  write the same keys, whatever route or client the request came by.

Reasoning effort (chat's `reasoning_effort`, …) reaches the model only through recurfit's middleware
(recurfit.serving.middleware.EffortToDepth), which maps it to a depth: vLLM gives it to the chat template alone.

Speculative decoding (`--speculative-config`, method `draft_model`, a draft folder from `recurfit draft`): the
draft runs every token at its folder's depth. Model Runner V2 carries each request's depth to the target as above.
The V1 runner refuses custom logits processors beside speculation, so no request's depth can reach its model: the
engine runs every request at its default (`Limits.only`), and the scheduler refuses a request that names another
depth before it runs (recurfit.serving.scheduler; the middleware refuses it with a 400 before it reaches the
engine).
"""

from __future__ import annotations

import logging
import re
import weakref
from dataclasses import dataclass, replace

import numpy as np
import torch
from vllm.exceptions import VLLMValidationError

try:  # the V1 runner's logits processors: vLLM 0.32 and 0.33; 0.34 removed the V1 runner (Model Runner V2 only)
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
except ImportError:
    BatchUpdate = MoveDirectionality = None
    LogitsProcessor = object  # RequestDepth is then never loaded: `processor_for` names DepthParams

from ..defaults import MAX_RECURRENCE_FACTOR, depth_for_effort
from .exit import EXIT, MIN_DEPTH, RequestExits, ServedExit

NUM_STEPS = "num_steps"  # the key in SamplingParams.extra_args (vllm_xargs on the server)
V1_PROCESSOR = "RequestDepthUpTo"  # + max_recurrence: the V1 runner's logits processor for an engine's limits
V2_PROCESSOR = "DepthParamsUpTo"  # + max_recurrence: Model Runner V2's (validation only; RecurfitModelState)
PROCESSOR_NAME = re.compile(rf"^({V1_PROCESSOR}|{V2_PROCESSOR})([1-9][0-9]*)$")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """A served folder's depths: the default (r̄), the server's maximum, reasoning_effort's table, and the cache
    policy."""

    default: int
    maximum: int
    effort: dict
    policy: str = "all"
    only: int | None = None  # the one depth every request runs at (`one_depth_engine`); None: each its own
    exit: ServedExit = ServedExit()  # the default exit rule (recurfit.serving.exit)

    @classmethod
    def of(cls, config) -> Limits:
        default = config.mean_recurrence
        maximum = getattr(config, "max_recurrence", None)
        if maximum is None:
            maximum = MAX_RECURRENCE_FACTOR * default
        if not (type(maximum) is int and maximum >= default):
            raise ValueError(
                f"recurfit on vLLM: max_recurrence must be an integer >= mean_recurrence ({default}), got {maximum!r}."
            )
        effort = getattr(config, "depth_for_effort", None)
        if effort is None:
            effort = depth_for_effort(default, maximum)
        bad = {k: v for k, v in dict(effort).items() if not (type(v) is int and 1 <= v <= maximum)}
        if bad:
            raise ValueError(f"recurfit on vLLM: depth_for_effort must map to integers in [1, {maximum}], got {bad}.")
        return cls(default, maximum, dict(effort), getattr(config, "cache_policy", "all"), exit=ServedExit.of(config))

    def depth(self, extra_args: dict | None) -> int:
        """The depth a request asks for (extra_args["num_steps"]), or the default; a ValueError naming the field
        and the range for anything else."""
        value = (extra_args or {}).get(NUM_STEPS)
        if value is None:
            return self.default
        problem = depth_problem(value, self.maximum, self.only)
        if problem:
            raise ValueError(problem)
        return value

    def salt(self, depth: int, client: str | None = None, extra_args: dict | None = None) -> str:
        """The cache salt of a request at `depth` (after the client's own, when it gave one; recurfit's scheduler
        sets it): prefix caching then shares blocks only between requests of the same depth, `max_recurrence`,
        cache policy and exit rule (`extra_args`'), which write the same keys and values (a block written at depth
        d holds the coda's keys of depth d)."""
        ours = f"recurfit-r{depth}-max{self.maximum}-{self.policy}{self.exit.salt(extra_args)}"
        return ours if not client else f"{client};{ours}"

    def served_depth(self, extra_args: dict | None) -> int:
        """The depth a worker runs a request at: its own, which the frontend checked (`depth`). A depth that reached
        the worker unchecked is logged and run at the nearest served one rather than raised: an error in the worker
        would end the engine, every other request with it."""
        try:
            return self.depth(extra_args)
        except ValueError as problem:
            value = extra_args[NUM_STEPS]
            served = min(max(value, 1), self.maximum) if type(value) is int else self.default
            logger.error(
                "recurfit on vLLM: a request reached the worker unchecked (%s); it runs at %d.", problem, served
            )
            return served


def engine_limits(vllm_config) -> Limits:
    """The limits of the engine `vllm_config` configures (after `RecurfitEngineConfig` has seen it)."""
    limits = Limits.of(vllm_config.model_config.hf_config)
    if limits.exit.rule({}) is not None and (one_depth_engine(vllm_config) or runs_model_runner_v2(vllm_config)):
        raise ValueError(
            f"recurfit on vLLM: the default exit rule {limits.exit.default!r} (config's exit) is served on vLLM's V1 "
            "runner without speculative decoding only: drop it (--hf-overrides '{\"exit\": null}'), or serve with "
            "VLLM_USE_V2_MODEL_RUNNER=0 (vLLM 0.33 or earlier, which have the V1 runner) and without "
            "--speculative-config."
        )
    return replace(limits, only=limits.default) if one_depth_engine(vllm_config) else limits


def one_depth_engine(vllm_config) -> bool:
    """Whether the engine runs every request at its default depth: a draft model of vLLM's speculative decoding
    (its folder sets the depth), and a speculating engine on the V1 runner, which refuses custom logits processors
    beside speculation, so that no request's own depth can reach the model."""
    if vllm_config.model_config.runner_type == "draft":
        return True
    return vllm_config.speculative_config is not None and not runs_model_runner_v2(vllm_config)


def runs_model_runner_v2(vllm_config) -> bool:
    """Whether the engine runs Model Runner V2: vLLM 0.32 and 0.33 choose between it and the V1 runner
    (`VllmConfig.use_v2_model_runner`, VLLM_USE_V2_MODEL_RUNNER); 0.34 has no other runner, nor the attribute."""
    return getattr(vllm_config, "use_v2_model_runner", True)


def processor_for(limits: Limits, v2_runner: bool) -> str:
    """The logits processor (a "module:Class" name) that checks each request's depth against `limits` when it
    is admitted: the V1 runner's also carries the depths to the model; under Model Runner V2, whose loader takes
    its own interface only, the model state does (recurfit.serving.model_state) and the processor only checks."""
    return f"{__name__}:{V2_PROCESSOR if v2_runner else V1_PROCESSOR}{limits.maximum}"


def is_ours(processor) -> bool:
    name = processor if isinstance(processor, str) else f"{processor.__module__}:{processor.__qualname__}"
    module, _, qualname = name.partition(":")
    return module == __name__ and PROCESSOR_NAME.match(qualname) is not None


def __getattr__(name: str):
    """`RequestDepthUpTo16`, `DepthParamsUpTo16`, …: the processor classes of an engine's limits, made when vLLM
    first loads them by name (in each process that loads them). vLLM calls `validate_params` with a request's
    parameters only, so the limit a class checks is its own: two engines of different limits in one process
    each check theirs."""
    match = PROCESSOR_NAME.match(name)
    if match is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if match[1] == V1_PROCESSOR:
        bases = (RequestDepth,)
    else:  # imported here: the V1 runner's engines never need Model Runner V2's modules
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

        bases = (DepthParams, V2LogitsProcessor)
    made = type(name, bases, {"maximum": int(match[2]), "__module__": __name__, "__qualname__": name})
    globals()[name] = made
    return made


def check_depth(cls, sampling_params) -> None:
    """`validate_params` of both runners' processors: a ValueError (vLLM's validation error, the server's 400)
    for a depth that is not an integer in [1, max_recurrence]."""
    extra_args = sampling_params.extra_args or {}
    value = extra_args.get(NUM_STEPS)
    problem = None if value is None else depth_problem(value, cls.maximum)
    if problem:
        raise VLLMValidationError(problem, parameter=NUM_STEPS, value=value)
    problem = ServedExit().problem(extra_args)  # the request's own rule (the server's default is checked at start)
    if problem is None and cls.exits is False and ServedExit().rule(extra_args) is not None:
        problem = (
            "exit (vllm_xargs / SamplingParams.extra_args) is served on vLLM's V1 runner only, not on Model Runner "
            "V2: drop exit, or serve with VLLM_USE_V2_MODEL_RUNNER=0 (vLLM 0.33 or earlier, which have the V1 runner)."
        )
    if problem:
        field = MIN_DEPTH if problem.startswith(MIN_DEPTH) else EXIT
        raise VLLMValidationError(problem, parameter=field, value=extra_args.get(field))


def depth_problem(value, maximum: int | None, only: int | None = None) -> str | None:
    """What is wrong with `value` as a request's depth on a server of `max_recurrence` `maximum` that runs every
    request at `only` when it is given (None: nothing)."""
    if only is not None:
        if value == only and type(value) is int:
            return None
        return (
            f"num_steps (vllm_xargs / SamplingParams.extra_args) can only be {only} on this server, got {value!r}: "
            "it speculates on vLLM's V1 runner, which carries no per-request values to the model beside "
            f"speculative decoding, so every request runs at its default depth ({only}). Drop num_steps, or serve "
            "without --speculative-config, or on Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)."
        )
    if maximum is not None and type(value) is int and 1 <= value <= maximum:
        return None
    return (
        f"num_steps (vllm_xargs / SamplingParams.extra_args) must be an integer in [1, {maximum}] "
        f"(this server's max_recurrence), got {value!r}."
    )


class TokenDepths:
    """Each token's depth, in one device buffer the model reads a prefix of (allocated once). The depths are worked
    out on the host and copied without waiting for the device (through pinned buffers taken in turn, so that a
    copy still queued is not overwritten); the step loop reads them outside the compiled pieces."""

    STAGING = 4  # pinned host buffers in turn: more than the batches vLLM keeps in flight

    def __init__(self, size: int, device: torch.device):
        self.device = torch.ones(size, dtype=torch.int64, device=device)
        pinned = self.device.device.type != "cpu"
        self.staging = [torch.ones(size, dtype=torch.int64, pin_memory=pinned) for _ in range(self.STAGING)]
        self.turn = 0

    def write(self, per_token: np.ndarray, num_tokens: int) -> torch.Tensor:
        """`per_token` (the batch's tokens' depths, on the host), then padding tokens at depth 1, as a prefix of
        the buffer."""
        if num_tokens > self.device.numel():  # not in vLLM's runs (at most max_num_batched_tokens)
            self.__init__(num_tokens, self.device.device)
        count = min(len(per_token), num_tokens)
        self.turn = (self.turn + 1) % self.STAGING
        host = self.staging[self.turn][:num_tokens]
        host[:count] = torch.from_numpy(np.asarray(per_token[:count], dtype=np.int64))
        host[count:] = 1
        return self.device[:num_tokens].copy_(host, non_blocking=True)

    def warm_up(self, num_tokens: int) -> torch.Tensor:
        """A batch of no request (vLLM's profiling, warm-up and CUDA-graph capture runs): every token at depth 1.
        One step compiles and captures every piece (the core step is the same at every depth)."""
        return self.every_token_at(1, num_tokens)

    def every_token_at(self, depth: int, num_tokens: int) -> torch.Tensor:
        if num_tokens > self.device.numel():
            self.__init__(num_tokens, self.device.device)
        return self.device[:num_tokens].fill_(depth)


def depth_stops(request_depths) -> tuple[int, ...]:
    """A batch's distinct depths, increasing, as host integers: the steps at which some of its tokens stop."""
    return tuple(sorted({int(depth) for depth in request_depths}))


# Each V1 engine's RequestDepth, by the identity of its VllmConfig (the model is built with the same object): weak
# references, so that a stopped engine's table goes with it.
_tables: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def table_for(vllm_config) -> RequestDepth:
    """The V1 runner's RequestDepth of the engine `vllm_config` configures (the model reads its rows' depths)."""
    config, table = (ref() for ref in _tables.get(id(vllm_config), (lambda: None, lambda: None)))
    if config is not vllm_config or table is None:
        raise RuntimeError(
            "recurfit on vLLM: the engine runs without recurfit's depth logits processor, which carries each "
            "request's depth to the model under the V1 runner (speculative decoding and pooling runners have no "
            "logits processors)."
        )
    return table


class RequestDepth(LogitsProcessor):
    """The V1 runner's processor: checks each request's depth when it is admitted (`validate_params`), and keeps
    each batch row's depth for the model; leaves the logits alone. Loaded by name per engine's limits
    (`RequestDepthUpTo16`, …)."""

    maximum: int | None = None  # the engine's max_recurrence (set on each engine's class)
    exits = True  # whether requests' exit rules reach the model (recurfit.serving.exit)
    validate_params = classmethod(check_depth)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.limits = engine_limits(vllm_config)
        rows = vllm_config.scheduler_config.max_num_seqs
        self.rows = torch.full((rows,), self.limits.default, dtype=torch.int64)
        self.live = torch.zeros(rows, dtype=torch.bool)  # rows holding a request (vLLM's warm-up runs hold none)
        self.tokens = TokenDepths(vllm_config.scheduler_config.max_num_batched_tokens, device)
        self.exits = RequestExits(rows, self.limits.exit)
        self.rules = None  # the exit rules of the last forward's tokens (`RequestExits.for_tokens`)
        for key in [key for key, (config, _) in _tables.items() if config() is None]:
            del _tables[key]
        _tables[id(vllm_config)] = (weakref.ref(vllm_config), weakref.ref(self))

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.live[index] = False
        for index, params, prompt, _ in batch_update.added:
            self.rows[index] = self.limits.served_depth(params.extra_args)
            self.live[index] = True
            self.exits.add(index, params.extra_args, prompt)
        for first, second, direction in batch_update.moved:
            for table in (self.rows, self.live):
                if direction == MoveDirectionality.SWAP:
                    table[[first, second]] = table[[second, first]]
                else:
                    table[second] = table[first]
            self.exits.move(first, second, direction == MoveDirectionality.SWAP)
            if direction != MoveDirectionality.SWAP:
                self.live[first] = False

    def token_depths(
        self, query_start_loc, num_tokens: int, max_query_len: int | None = None
    ) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        """Each token's depth (its request's; padding tokens 1) and the batch's distinct depths (`depth_stops`). A
        batch without requests (vLLM's profiling, warm-up and CUDA-graph capture runs) has None for its stops.
        Rows' tokens start at `query_start_loc` (num_reqs + 1 offsets, from the forward's attention metadata); a
        forward without it while requests are live is an error, not a warm-up. The offsets are on the device, and the
        V1 runner's metadata has no host copy: they are read (a wait on the device) only where the batch's longest
        query (`max_query_len`, on the host) is longer than one token, so decode batches do not wait."""
        if query_start_loc is None:
            if self.live.any():
                raise RuntimeError(
                    "recurfit on vLLM: a forward with requests in the batch has no attention metadata, so each "
                    "token's request, and its depth, is unknown."
                )
            return self.tokens.warm_up(num_tokens), None
        num_reqs = query_start_loc.numel() - 1
        if not self.live[:num_reqs].any():
            return self.tokens.warm_up(num_tokens), None
        rows = self.rows[:num_reqs]
        if max_query_len == 1:  # every request has one token (each has at least one)
            lengths = torch.ones(num_reqs, dtype=torch.int64)
        else:
            lengths = (query_start_loc[1:] - query_start_loc[:-1]).cpu()
        per_token = torch.repeat_interleave(rows, lengths).numpy()
        self.rules = self.exits.for_tokens(lengths.numpy())
        return self.tokens.write(per_token, num_tokens), depth_stops(rows.tolist())


class DepthParams:
    """Model Runner V2's processor (with its `LogitsProcessor` interface, added where each engine's class is made):
    checks each request's depth when it is admitted, and nothing else (the model state,
    recurfit.serving.model_state, carries the depths to the model). Loaded by name per engine's limits
    (`DepthParamsUpTo16`, …)."""

    maximum: int | None = None
    exits = False
    validate_params = classmethod(check_depth)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        return False  # leaves every request's logits alone: the sampler skips it

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        return logits
