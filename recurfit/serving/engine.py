"""vLLM's config hook for recurfit's architecture: the engine settings a recurfit folder needs, checked or set when
an engine's config is built (in every process that builds one), before any request is admitted.

- CUDA graphs of the compiled pieces only (PIECEWISE), never of whole forwards: how many core steps run is chosen
  on the host at every forward;
- recurfit's scheduler, which keeps prefix-cache blocks apart by depth (recurfit.serving.scheduler);
- the logits processor that checks each request's depth, and under the V1 runner carries it to the model
  (recurfit.serving.depth), except in an engine of one depth (speculation on the V1 runner);
- with speculative decoding, no adaptive verification where requests have depths of their own.
"""

from __future__ import annotations

import os

from vllm.config import CUDAGraphMode
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from .depth import Limits, is_ours, one_depth_engine, processor_for, runs_model_runner_v2

SCHEDULER = "recurfit.serving.scheduler.depth_salted_scheduler"  # vLLM's scheduler_cls on a recurfit engine


class RecurfitEngineConfig(VerifyAndUpdateConfig):
    """vLLM's config hook for architecture RecurrentForCausalLM (registered by recurfit.serving.register)."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        model_config = vllm_config.model_config
        config = model_config.hf_config
        overrides = model_config.hf_overrides if isinstance(model_config.hf_overrides, dict) else {}
        if "depth_for_effort" not in overrides and {"mean_recurrence", "max_recurrence"} & overrides.keys():
            config.depth_for_effort = None  # the folder's table is for its own depths: the defaults of these
        limits = Limits.of(config)
        _latest_keys_one_token_at_a_time(vllm_config, limits)
        _no_micro_batches(vllm_config.parallel_config)
        _piecewise_cuda_graphs(vllm_config.compilation_config)
        _no_breakable_cuda_graphs()
        _no_adaptive_verification(vllm_config)
        _depth_salted_scheduler(vllm_config.scheduler_config)
        others = [p for p in model_config.logits_processors or [] if not is_ours(p)]
        if one_depth_engine(vllm_config):  # the V1 runner refuses any logits processor beside speculation
            model_config.logits_processors = others
            return
        model_config.logits_processors = [*others, processor_for(limits, runs_model_runner_v2(vllm_config))]


def _latest_keys_one_token_at_a_time(vllm_config, limits: Limits) -> None:
    """Under cache_policy 'latest' a token attends to the earlier tokens' last-step keys, which only holds where
    generated tokens run one per forward, as recurfit's `generate` runs them: several tokens of one request in one
    forward read each other's same-step keys instead (a prompt split into chunks, one read from the prefix cache, a
    token verified with its drafts). A recompute after preemption is the same; the scheduler refuses a KV cache
    small enough for vLLM to preempt (`scheduler.check_no_preemption`)."""
    if limits.policy != "latest":
        return
    # A draft's tokens only propose: how it reads its keys changes which drafts are accepted, not the tokens.
    verifies = vllm_config.speculative_config is not None and vllm_config.model_config.runner_type != "draft"
    settings = (
        ("enable_prefix_caching", "--no-enable-prefix-caching", vllm_config.cache_config.enable_prefix_caching),
        ("enable_chunked_prefill", "--no-enable-chunked-prefill", vllm_config.scheduler_config.enable_chunked_prefill),
        ("speculative decoding", "no --speculative-config", verifies),
    )
    on = [(name, flag) for name, flag, value in settings if value]
    if on:
        raise ValueError(
            "recurfit on vLLM: cache_policy 'latest' keeps one key per token, its last step's, so a prompt split into "
            "chunks, read from the prefix cache or verified with drafts would see other steps' keys than generate "
            f"does: turn off {' and '.join(name for name, _ in on)} ({', '.join(flag for _, flag in on)}), or serve "
            "cache_policy 'all'."
        )


def _no_micro_batches(parallel) -> None:
    """vLLM's dual-batch overlap and micro-batching split a forward's tokens between threads, which recurfit's step
    loop and depth table (one per forward) do not follow: refused."""
    if parallel.use_ubatching:
        raise ValueError(
            "recurfit on vLLM: dual-batch overlap / micro-batching (enable_dbo, ubatch_size) splits a forward between "
            "threads, but recurfit's depths and step state are per forward: drop --enable-dbo and --ubatch-size."
        )


def _piecewise_cuda_graphs(compilation) -> None:
    """CUDA graphs of the compiled pieces only (vLLM's PIECEWISE, split at every attention, the core's included:
    `pieces.split_at_stepped_attention`), not of whole forwards (its FULL modes, the default when none is named):
    how many core steps run, and on which tokens, is chosen on the host at every forward (`recurfit.serving.steps`),
    which a graph of the whole forward would replay as captured. A FULL mode named by the user is refused rather
    than changed."""
    mode = compilation.cudagraph_mode
    if mode is None:
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    elif mode.has_full_cudagraphs():
        raise ValueError(
            f"recurfit on vLLM: cudagraph_mode {mode.name} captures whole forwards, but each batch's depth is chosen "
            "on the host at every forward: use PIECEWISE (-cc.cudagraph_mode=PIECEWISE) or NONE."
        )


def _depth_salted_scheduler(scheduler) -> None:
    """The engine's scheduler salts each request's prefix cache by its depth (recurfit.serving.scheduler). Another
    scheduler named by the user would share blocks across depths: refused."""
    if scheduler.scheduler_cls not in (None, SCHEDULER):
        raise ValueError(
            f"recurfit on vLLM: scheduler_cls {scheduler.scheduler_cls!r} would replace recurfit's scheduler, which "
            "keeps prefix-cache blocks apart by depth (a block written at one depth holds other keys than another "
            "depth reads): unset --scheduler-cls."
        )
    scheduler.scheduler_cls = SCHEDULER


def _no_adaptive_verification(vllm_config) -> None:
    """vLLM's adaptive verification (Model Runner V2) hands a batch's draft tokens to its requests on the device
    only: the host's token offsets, from which each token's depth is worked out (`RecurfitModelState`), would no
    longer match the batch, and tokens would run at another request's depth. Refused where requests have depths of
    their own."""
    speculative = vllm_config.speculative_config
    if speculative is not None and speculative.enable_adaptive_verification and not one_depth_engine(vllm_config):
        raise ValueError(
            "recurfit on vLLM: enable_adaptive_verification reassigns draft tokens to requests on the device, where "
            "each token's depth is not known: drop it from --speculative-config."
        )


BREAKABLE_CUDA_GRAPHS = "VLLM_USE_BREAKABLE_CUDAGRAPH"


def _no_breakable_cuda_graphs() -> None:
    """vLLM's breakable CUDA graphs capture a whole forward, breaking only at the ops marked for it; the number of
    core steps, chosen on the host at each forward, would replay as captured (every request at the capture's
    depth). Refused when asked for; where vLLM would turn them on by itself (VLLM_BATCH_INVARIANT=1 in bf16 with
    tuned shapes, or an architecture it lists), opted out of through its own switch, set to 0 before it looks."""
    value = os.environ.get(BREAKABLE_CUDA_GRAPHS)
    if value is None:
        os.environ[BREAKABLE_CUDA_GRAPHS] = "0"
    elif value == "1":
        raise ValueError(
            f"recurfit on vLLM: {BREAKABLE_CUDA_GRAPHS}=1 captures whole forwards, but each batch's depth is chosen "
            f"on the host at every forward: unset it or set {BREAKABLE_CUDA_GRAPHS}=0 (recurfit uses piecewise "
            "CUDA graphs)."
        )
