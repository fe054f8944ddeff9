"""Prefix caching kept apart by depth inside the engine, whatever route a request came by.

A block of vLLM's prefix cache written by a request at depth d holds the coda's keys and values of depth d and,
under the `all` cache policy, the core's step caches 1..d only: a request at another depth that read it would get
wrong tokens, without an error. vLLM shares a block between requests whose block hashes match, and a request's
first block hash covers its `cache_salt`. So the engine's scheduler (vLLM's `scheduler_cls`, which recurfit's config
hook sets) gives every request, before vLLM looks up its blocks, the salt of its depth, `max_recurrence` and cache
policy (`Limits.salt`, after the client's own salt): offline prompts and every server route alike, with or
without recurfit's middleware. The depth is the one the worker runs the request at (`Limits.served_depth`).

An engine that runs every request at one depth (speculation on the V1 runner: `depth.one_depth_engine`) has no
logits processor to refuse a request naming another depth at the frontend, so its scheduler refuses it: the
request never runs, its client gets vLLM's error (a 500 on the server; the reason is in the engine's log, and the
middleware refuses it with a 400 before it gets here).
"""

from __future__ import annotations

import logging

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus

from .depth import Limits, engine_limits
from .exit import ServedExit

logger = logging.getLogger(f"vllm.{__name__}")


def depth_salted_scheduler(*args, vllm_config, **kwargs):
    """vLLM's scheduler for this engine (`engine.SCHEDULER`), salting each request by its depth: its asynchronous one
    when the engine schedules asynchronously, which vLLM decides after recurfit's config hook has run."""
    salted = DepthSaltedAsyncScheduler if vllm_config.scheduler_config.async_scheduling else DepthSaltedScheduler
    return salted(*args, vllm_config=vllm_config, **kwargs)


class DepthSalt:
    """A vLLM scheduler whose requests get their depth's cache salt when they are added."""

    def __init__(self, *args, vllm_config, **kwargs):
        super().__init__(*args, vllm_config=vllm_config, **kwargs)
        self.depth_limits = engine_limits(vllm_config)
        self.refused: list = []  # requests refused for their depth, answered with an error at the next step
        if self.depth_limits.policy == "latest":
            check_no_preemption(vllm_config, self.kv_cache_config)

    def add_request(self, request) -> None:
        params = request.sampling_params
        extra_args = params.extra_args if params is not None else None
        try:
            if self.depth_limits.only is not None:
                self.depth_limits.depth(extra_args)
                no_exit_beside_speculation(self.depth_limits, extra_args)
            self._same_depth_as_its_session(request, extra_args)
        except ValueError as problem:
            logger.error("recurfit on vLLM: request %s refused: %s", request.request_id, problem)
            self.refused.append(request)
            return
        salt_by_depth(request, self.depth_limits)
        super().add_request(request)

    def _same_depth_as_its_session(self, request, extra_args) -> None:
        """A ValueError when `request` is the next chunk of a streaming-input session (vLLM's resumable requests,
        one id) at another depth than its session: the session's caches and block hashes are its first depth's.
        The session ends with the refusal (its client is answered with an error)."""
        session = self.requests.get(request.request_id)
        if session is None or not request.resumable:
            return
        limits, before = self.depth_limits, session.sampling_params
        was, asked = limits.served_depth(before.extra_args if before else None), limits.served_depth(extra_args)
        if asked != was:
            self.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
            raise ValueError(
                f"num_steps {asked} in the next chunk of a streaming-input session begun at num_steps {was}: a "
                f"session's caches are written at one depth; send num_steps {was}, or start a new session."
            )

    def has_requests(self) -> bool:
        return bool(self.refused) or super().has_requests()

    def update_from_output(self, scheduler_output, model_runner_output) -> dict[int, EngineCoreOutputs]:
        """vLLM's outputs of the step, and an error for each request refused since the last one."""
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in self.refused:
            answer = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR)
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(answer)
        self.refused = []
        return outputs


class DepthSaltedScheduler(DepthSalt, Scheduler):
    pass


class DepthSaltedAsyncScheduler(DepthSalt, AsyncScheduler):
    pass


def check_no_preemption(vllm_config, kv_cache_config) -> None:
    """Under cache_policy 'latest' a request vLLM preempts is recomputed as one prefill, its generated tokens then
    reading each other's same-step keys, not the latest ones `generate` reads: its tokens would depend on the
    server's load. vLLM preempts only when the KV cache cannot take the running requests' next tokens, so an engine
    whose cache holds max_num_seqs requests of max_model_len tokens never does; a smaller one is refused at start."""
    length, seqs = vllm_config.model_config.max_model_len, vllm_config.scheduler_config.max_num_seqs
    groups = max(len(kv_cache_config.kv_cache_groups), 1)
    # Each request holds blocks of every KV-cache group; one more for a token scheduled past a full block, and the
    # pool keeps one block apart (its null block).
    per_request = groups * (cdiv(length, vllm_config.cache_config.block_size) + 1)
    fit = (kv_cache_config.num_blocks - 1) // per_request
    if fit < seqs:
        raise ValueError(
            f"recurfit on vLLM: cache_policy 'latest' with a KV cache of {kv_cache_config.num_blocks} blocks, which "
            f"holds {fit} requests of max_model_len {length}, not max_num_seqs {seqs}: vLLM would preempt and "
            f"recompute requests, whose tokens then differ from generate's: set --max-num-seqs {max(fit, 1)} (or "
            "a smaller --max-model-len, or more KV cache memory), or serve cache_policy 'all'."
        )


def no_exit_beside_speculation(limits: Limits, extra_args: dict | None) -> None:
    """A ValueError for an exit rule in an engine of one depth (speculation on the V1 runner), which has no logits
    processor to carry it to the model."""
    if ServedExit().rule(extra_args) is not None:
        raise ValueError(
            "exit (vllm_xargs / SamplingParams.extra_args) is not served beside speculative decoding on vLLM's V1 "
            "runner, which carries no per-request values to the model: drop exit, or serve without "
            "--speculative-config."
        )


def salt_by_depth(request, limits: Limits) -> None:
    """`request` (vLLM's engine-side Request) with its depth's salt, and its block hashes computed again with it, on
    the engine's thread (what it costs: benchmarks/salt_rehash.py). A salt whose last part (after its last ';') is
    already the depth's (the middleware sets it) is kept, with the hashes vLLM computed from it in its input thread:
    it is the salt this would make from its other parts, and no other depth's salt ends so."""
    extra_args = request.sampling_params.extra_args if request.sampling_params is not None else None
    depth = limits.served_depth(extra_args)
    if (request.cache_salt or "").rpartition(";")[2] == limits.salt(depth, None, extra_args):
        return
    request.cache_salt = limits.salt(depth, request.cache_salt, extra_args)
    request.block_hashes = []
    request.update_block_hashes()
