"""Depth per request: each request names its recurrence, and the model runs each token to its own request's depth.

    SamplingParams(extra_args={"num_steps": 16})             # offline (vllm.LLM)
    {"vllm_xargs": {"num_steps": 16}}                          # OpenAI server: the request body (extra_body)

Without it a request runs at the folder's `mean_recurrence` (r̄). The server's limit is `max_recurrence`
(`--hf-overrides`, default MAX_RECURRENCE_FACTOR × r̄); under the `all` cache policy it is also how many per-step
KV caches each core layer gets, so it sets the KV memory per token.

vLLM hands a model no per-request values, so the depth travels through vLLM's own hooks:

- `RecurfitEngineConfig.verify_and_update_config` (vLLM's per-architecture config hook, run when the engine's
  config is built) checks the limits and the cache settings and adds `RequestDepth` to the engine's logits
  processors;
- `RequestDepth.validate_params` (run on every request before it is admitted) refuses a depth that is not an
  integer in [1, max_recurrence] with a validation error: a 400 naming the field and the range on the server, a
  ValueError offline;
- `RequestDepth.update_state` (run in the worker before each forward, with the batch's added, removed and moved
  requests) keeps each batch row's depth in a fixed table that the model reads, expanding rows to tokens with the
  attention metadata's `query_start_loc`;
- a request that names its depth gets it in its `cache_salt` (`salt_by_depth`), so prefix caching shares blocks
  only between requests of the same depth: a block written at depth d holds keys for steps 1..d only.

`EffortToDepth` (`vllm serve --middleware recurfit.serving.depth.EffortToDepth`) maps a chat request's
`reasoning_effort` to a depth through `depth_for_effort` in config.json: vLLM passes `reasoning_effort` only to the
chat template, never to the sampling parameters, so without the middleware it cannot reach the model. A folder
without the table (`recurfit train` writes one) gets `recurfit.defaults.depth_for_effort` of the served depths, and
so does a folder whose table `--hf-overrides` leaves while changing `mean_recurrence` or `max_recurrence`: the
folder's table was made for its own depths.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import torch
from vllm.config import CUDAGraphMode
from vllm.exceptions import VLLMValidationError
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from ..defaults import MAX_RECURRENCE_FACTOR, depth_for_effort

NUM_STEPS = "num_steps"  # the key in SamplingParams.extra_args (vllm_xargs on the server)
PROCESSOR = "recurfit.serving.depth:RequestDepth"


@dataclass(frozen=True)
class Limits:
    """A served folder's depths: the default (r̄), the server's maximum, reasoning_effort's table, and the depths
    a compiled engine has a graph for (`compiled_depths`, default: the table's, r̄ and the maximum)."""

    default: int
    maximum: int
    effort: dict
    compiled: tuple[int, ...]

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
        compiled = getattr(config, "compiled_depths", None)
        if compiled is None:
            compiled = list(dict(effort).values())
        if not isinstance(compiled, (list, tuple)) or not all(type(v) is int and 1 <= v <= maximum for v in compiled):
            raise ValueError(
                f"recurfit on vLLM: compiled_depths must be a list of integers in [1, {maximum}], got {compiled!r}."
            )
        return cls(default, maximum, dict(effort), tuple(sorted({*compiled, default, maximum})))

    def depth(self, extra_args: dict | None) -> int:
        """The depth a request asks for (extra_args["num_steps"]), or the default; a ValueError naming the field
        and the range for anything else."""
        value = (extra_args or {}).get(NUM_STEPS)
        if value is None:
            return self.default
        if type(value) is not int or not 1 <= value <= self.maximum:
            raise ValueError(
                f"num_steps (vllm_xargs / SamplingParams.extra_args) must be an integer in [1, {self.maximum}] "
                f"(this server's max_recurrence), got {value!r}."
            )
        return value


# The limits of the engine whose config this process built last (the API server's, or vllm.LLM's): validate_params
# is a classmethod that vLLM calls with the request's parameters only.
_frontend: Limits | None = None


class RecurfitEngineConfig(VerifyAndUpdateConfig):
    """vLLM's config hook for architecture RecurrentForCausalLM (registered by recurfit.serving.register)."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        global _frontend
        model_config = vllm_config.model_config
        config = model_config.hf_config
        overrides = model_config.hf_overrides if isinstance(model_config.hf_overrides, dict) else {}
        if "depth_for_effort" not in overrides and {"mean_recurrence", "max_recurrence"} & overrides.keys():
            config.depth_for_effort = None  # the folder's table is for its own depths: the defaults of these
        limits = Limits.of(config)
        if getattr(config, "cache_policy", "all") == "latest":
            on = [
                name
                for name, value in (
                    ("enable_prefix_caching", vllm_config.cache_config.enable_prefix_caching),
                    ("enable_chunked_prefill", vllm_config.scheduler_config.enable_chunked_prefill),
                )
                if value
            ]
            if on:
                raise ValueError(
                    "recurfit on vLLM: cache_policy 'latest' keeps one key per token, its last step's, so a prompt "
                    "split into chunks or read from the prefix cache would see other steps' keys than generate "
                    f"does: turn off {' and '.join(on)} (--no-{' --no-'.join(n.replace('_', '-') for n in on)}), "
                    "or serve cache_policy 'all'."
                )
        _piecewise_cuda_graphs(vllm_config.compilation_config)
        processors = list(model_config.logits_processors or [])
        if PROCESSOR not in processors and RequestDepth not in processors:
            model_config.logits_processors = [*processors, PROCESSOR]
        _frontend = limits


def _piecewise_cuda_graphs(compilation) -> None:
    """CUDA graphs of the compiled pieces only (vLLM's PIECEWISE), not of whole forwards (its FULL modes, the
    default when none is named): the depth each batch runs at, and so which compiled graph runs, is chosen on the
    host at every forward (`RecurfitForCausalLM.forward`), which a graph of the whole forward would replay as
    captured. A FULL mode named by the user is refused rather than changed."""
    mode = compilation.cudagraph_mode
    if mode is None:
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    elif mode.has_full_cudagraphs():
        raise ValueError(
            f"recurfit on vLLM: cudagraph_mode {mode.name} captures whole forwards, but each batch's depth is chosen "
            "on the host at every forward: use PIECEWISE (-cc.cudagraph_mode=PIECEWISE) or NONE."
        )


# The RequestDepth of the engine whose worker runs in this process (vLLM builds it with the worker's input batch,
# before the model's first forward); a weak reference, so that a stopped engine's goes with it.
_worker: weakref.ref | None = None


def table_for(limits: Limits) -> RequestDepth:
    """This worker's RequestDepth (the model reads its rows' depths from it), checked against the model's limits."""
    table = _worker() if _worker is not None else None
    if table is None:
        raise RuntimeError(
            f"recurfit on vLLM: the engine runs without the {PROCESSOR} logits processor, which carries each "
            "request's depth to the model (speculative decoding and pooling runners have no logits processors)."
        )
    if table.limits != limits:
        raise RuntimeError(f"recurfit on vLLM: this worker's depth table is another engine's ({table.limits}).")
    return table


class RequestDepth(LogitsProcessor):
    """Each batch row's depth, for the model; leaves the logits alone."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """A VLLMValidationError (the server's 400) for a depth that is not an integer in [1, max_recurrence]."""
        extra = sampling_params.extra_args
        try:
            if _frontend is not None:
                _frontend.depth(extra)
            elif extra and NUM_STEPS in extra:
                raise ValueError(
                    "num_steps (vllm_xargs / SamplingParams.extra_args): this engine serves no recurfit model."
                )
        except ValueError as problem:
            raise VLLMValidationError(str(problem), parameter=NUM_STEPS, value=extra.get(NUM_STEPS)) from None

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.limits = Limits.of(vllm_config.model_config.hf_config)
        rows = vllm_config.scheduler_config.max_num_seqs
        self.rows = torch.full((rows,), self.limits.default, dtype=torch.int64)
        self.live = torch.zeros(rows, dtype=torch.bool)  # rows holding a request (vLLM's warm-up runs hold none)
        # Each token's depth, in one buffer the model reads a prefix of: a CUDA graph replays reading the address
        # it was captured with, so the depths must be written there rather than handed over in a new tensor.
        self.tokens = torch.ones(vllm_config.scheduler_config.max_num_batched_tokens, dtype=torch.int64, device=device)
        global _worker
        _worker = weakref.ref(self)

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.live[index] = False
        for index, params, _, _ in batch_update.added:
            self.rows[index] = self.limits.depth(params.extra_args)
            self.live[index] = True
        for first, second, direction in batch_update.moved:
            for table in (self.rows, self.live):
                if direction == MoveDirectionality.SWAP:
                    table[[first, second]] = table[[second, first]]
                else:
                    table[second] = table[first]
            if direction != MoveDirectionality.SWAP:
                self.live[first] = False

    def token_depths(self, query_start_loc: torch.Tensor | None, num_tokens: int) -> tuple[torch.Tensor, int | None]:
        """Each token's depth (its request's; padding tokens 1) in a prefix of the `tokens` buffer, and the batch's
        deepest request's. A batch without requests (vLLM's profiling, warm-up and CUDA-graph capture runs;
        `query_start_loc` None outside a forward context) has every token at `max_recurrence`, and None for its
        deepest. Rows' tokens start at `query_start_loc` (num_reqs + 1 offsets)."""
        if num_tokens > self.tokens.numel():  # not in vLLM's runs (at most max_num_batched_tokens)
            self.tokens = self.tokens.new_ones(num_tokens)
        depths = self.tokens[:num_tokens]
        num_reqs = 0 if query_start_loc is None else query_start_loc.numel() - 1
        if not self.live[:num_reqs].any():
            return depths.fill_(self.limits.maximum), None
        rows = self.rows[:num_reqs]
        lengths = (query_start_loc[1:] - query_start_loc[:-1]).cpu()
        per_token = torch.repeat_interleave(rows, lengths)
        depths[: per_token.numel()].copy_(per_token)
        depths[per_token.numel() :].fill_(1)
        return depths, int(rows.max())


def salt_by_depth(request) -> None:
    """Give an EngineCoreRequest that names its depth a cache salt per depth (kept with the client's own salt)."""
    params = request.sampling_params
    steps = (params.extra_args or {}).get(NUM_STEPS) if params is not None else None
    if steps is not None:
        request.cache_salt = f"{request.cache_salt or ''}\x00recurfit num_steps={steps!r}"


class EffortToDepth:
    """ASGI middleware: a chat request's `reasoning_effort` becomes `vllm_xargs.num_steps` through the served
    folder's `depth_for_effort` (a request that names num_steps keeps it; an effort not in the table is a 400)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if isinstance(request, dict) and request.get("reasoning_effort") is not None and _frontend is not None:
            effort = request["reasoning_effort"]
            xargs = request.get("vllm_xargs") or {}
            if effort not in _frontend.effort:
                return await _bad_request(
                    send,
                    f"reasoning_effort must be one of {sorted(_frontend.effort)} (depth_for_effort), got {effort!r}.",
                )
            if isinstance(xargs, dict) and NUM_STEPS not in xargs:
                request["vllm_xargs"] = {**xargs, NUM_STEPS: _frontend.effort[effort]}
                body = json.dumps(request).encode()
                scope = dict(scope, headers=_with_length(scope["headers"], len(body)))
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


def _with_length(headers, length: int):
    return [(k, v) for k, v in headers if k.lower() != b"content-length"] + [(b"content-length", str(length).encode())]


async def _bad_request(send, message: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": "reasoning_effort", "code": 400}}
    )
    await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body.encode()})
