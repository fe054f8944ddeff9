"""`EffortToDepth`, the ASGI middleware of `vllm serve` for recurfit folders: each generation request's reasoning
effort mapped to a depth, the depth checked and reported.

    vllm serve RUN/final --middleware recurfit.serving.middleware.EffortToDepth

vLLM passes a chat request's `reasoning_effort` (the Responses API's `reasoning.effort`, Anthropic's
`output_config.effort`) only to the chat template, never to the sampling parameters: this middleware turns it into
the request's `vllm_xargs.num_steps` through `depth_for_effort` in config.json, as the template sees it (after the
server's `--reasoning-effort-map`). A folder without the table
(`recurfit train` writes one) gets `recurfit.defaults.depth_for_effort` of the served depths, and so does a folder
whose table `--hf-overrides` leaves while changing `mean_recurrence` or `max_recurrence`. It also refuses, with a
400, what the engine cannot refuse itself (beam search at a depth), adds each answer's depth to its headers
(`x-recurfit-depth`), and counts requests per depth on `/metrics`. A request's own `vllm_xargs.num_steps`, and
the cache kept apart by depth, need no middleware: the engine checks the one (recurfit.serving.depth) and salts
the other (recurfit.serving.scheduler).
"""

from __future__ import annotations

import functools
import json

from . import ARCHITECTURE
from .depth import NUM_STEPS, Limits, depth_problem, engine_limits

# The routes whose request bodies the middleware reads (the ones vLLM serves generation on; a SageMaker /invocations
# body is one of the first five's), by where each body carries a request's own arguments, the depth among them:
# `vllm_xargs`, the token-in/token-out route's `sampling_params.extra_args`, none for Cohere's chat (whose body vLLM
# reads into a model without them: its requests run at the default depth).
DEPTH_FIELDS = {
    "/v1/completions": "vllm_xargs",
    "/v1/chat/completions": "vllm_xargs",
    "/v1/chat/completions/batch": "vllm_xargs",
    "/v1/responses": "vllm_xargs",
    "/v1/messages": "vllm_xargs",
    "/invocations": "vllm_xargs",
    "/inference/v1/generate": "sampling_params.extra_args",
    "/cohere/v2/chat": None,
}
GENERATION_PATHS = set(DEPTH_FIELDS)
MAX_SALT, SALT_FORBIDS = 128, "@/\\\x00"  # vLLM's rules for a request's cache_salt (`validate_cache_salt`)
# Where a request names its reasoning effort: chat (and chat batch), the Responses API, Anthropic's messages.
EFFORT_FIELDS = ("reasoning_effort", "reasoning.effort", "output_config.effort")


class RefusedDepth(ValueError):
    """A request's depth (or what names it) refused before it reaches the engine: a 400 naming `parameter`."""

    def __init__(self, message: str, parameter: str):
        super().__init__(message)
        self.parameter = parameter


def with_depth(request: dict, limits: Limits, path: str = "/v1/completions", effort_map: dict | None = None) -> dict:
    """A request body of generation route `path` with its resolved depth in its arguments' `num_steps`
    (`DEPTH_FIELDS`): the depth it names there, else its reasoning effort (`EFFORT_FIELDS`) through `depth_for_effort`,
    else the default. The effort is the one the chat template sees: the server's `--reasoning-effort-map`
    (`effort_map`) rewrites it first, as vLLM does. A RefusedDepth for a depth out of range or on a route that carries
    none, an effort not in the table, or beam search at another depth than the default (vLLM's beam search passes no
    per-request arguments to the model)."""
    field = DEPTH_FIELDS[path]
    if field is None:
        return _at_default_depth(request, limits, path)
    xargs, parent = _field(request, field) or {}, field.rpartition(".")[0]
    if not isinstance(xargs, dict) or parent and not isinstance(_field(request, parent), dict):
        return request  # vLLM's own validation refuses it
    effort_field, effort = next(
        (
            (name, value)
            for name, value in ((name, _field(request, name)) for name in EFFORT_FIELDS)
            if value is not None
        ),
        (None, None),
    )
    if xargs.get(NUM_STEPS) is not None:
        depth = xargs[NUM_STEPS]
        problem = depth_problem(depth, limits.maximum, limits.only)
        if problem:
            raise RefusedDepth(problem, NUM_STEPS)
    elif effort is not None:
        seen = (effort_map or {}).get(effort, effort)
        if seen not in limits.effort:
            mapped = f" (which --reasoning-effort-map makes {seen!r})" if seen != effort else ""
            raise RefusedDepth(
                f"{effort_field} must be one of {sorted(limits.effort)} (depth_for_effort), got {effort!r}{mapped}.",
                effort_field,
            )
        depth = limits.effort[seen]
        if limits.only is not None and depth != limits.only:
            raise RefusedDepth(
                f"{effort_field} {effort!r} means depth {depth} (depth_for_effort), but this server runs every "
                f"request at depth {limits.only}: {depth_problem(depth, limits.maximum, limits.only)}",
                effort_field,
            )
    else:
        depth = limits.default
    if request.get("use_beam_search") and depth != limits.default:
        raise RefusedDepth(
            f"use_beam_search runs every request at this server's default depth ({limits.default}): vLLM's beam "
            f"search passes no per-request arguments to the model, so depth {depth} would not run; drop "
            "use_beam_search or the depth.",
            "use_beam_search",
        )
    return _with_field(request, field, {**xargs, NUM_STEPS: depth})


def with_salt(request: dict, limits: Limits, path: str) -> dict:
    """A body `with_depth` resolved, with the cache salt recurfit's scheduler would give it (`Limits.salt`, after the
    client's own): vLLM then hashes its prompt's blocks with it in its input thread, and the scheduler keeps them
    instead of hashing again on the engine's thread (`scheduler.salt_by_depth`). Left as it is where the route takes
    no salt or the salt would break vLLM's rules for one (at most 128 characters, none of '@/\\' or NUL)."""
    field, client = DEPTH_FIELDS[path], request.get("cache_salt")
    depth = depth_of(request, limits, path)
    if field is None or depth is None or not (client is None or isinstance(client, str) and client):
        return request
    salt = limits.salt(depth, client, _field(request, field))
    if len(salt) > MAX_SALT or set(salt) & set(SALT_FORBIDS):
        return request
    return {**request, "cache_salt": salt}


def _at_default_depth(request: dict, limits: Limits, path: str) -> dict:
    """A body of a route that carries no request arguments, as it is: a RefusedDepth if it names another depth than
    the default, which vLLM would drop."""
    named = _field(request, f"vllm_xargs.{NUM_STEPS}")
    if named is not None and named != limits.default:
        raise RefusedDepth(
            f"{path} takes no vllm_xargs, so its requests run at this server's default depth ({limits.default}), "
            f"not num_steps {named!r}: drop num_steps, or send the request to /v1/chat/completions.",
            NUM_STEPS,
        )
    return request


def depth_of(request: dict, limits: Limits, path: str) -> int | None:
    """The depth of a body `with_depth` resolved (None for one it left to vLLM to refuse)."""
    field = DEPTH_FIELDS[path]
    return limits.default if field is None else _field(request, f"{field}.{NUM_STEPS}")


def _with_field(request: dict, dotted: str, value) -> dict:
    """`request` with `value` at a dotted path (a copy of each object on the way)."""
    head, _, rest = dotted.partition(".")
    return {**request, head: _with_field(request.get(head) or {}, rest, value) if rest else value}


def _field(request: dict, dotted: str):
    """`request`'s value at a dotted path (None where any part is missing or not an object)."""
    value = request
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def served_limits(scope) -> Limits:
    """The limits of the engine behind the ASGI app of `scope` (vLLM keeps its config in the app's state); a
    RuntimeError naming recurfit when that engine serves no recurfit folder."""
    state = getattr(scope.get("app"), "state", None)
    vllm_config = getattr(state, "vllm_config", None)
    architectures = getattr(getattr(vllm_config, "model_config", None), "architectures", None) or []
    if ARCHITECTURE not in architectures:
        raise RuntimeError(
            "recurfit.serving.middleware.EffortToDepth: this server's engine serves no recurfit folder "
            f"(architectures {architectures}), so no depth can be given to its requests: serve a recurfit folder, "
            "or start the server without this middleware."
        )
    return engine_limits(vllm_config)


def effort_map(scope) -> dict | None:
    """The server's `--reasoning-effort-map` (vLLM 0.33 and later; in the app's state), which rewrites a request's
    reasoning effort before its chat template sees it."""
    return getattr(getattr(getattr(scope.get("app"), "state", None), "args", None), "reasoning_effort_map", None)


DEPTH_HEADER = "x-recurfit-depth"  # each answer's header: the depth its request ran at


@functools.cache
def requests_by_depth():
    """The server's count of requests per depth, on vLLM's own `/metrics` (its Prometheus registry) as
    `recurfit:requests_total{depth="d"}`."""
    from prometheus_client import Counter

    return Counter("recurfit:requests", "Generation requests by the depth they run at", ["depth"])


class EffortToDepth:
    """ASGI middleware (`vllm serve --middleware recurfit.serving.middleware.EffortToDepth`): every request on a
    generation route (`GENERATION_PATHS`) gets its depth resolved and checked (`with_depth`); a refused one is a
    400 naming the field. The answer says the depth it ran at (its
    `x-recurfit-depth` header), and `/metrics` counts the requests per depth. Its engine is the server's own (its
    app state), so each server, and each API server process, reads its own limits."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        try:
            limits = served_limits(scope)
        except RuntimeError as problem:
            return await _error(send, 500, str(problem), None)
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
        if isinstance(request, dict):
            path = scope["path"]
            try:
                request = with_salt(with_depth(request, limits, path, effort_map(scope)), limits, path)
            except RefusedDepth as refused:
                return await _error(send, 400, str(refused), refused.parameter)
            body = json.dumps(request).encode()
            scope = dict(scope, headers=_with_length(scope["headers"], len(body)))
            depth = depth_of(request, limits, path)
            send = send if depth is None else _reporting(send, depth)
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


def _reporting(send, depth: int):
    """`send` that adds the depth to the answer's headers, and counts the request once its answer starts."""

    async def send_with_depth(message):
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", []), (DEPTH_HEADER.encode(), str(depth).encode())]
            message = {**message, "headers": headers}
            requests_by_depth().labels(depth=str(depth)).inc()
        await send(message)

    return send_with_depth


def _with_length(headers, length: int):
    return [(k, v) for k, v in headers if k.lower() != b"content-length"] + [(b"content-length", str(length).encode())]


async def _error(send, status: int, message: str, parameter: str | None) -> None:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    body = json.dumps({"error": {"message": message, "type": kind, "param": parameter, "code": status}})
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body.encode()})
