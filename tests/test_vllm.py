"""Serving through vLLM (recurfit.serving): greedy tokens from `vllm.LLM` on a saved recurfit folder equal
recurfit's own `generate`, at several recurrences, for a batch of prompts of different lengths.

Needs vLLM (`scripts/setup-vllm.sh`); skipped with the reason when it cannot be imported, except where
RECURFIT_REQUIRE_VLLM=1 (CI's run of this file in .venv-vllm), where that is an error. vLLM runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0), with a small fixed KV-cache budget so that it starts beside others.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import FAMILIES, VOCAB, char_tokenizer, run_cli, small_run, tiny_parent

import recurfit
from recurfit.evaluate.results import Sweep
from recurfit.generation import prompt_ids
from recurfit.model.cache import RecurrentCache
from recurfit.model.compat import cache_kwargs
from recurfit.model.loading import load_model, load_tokenizer, save_tokenizer
from recurfit.serving import UNTESTED_VLLM, check_vllm_version

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


try:
    import vllm
except Exception as error:  # not installed, or installed with wheels that fail to import (see setup-vllm.sh)
    if os.environ.get("RECURFIT_REQUIRE_VLLM") == "1":
        raise RuntimeError("RECURFIT_REQUIRE_VLLM=1, and vLLM cannot be imported: run scripts/setup-vllm.sh") from error
    pytest.skip(
        f"vLLM cannot be imported ({type(error).__name__}: {error}); install it with scripts/setup-vllm.sh",
        allow_module_level=True,
    )


from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.forward_context import BatchDescriptor, get_forward_context, override_forward_context  # noqa: E402

pytestmark = pytest.mark.cpu_only("vLLM runs here on its own device selection, not --device")


NEW_TOKENS = 64


PROMPT_LENGTHS = (3, 9, 17)


# vLLM's CPU attention takes head sizes of 32 and more: the tiny parents get 2 heads of 32 (1 KV head, GQA).
HEADS = dict(num_attention_heads=2, num_key_value_heads=1)


SERVED = list(FAMILIES)  # every family recurfit retrofits


# Rotary parameters that differ by layer kind, so that a sliding layer given the full layers' fails the tokens.
OLMO3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
}
# Real OLMo-3's full layers scale their rotary frequencies with YaRN (factor 8, attention factor 0.1 ln 8 + 1).
OLMO3_YARN_ROPE = dict(
    OLMO3_ROPE,
    full_attention={
        "rope_type": "yarn",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "attention_factor": 1.2079441541679836,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
)


def served_model(family: str, shape=(2, 2, 2), olmo3_rope: dict = OLMO3_ROPE, **kwargs):
    """A retrofit whose adapter reads the state, s_0 = 0, and weights spread enough for varied greedy text."""
    extra = dict(HEADS, head_dim=32) if family == "gemma" else HEADS
    if family in ("qwen2", "qwen3"):  # vLLM's Qwen layers take one attention kind for all layers
        extra = dict(extra, use_sliding_window=False)
    if family == "olmo3":  # OLMo-3 keeps rotary parameters per layer kind (rope_scaling applies to full layers)
        extra = dict(extra, rope_parameters=olmo3_rope)
    torch.manual_seed(0)
    model = recurfit.retrofit(
        tiny_parent(family, place=False, **extra), shape, adapter_init="random", state_init_std=0.0, **kwargs
    ).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:  # random tiny models otherwise repeat one token
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [[2, *torch.randint(4, VOCAB, (n - 1,), generator=generator).tolist()] for n in PROMPT_LENGTHS]


def recurfit_greedy(
    model, batch: list[list[int]], r: int, policy: str = "all", new_tokens: int = NEW_TOKENS
) -> list[list[int]]:
    """recurfit's batched `generate` (left padding) with a `policy` cache: the new tokens of each prompt."""
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        num_steps=r,
        eos_token_id=None,
        pad_token_id=0,
        **cache_kwargs(RecurrentCache(model.config, policy=policy)),
    )
    return out[:, width:].tolist()


def vllm_engine(folder, compiled: bool = False, engine_args: dict | None = None, **overrides):
    """`vllm.LLM` on `folder`: eager (`enforce_eager=True`), or in vLLM's default compiled mode."""
    settings = dict(max_model_len=128, kv_cache_memory_bytes=64 << 20, seed=0) | (engine_args or {})
    return vllm.LLM(str(folder), dtype="float32", enforce_eager=not compiled, hf_overrides=overrides, **settings)


PIECES = ("prelude", "core_step", "coda")


def compile_state(model) -> dict:
    """Where vLLM's compilation stands in a `RecurfitForCausalLM` (read in the engine's worker): whether each of its
    pieces compiles and has compiled, whether the family body's own compiled forward is used, what vLLM finds by
    walking the module tree (Model Runner V2's test for compiled code, which turns its CUDA graphs off without any;
    the compiled modules the engine's cleanup frees), and the splitting ops the pieces compiled with."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    from vllm.v1.worker.gpu.cudagraph_utils import has_compiled_submodule

    from recurfit.serving.vllm_model import start_line

    pieces = [model.model.pieces._modules[name] for name in PIECES]  # the modules, whatever a test wraps
    return dict(
        compiles=[not piece.do_not_compile for piece in pieces],
        compiled=[bool(getattr(piece, "compiled", False)) for piece in pieces],
        body_compiles=not model.model.body.do_not_compile,
        found_by_v2=has_compiled_submodule(model),
        found_by_cleanup={id(m) for m in model.modules() if isinstance(m, TorchCompileWithNoGuardsWrapper)}
        >= {id(piece) for piece in pieces},
        state_dict_names=sorted(model.state_dict()),
        parameter_names=sorted(name for name, _ in model.named_parameters()),
        splitting_ops=list(model.vllm_config.compilation_config.splitting_ops),
        start_line=start_line(model.vllm_config, model.limits, model.model),
    )


def assert_compiled(llm, compiled: bool) -> None:
    """In compiled mode the three pieces compiled (when the engine started), in eager mode none; the family body's
    own compiled forward never. vLLM finds the pieces where it looks for compiled code, and they add no names to
    the state dict (they hold the recurrence outside their module tree); the core's attention op is a split."""
    from recurfit.serving.attention import STEPPED_ATTENTION

    (state,) = llm.apply_model(compile_state)
    assert state["compiles"] == state["compiled"] == [compiled] * len(PIECES), state
    assert not state["body_compiles"]
    assert state["found_by_v2"] == compiled and state["found_by_cleanup"]
    assert not [name for name in state["state_dict_names"] if "pieces" in name]
    assert state["parameter_names"] and not [name for name in state["parameter_names"] if "pieces" in name]
    assert STEPPED_ATTENTION in state["splitting_ops"]
    pieces = "compiled (DYNAMO_TRACE_ONCE)" if compiled else "eager"  # the CPU platform's compilation mode
    assert f"; CUDA graphs NONE; pieces {pieces}; attention CPU_ATTN, narrowed" in state["start_line"], state


def vllm_greedy(
    folder, batch: list[list[int]], compiled: bool = False, engine_args: dict | None = None, **overrides
) -> list[list[int]]:
    """Greedy tokens from an engine on `folder`, after checking that in compiled mode every piece was compiled, and
    that the family body's own compiled forward is never used."""
    llm = vllm_engine(folder, compiled, engine_args, **overrides)
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert_compiled(llm, compiled)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        del llm
        gc.collect()


def saved(model, folder):
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_answers(served: dict, expected: dict) -> None:
    """lm-eval's per-document records of GSM8K (one per document and answer filter) agree on the text generated,
    the answer extracted and the score."""
    served, expected = served["gsm8k_cot_offline"], expected["gsm8k_cot_offline"]
    assert len(served) == len(expected) == 6  # 3 problems x 2 filters (flexible-extract, strict-match)
    for theirs, ours in zip(served, expected):
        assert (theirs["doc_id"], theirs["filter"]) == (ours["doc_id"], ours["filter"])
        for key in ("resps", "filtered_resps", "exact_match"):
            assert theirs[key] == ours[key], (ours["doc_id"], ours["filter"], key)


def test_greedy_tokens_equal_recurfit_at_r_1_4_8(tmp_path):
    model = served_model("llama", mean_recurrence=4)
    folder, batch = saved(model, tmp_path / "llama"), prompts()
    for r in (1, 4, 8):
        expected = recurfit_greedy(model, batch, r)
        assert len({t for row in expected for t in row}) > 20  # varied text, not one repeated token
        assert vllm_greedy(folder, batch, mean_recurrence=r) == expected, f"r = {r}"


@pytest.mark.parametrize("family, r", [("llama", 4), ("gemma", 3)])
def test_compiled_engine_gives_recurfits_tokens(tmp_path, family, r):
    """vLLM's default mode (no enforce_eager): the prelude, the core step and the coda are graphs that vLLM traces
    (fullgraph) and compiles (inductor on a CPU; vllm_greedy checks that each did). Gemma scales its embeddings,
    inside the prelude's graph."""
    model = served_model(family, mean_recurrence=2)
    folder, batch = saved(model, tmp_path / family), prompts()
    assert vllm_greedy(folder, batch, compiled=True, mean_recurrence=r, max_recurrence=r) == recurfit_greedy(
        model, batch, r
    )


def record_initial_states(model) -> None:
    """Keep every s_0 the compiled prelude returns (its first output) in `model.initial_states`."""
    prelude, model.initial_states = model.model.pieces.prelude, []

    def recorded(*args):
        state, part = prelude(*args)
        model.initial_states.append(state.detach().clone())
        return state, part

    model.model.pieces.__dict__["prelude"] = recorded


def initial_states(model) -> torch.Tensor:
    return torch.cat(model.initial_states)


def test_a_random_initial_state_compiles_and_reaches_the_tokens(tmp_path):
    """state_init_std σ > 0, as every trained model has, in vLLM's default compiled mode: the draw of s_0 compiles
    (no data-dependent branch); the states the compiled prelude draws while serving are TruncNormal(0, σ², ±3σ)
    (its std 0.9866 σ), and they reach the tokens (not s_0 = 0's)."""
    model = served_model("llama", mean_recurrence=4)
    model.config.state_init_std = 0.5
    folder, batch = saved(model, tmp_path / "llama"), prompts()
    llm = vllm_engine(folder, compiled=True, max_recurrence=4)
    try:
        llm.apply_model(record_initial_states)
        params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert_compiled(llm, True)
        (draw,) = llm.apply_model(initial_states)
    finally:
        del llm
        gc.collect()
    # Bounds of 5 standard errors of n draws (the mean's σ/√n, the std's about σ/√(2n)): a sound draw passes, one
    # of another scale (σ off by 3 % or more at n ≈ 14,000) does not, nor an untruncated one (n × 0.27 % ≈ 38 draws
    # expected past 3σ = 1.5), nor one truncated much nearer (none past 1.2, 2.4σ).
    n = draw.numel()
    assert n > 10_000, n
    assert draw.abs().max() <= 1.5 and draw.abs().max() > 1.2
    assert abs(draw.mean()) < 5 * 0.5 / n**0.5 and abs(draw.std() - 0.5 * 0.9866) < 5 * 0.5 / (2 * n) ** 0.5
    assert [list(o.outputs[0].token_ids) for o in outputs] != recurfit_greedy(model, batch, 4)


DEPTHS = (1, 2, 4, 8, 16)
MIXED_TOKENS = 32


def mixed_prompts() -> list[list[int]]:
    """Ten prompts of 3-56 tokens, the last five sharing a 36-token prefix (a full KV block of 32 and more)."""
    generator = torch.Generator().manual_seed(2)
    shared = [2, *torch.randint(4, VOCAB, (35,), generator=generator).tolist()]
    own = [[2, *torch.randint(4, VOCAB, (n - 1,), generator=generator).tolist()] for n in (3, 9, 17, 25, 33)]
    return own + [shared + torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in (1, 6, 11, 16, 20)]


def served_by_depth(llm, batch: list[list[int]], depths: list[int], cached: list | None = None) -> list[list[int]]:
    """One `generate` call: request i asks for depth depths[i] (SamplingParams.extra_args), its prompt as a user
    would give it (no cache salt: the engine keeps depths apart); `cached` gets each request's number of prompt
    tokens read from the prefix cache."""
    params = [
        vllm.SamplingParams(temperature=0.0, max_tokens=MIXED_TOKENS, ignore_eos=True, extra_args={"num_steps": r})
        for r in depths
    ]
    prompts = [{"prompt_token_ids": p} for p in batch]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if cached is not None:
        cached[:] = [o.num_cached_tokens for o in outputs]
    return [list(o.outputs[0].token_ids) for o in outputs]


def expected_by_depth(model, batch: list[list[int]], depths: list[int], policy: str = "all") -> list[list[int]]:
    """recurfit's `generate` at each row's own depth (rows of one depth as one batch), with a `policy` cache."""
    rows: list = [None] * len(batch)
    for r in sorted(set(depths)):
        chosen = [i for i, d in enumerate(depths) if d == r]
        generated = recurfit_greedy(model, [batch[i] for i in chosen], r, policy, new_tokens=MIXED_TOKENS)
        for i, tokens in zip(chosen, generated):
            rows[i] = tokens
    return rows


@pytest.mark.parametrize(
    "family, compiled",
    [("llama", False), ("llama", True), ("olmo3", False), ("olmo3", True)],
    ids=["llama-eager", "llama-compiled", "olmo3-eager", "olmo3-compiled"],
)
def test_a_mixed_depth_batch_gives_each_request_generates_tokens_at_its_depth(tmp_path, family, compiled):
    """Requests of depths 1-16 in one continuous batch, prompts split into chunks (chunked prefill, 32 tokens a
    step) and prefix caching on: each request gets recurfit's greedy tokens at its own depth. A second round
    serves the same prompts at other depths after the first round's blocks are cached: a cached prefix is reused
    only at the depth that wrote it (the same prompts at the same depths hit the cache and stay exact). OLMo-3's
    layers add the residual themselves (what a token past its depth keeps is the whole state) and some attend
    within a window."""
    model = served_model(family, mean_recurrence=4)
    folder, batch = saved(model, tmp_path / family), mixed_prompts()
    first = [DEPTHS[i % 5] for i in range(len(batch))]
    second = [DEPTHS[(i + 1) % 5] for i in range(len(batch))]
    args = dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32, block_size=32)
    llm = vllm_engine(folder, compiled, args, max_recurrence=16)
    try:
        cached: list[list[int]] = [[], [], []]
        rounds = [(d, served_by_depth(llm, batch, d, cached[i])) for i, d in enumerate((first, second))]
        for bad in (0, 17, 10**6, "deep", 4.0, True):
            with pytest.raises(
                VLLMValidationError, match=rf"^num_steps .* must be an integer in \[1, 16\] .*got {bad!r}"
            ):
                served_by_depth(llm, batch[:1], [bad])
        again = served_by_depth(llm, batch, first, cached[2])
    finally:
        del llm
        gc.collect()
    for depths, served in rounds:
        assert served == expected_by_depth(model, batch, depths), depths
    assert again == rounds[0][1]
    # Blocks of 32 tokens are reused at the depth that wrote them only: the second round's shared prefixes were
    # written at their new depths by other prompts in the first round, the prompt of 33 tokens's was not.
    assert cached == [[0] * 10, [0] * 5 + [32] * 5, [0] * 4 + [32] * 6], cached
    assert len({tuple(row) for row in rounds[0][1]}) == len(batch)


# Requests with and without an exit rule (vllm_xargs), cycled over the prompts. The thresholds are loose enough
# that the random tiny model's tokens stop at depths 2-16 (kl:5e-4, the default, never settles on it).
EXIT_XARGS = (
    {"num_steps": 16, "exit": "kl:0.5"},
    {"num_steps": 12, "exit": "state:0.6"},
    {"num_steps": 16, "exit": "argmax:1", "min_depth": 3},
    {"num_steps": 16},
    {"num_steps": 4},
    {},
    {"num_steps": 8, "exit": "kl:0.5", "min_depth": 3},
)


def exit_record(model) -> dict:
    """Each exit request's per-token exit depths since the last call, by prompt (then forgotten)."""
    from recurfit.serving.depth import table_for

    record = table_for(model.vllm_config).exits.record
    taken = dict(record)
    record.clear()
    return taken


def served_with_exit(
    llm, batch: list[list[int]], xargs: list[dict], cached: list, new_tokens: int = MIXED_TOKENS
) -> tuple[list, list]:
    """Greedy tokens of one `generate` call, request i with `xargs[i]`, and the exit depths of its generated tokens."""
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, extra_args=x) for x in xargs]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    cached[:] = [o.num_cached_tokens for o in outputs]
    (record,) = llm.apply_model(exit_record)
    return [list(o.outputs[0].token_ids) for o in outputs], [record.get(tuple(p)) for p in batch]


def expected_with_exit(
    model, batch: list[list[int]], xargs: list[dict], policy: str = "all", new_tokens: int = MIXED_TOKENS
) -> tuple[list, list]:
    """recurfit's `generate --exit` on each prompt alone (cap `num_steps`, the rule and min_depth of its request), with
    a `policy` cache: its tokens, and the depth of each token after the first (the prompt's, at the cap), or None for a
    request without exit."""
    from recurfit.generation.exit import ExitRule

    tokens, depths = [], []
    for prompt, x in zip(batch, xargs):
        rule = ExitRule.parse(x.get("exit"), min_steps=x.get("min_depth", 2))
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            do_sample=False,
            num_steps=x.get("num_steps", model.config.mean_recurrence),
            exit_rule=rule,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            **cache_kwargs(RecurrentCache(model.config, policy=policy)),
        )
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        depths.append(out["steps_per_token"][0, 1:].tolist() if rule is not None else None)
    return tokens, depths


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_requests_with_an_exit_rule_get_generates_tokens_and_exit_depths_in_mixed_batches(tmp_path, compiled):
    """Requests carrying exit rules (kl, state, argmax; caps 8-16; a min_depth) beside requests at a fixed depth, in
    one continuous batch with chunked prefill and prefix caching on: each request gets the tokens of recurfit's
    `generate --exit` with the same cap and rule, and each generated token stops at the step generate's does (a
    token that stopped early is read by later tokens at its last step, in every deeper step's cache). A second
    round rotates the rules over the prompts: prefix blocks are reused only by requests of the same rule and cap,
    and a third round repeats the first, its blocks read from the cache, with the same tokens. Rules the engine
    cannot parse are refused with the field and the fix. The compiled engine reads the rules' decisions every 2
    steps (`exit_check_every`), its stopped tokens frozen in the batch between reads: the same tokens and depths."""
    model = served_model("llama", mean_recurrence=4)
    folder, batch = saved(model, tmp_path / "llama"), mixed_prompts()
    first = [EXIT_XARGS[i % len(EXIT_XARGS)] for i in range(len(batch))]
    second = [EXIT_XARGS[(i + 1) % len(EXIT_XARGS)] for i in range(len(batch))]
    args = dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32, block_size=32)
    llm = vllm_engine(folder, compiled, args, max_recurrence=16, exit_check_every=2 if compiled else 1)
    try:
        cached: list[list[int]] = [[], [], []]
        rounds = [(x, served_with_exit(llm, batch, x, cached[i])) for i, x in enumerate((first, second))]
        bad = (
            ({"exit": "median:2"}, "exit", r"takes CRITERION\[:VALUE\] .*kl:5e-4"),
            ({"exit": "kl:often"}, "exit", "'often' is not a number"),
            ({"exit": 5e-4}, "exit", "must be a string such as 'kl:5e-4'"),
            ({"exit": "kl", "min_depth": 0}, "min_depth", "must be an integer >= 1, got 0"),
        )
        for xargs, field, message in bad:
            with pytest.raises(VLLMValidationError, match=rf"^{field} \(vllm_xargs .*{message}") as refused:
                served_with_exit(llm, batch[:1], [xargs], [])
            assert refused.value.parameter == field
            del refused  # its traceback holds the engine, which must go before the next test builds its own
        again = served_with_exit(llm, batch, first, cached[2])
    finally:
        del llm
        gc.collect()
    for xargs, served in rounds:
        expected = expected_with_exit(model, batch, xargs)
        assert served[0] == expected[0], xargs
        assert served[1] == [None if d is None else d[: MIXED_TOKENS - 1] for d in expected[1]], xargs
    assert again == rounds[0][1]
    stopped = [d for depths in rounds[0][1][1] if depths for d in depths]
    assert min(stopped) < 8 and len(set(stopped)) > 5, stopped  # the rules stop tokens early, at varied depths

    # A prompt's first block (32 tokens: prompts 4-9) is read from the cache only where a request of the same cap,
    # rule and min_depth wrote it (the default depth is 4; min_depth matters with a rule only).
    def salted(prompt, x):
        return tuple(prompt[:32]), x.get("num_steps", 4), x.get("exit"), x.get("exit") and x.get("min_depth", 2)

    written = {salted(p, x) for p, x in zip(batch, first) if len(p) > 32}
    hits = [32 * (len(p) > 32 and salted(p, x) in written) for p, x in zip(batch, second)]
    assert cached == [[0] * 10, hits, [0] * 4 + [32] * 6], cached
    assert hits == [0] * 4 + [32] * 5 + [0]  # the last: no rule at cap 16, where the first round wrote kl:0.5


def test_a_request_preempted_under_an_exit_rule_recomputes_its_generated_tokens_at_its_cap(tmp_path):
    """A KV cache too small for the batch: vLLM preempts requests and recomputes each as one prefill, its generated
    tokens with it. Those tokens run at the request's cap, as a prompt does (each request's tokens in a forward at one
    depth, which the narrowed attention metadata describes), not by its exit rule: every request completes, the
    ones without a rule with `generate`'s tokens at their depth, and each generated token that decoded alone got an
    exit depth, the ones fed back in a recompute none. Without that, recomputed tokens stopped by their rule inside
    a many-token request, the narrowed metadata no longer matched the tokens, and vLLM's CPU attention corrupted
    the heap: the process aborted."""
    model = served_model("llama", mean_recurrence=4)
    folder, batch = saved(model, tmp_path / "llama"), mixed_prompts()
    xargs = [EXIT_XARGS[i % len(EXIT_XARGS)] for i in range(len(batch))]
    # 224 tokens of KV cache at max_recurrence 16: room for two or three of the ten requests at a time.
    args = dict(enable_prefix_caching=False, kv_cache_memory_bytes=2 << 20, block_size=32, disable_log_stats=False)
    llm = vllm_engine(folder, False, args, max_recurrence=16)
    try:
        tokens, depths = served_with_exit(llm, batch, xargs, [])
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    finally:
        del llm
        gc.collect()
    assert preemptions > 0
    assert all(len(row) == MIXED_TOKENS for row in tokens)
    plain = [i for i, x in enumerate(xargs) if "exit" not in x]
    expected = expected_by_depth(model, [batch[i] for i in plain], [xargs[i].get("num_steps", 4) for i in plain])
    assert [tokens[i] for i in plain] == expected
    # A token decoded alone gets an exit depth; the latest token of a preempted request is first fed back inside
    # its recompute, at the cap, and gets none: one fewer per preemption.
    counts = [len(d) for x, d in zip(xargs, depths) if "exit" in x]
    assert all(MIXED_TOKENS - 1 - preemptions <= n <= MIXED_TOKENS - 1 for n in counts), counts
    assert min(counts) < MIXED_TOKENS - 1, counts


class RecordedPiece:
    """Stands in for one of a model's compiled pieces, recording each call: its tokens, the addresses of its
    tensor inputs after the prelude's, and whether CUDA graphs were on (`pieces.cuda_graphs_replay`)."""

    def __init__(self, piece, name: str, calls: list):
        self.piece, self.name, self.calls = piece, name, calls

    def __call__(self, *args):
        from recurfit.serving.pieces import cuda_graphs_replay

        states = args if self.name != "prelude" else ()
        tokens = args[1].shape[0] if self.name != "prelude" else args[1].shape[-1]
        self.calls.append((self.name, tokens, tuple(t.data_ptr() for t in states), cuda_graphs_replay()))
        return self.piece(*args)


def record_pieces(model) -> None:
    model.calls = []
    for name in PIECES:
        pieces = model.model.pieces  # in its __dict__, ahead of its registered modules (vLLM still finds those)
        pieces.__dict__[name] = RecordedPiece(getattr(pieces, name), name, model.calls)


def recorded_calls(model) -> list[tuple]:
    """The pieces' calls since the last call (then forgotten)."""
    calls, model.calls[:] = list(model.calls), []
    return calls


def test_a_compiled_engine_compiles_three_pieces_and_each_token_pays_its_own_depth(tmp_path):
    """Compiled, the engine compiles the prelude, one core step and the coda when it starts, whatever depths it
    serves (up to 8 here), and a batch pays each request's own depth: with requests of depths 8, 2 and 1, every
    forward runs the core step 8 times, on the tokens of all three requests, then of two, then of one, and each
    request gets recurfit's tokens at its depth. A request without a depth runs at r̄."""
    model = served_model("llama", mean_recurrence=2)
    folder, batch = saved(model, tmp_path / "llama"), prompts()
    llm = vllm_engine(folder, compiled=True, max_recurrence=8)
    try:
        assert_compiled(llm, True)
        llm.apply_model(record_pieces)
        served = {}
        for depths in ([1, 1, 1], [8, 2, 1]):
            served[tuple(depths)] = served_by_depth(llm, batch, depths), llm.apply_model(recorded_calls)[0]
        params = vllm.SamplingParams(temperature=0.0, max_tokens=MIXED_TOKENS, ignore_eos=True)  # no depth: r̄
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        default = [list(o.outputs[0].token_ids) for o in outputs]
        default_calls = llm.apply_model(recorded_calls)[0]
    finally:
        del llm
        gc.collect()
    for depths, (tokens, _) in served.items():
        assert tokens == expected_by_depth(model, batch, list(depths)), depths
    # The last forward decodes one token per request: its core steps' tokens
    steps = [tokens for name, tokens, _, _ in served[(8, 2, 1)][1] if name == "core_step"]
    assert steps[-8:] == [3, 2, 1, 1, 1, 1, 1, 1], steps[-8:]
    assert all(tokens == 3 for name, tokens, _, _ in served[(1, 1, 1)][1][-2:])
    assert [name for name, *_ in served[(1, 1, 1)][1][-3:]] == ["prelude", "core_step", "coda"]
    assert default == expected_by_depth(model, batch, [2, 2, 2])
    assert [tokens for name, tokens, _, _ in default_calls if name == "core_step"][-2:] == [3, 3]


def under_piecewise_cuda_graphs(model) -> None:
    """Run every forward under vLLM's PIECEWISE CUDA-graph mode (the GPU default recurfit chooses), as far as the
    model can tell on a CPU: its forward context says graphs run at the forward's token count, the engine's capture
    sizes are vLLM's defaults up to 32 (tests/piecewise_graphs.py), no graph is captured."""
    from piecewise_graphs import capture_sizes

    model.vllm_config.compilation_config.cudagraph_capture_sizes = capture_sizes(32)
    forward = model.forward

    def forward_under_graphs(*args, **kwargs):
        context = dataclasses.replace(
            get_forward_context(),
            cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
            batch_descriptor=BatchDescriptor(num_tokens=kwargs["positions"].shape[-1]),
        )
        with override_forward_context(context):
            return forward(*args, **kwargs)

    model.forward = forward_under_graphs


def buffer_addresses(model) -> dict[str, int]:
    """The addresses of the pieces' fixed buffers (`Pieces.buffers`), read in the worker."""
    return {name: buffer.data_ptr() for name, buffer in model.model.pieces.buffers.items()}


def test_under_cuda_graphs_each_piece_reads_fixed_addresses_and_partial_steps_replay_a_captured_size(tmp_path):
    """vLLM replays a piece's CUDA graph for a batch size reading the addresses it was captured with, and keeps its
    outputs in a pool later graphs reuse. So under graphs every call of the core step and the coda reads its inputs
    (positions, states) from the pieces' own buffers (their addresses read from the buffers themselves), the core
    step's too when it runs again on its own output over the whole batch (every request at one depth), and a step
    over some of the batch's tokens runs with graphs too, its tokens padded to the next capture size (1, 2, 4, 8, …
    here). Tokens stay recurfit's."""
    from piecewise_graphs import capture_sizes

    model = served_model("llama", mean_recurrence=2)
    folder, batch = saved(model, tmp_path / "llama"), prompts()
    llm = vllm_engine(folder, compiled=True, max_recurrence=4)
    try:
        llm.apply_model(under_piecewise_cuda_graphs)
        llm.apply_model(record_pieces)
        served, calls = {}, []
        for depths in ([4, 2, 1], [4, 4, 4]):
            served[tuple(depths)] = served_by_depth(llm, batch, depths)
            calls += llm.apply_model(recorded_calls)[0]
        (buffers,) = llm.apply_model(buffer_addresses)
    finally:
        del llm
        gc.collect()
    for depths, tokens in served.items():
        assert tokens == expected_by_depth(model, batch, list(depths)), depths
    reads = {
        "core_step": (buffers["positions"], buffers["state"], buffers["part"]),
        "coda": (buffers["coda_positions"], buffers["coda"]),
    }
    batch_tokens, whole_batch_steps, padded_steps = None, 0, 0
    for name, tokens, states, graphs in calls:
        if name == "prelude":
            batch_tokens = tokens
        else:
            assert states == reads[name], (name, tokens, states, reads[name])
        assert graphs, (name, tokens)
        if tokens != batch_tokens:
            # The CPU runner pads no batch: a step may pad past the batch's own count (29 prompt tokens, 26 of
            # them deeper than 1: 32), where vLLM's runner would have padded the batch to 32 too.
            assert name == "core_step" and tokens in capture_sizes(32), (name, tokens, batch_tokens)
            padded_steps += 1
        whole_batch_steps += name == "core_step" and tokens == batch_tokens
    assert whole_batch_steps > 4 * len([call for call in calls if call[0] == "coda"]) // 2, whole_batch_steps
    # Depths 4, 2, 1 while decoding 3 tokens: steps 2, 3 and 4 over 2, 1 and 1 token(s), each forward.
    assert padded_steps >= MIXED_TOKENS, padded_steps


def test_under_vllms_piecewise_cuda_graph_contract_each_request_gets_its_depths_tokens(tmp_path):
    """vLLM's piecewise CUDA graphs emulated on the CPU (tests/piecewise_graphs.py: each graph segment, captured per
    batch size, replays on the tensors of its capture into the outputs of its capture, split at the ops vLLM
    splits at on a GPU): requests at mixed depths (some steps over part of the batch), then all at one depth
    (every step over the whole batch, the core step's graph replayed on its own output), give recurfit's greedy
    tokens, with graphs captured and replayed. A segment handed a tensor allocated outside the graphs, or an
    attention left inside a segment, would replay what its capture read."""
    from piecewise_graphs import graph_counts, under_emulated_piecewise_graphs

    model = served_model("llama", mean_recurrence=2)
    folder, batch = saved(model, tmp_path / "llama"), prompts()
    llm = vllm_engine(folder, max_recurrence=4)
    try:
        llm.apply_model(under_emulated_piecewise_graphs)
        served = {tuple(depths): served_by_depth(llm, batch, depths) for depths in ([4, 2, 1], [4, 4, 4])}
        (counts,) = llm.apply_model(graph_counts)
    finally:
        del llm
        gc.collect()
    for depths, tokens in served.items():
        assert tokens == expected_by_depth(model, batch, list(depths)), depths
    assert counts["segments"] >= 3 * len(PIECES) and counts["captures"] > 0, counts
    assert counts["replays"] > 10 * counts["captures"], counts
    assert counts["ungraphed"] == dict.fromkeys(PIECES, 0) and counts["padded"] > 0, counts


def exit_waits(model) -> tuple[int, int]:
    """Since the engine started: the steps that asked an exit rule, and the host's waits on the device to read what
    they decided (`RequestExits.asked`, `.waits`)."""
    from recurfit.serving.depth import table_for

    exits = table_for(model.vllm_config).exits
    return exits.asked, exits.waits


@pytest.mark.parametrize(
    "attention, check_every", [("narrowed", 1), ("narrowed", 3), ("every-token", 3)], ids=lambda v: str(v)
)
def test_under_vllms_piecewise_cuda_graphs_every_step_of_mixed_depths_and_exits_replays_a_graph(
    tmp_path, attention, check_every
):
    """Requests at depths 4-16 with and without exit rules (kl, state, argmax) in one continuous batch (chunked
    prefill, batches of up to 32 tokens, vLLM's largest capture size here) under the CPU emulation of vLLM's
    piecewise CUDA graphs (tests/piecewise_graphs.py): no segment of any piece runs without graphs, the steps over
    part of the batch replaying the graphs of smaller capture sizes, padded; and each request gets the tokens and
    exit depths of recurfit's `generate --exit` at its cap and rule. Where the metadata narrows (CPU, FlashAttention,
    Triton) and where attention runs over every token (the other GPU backends). With the server's
    `exit_check_every` at 3, stopped tokens stay in the batch, frozen, until the host next reads the device: the
    same tokens and depths, with the host's reads of the rules' decisions down from one per step that asks them to
    one per 3 steps."""
    from piecewise_graphs import graph_counts, under_emulated_piecewise_graphs

    model = served_model("llama", mean_recurrence=4)
    folder, batch = saved(model, tmp_path / "llama"), mixed_prompts()[3:]  # 7 prompts of 25-56 tokens
    xargs, new_tokens = list(EXIT_XARGS), 12
    args = dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=32)
    llm = vllm_engine(folder, False, args, max_recurrence=16, exit_check_every=check_every)
    try:
        if attention == "every-token":
            llm.apply_model(attend_over_every_token)
        llm.apply_model(under_emulated_piecewise_graphs)
        served = served_with_exit(llm, batch, xargs, [], new_tokens)
        (counts,) = llm.apply_model(graph_counts)
        ((asked, waits),) = llm.apply_model(exit_waits)
    finally:
        del llm
        gc.collect()
    expected = expected_with_exit(model, batch, xargs, new_tokens=new_tokens)
    assert served[0] == expected[0]
    assert served[1] == [None if d is None else d[: new_tokens - 1] for d in expected[1]]
    assert counts["ungraphed"] == dict.fromkeys(PIECES, 0), counts
    assert counts["padded"] > 0 and counts["replays"] > 10 * counts["captures"], counts
    # A forward asks its rules at steps 1..n and reads them at the multiples of check_every among those: n // 3 of n.
    assert waits == asked if check_every == 1 else 0 < waits <= asked // 3, (asked, waits)


def attend_over_every_token(model) -> None:
    """The worker's model takes the attention path of the backends whose metadata recurfit does not narrow (vLLM's
    GPU backends): every step attends over the batch's tokens, the ones past their depth with the keys and values
    of their last step; `model.partial_attention` counts the attentions run so for part of the batch."""
    model.model.requests.narrowable = lambda layer_name: False
    model.partial_attention = 0
    P, R, _ = model.model.shape
    for i in range(R):
        stepped = model.model.body.layers[P + i].self_attn.attn
        attend = stepped.attend

        def counted(query, key, value, stepped=stepped, attend=attend):
            model.partial_attention += stepped.rows is not None
            return attend(query, key, value)

        stepped.attend = counted


def partial_attentions(model) -> int:
    return model.partial_attention


@pytest.mark.parametrize("policy", ["all", "latest"])
def test_attention_over_every_token_as_on_gpu_backends_gives_each_request_its_depths_tokens(tmp_path, policy):
    """On attention backends whose metadata is not narrowed (FlashAttention, FlashInfer, Triton), a step over part of
    the batch attends over every token, the others with the keys and values of their last step: requests of
    depths 1-16 in one continuous batch get recurfit's greedy tokens at their own depths, through that path; with
    chunked prefill and prefix caching on under `all`, and under `latest`, whose one cache per layer every step
    overwrites (what the others write there is what a later step of theirs reads)."""
    model = served_model("llama", mean_recurrence=4)
    folder, batch = saved(model, tmp_path / "llama"), mixed_prompts()
    depths = [DEPTHS[i % 5] for i in range(len(batch))]
    if policy == "all":
        args = dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32, block_size=32)
    else:  # a KV cache that holds every running request whole: `latest` refuses an engine that could preempt
        args = dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_seqs=16)
    llm = vllm_engine(folder, False, args, max_recurrence=16, cache_policy=policy)
    try:
        llm.apply_model(attend_over_every_token)
        served = served_by_depth(llm, batch, depths)
        (partial,) = llm.apply_model(partial_attentions)
    finally:
        del llm
        gc.collect()
    assert served == expected_by_depth(model, batch, depths, policy)
    assert partial > 100, partial


def batch_description(lengths, seq_lens, blocks, requests):
    """vLLM's description (CommonAttentionMetadata) of the chosen `requests` of a batch whose requests have query
    `lengths`, context `seq_lens` and block-table rows `blocks`; a token's cache slot is 100 + its place in the
    whole batch."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    query_start_loc = torch.tensor([0, *itertools.accumulate(lengths[i] for i in requests)], dtype=torch.int32)
    slots = [100 + t for i in requests for t in range(starts[i], starts[i] + lengths[i])]
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=torch.tensor([seq_lens[i] for i in requests], dtype=torch.int32),
        num_reqs=len(requests),
        num_actual_tokens=len(slots),
        max_query_len=max(lengths[i] for i in requests),
        max_seq_len=max(seq_lens[i] for i in requests),
        block_table_tensor=torch.tensor([blocks[i] for i in requests], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        causal=True,
    )


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN"])
def test_narrowed_metadata_is_what_the_backends_own_builder_gives_for_those_requests_alone(tmp_path, backend):
    """The contract that lets a step attend for the requests still recurring only, on each backend recurfit narrows
    (the CPU one, and the GPU ones FlashAttention and Triton, whose builders run on a CPU as far as building
    metadata goes): from a batch's metadata built by the backend's own builder, the description `RecurringRequests`
    makes of the requests deeper than the step, built by the same builder, equals in every field the metadata the
    builder gives for those requests alone. FlashInfer keeps no per-request offsets in its metadata and is not
    narrowed (its cost: docs/how-to/serving.md)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from recurfit.serving.attention import NARROWED_BACKENDS, narrowed_description

    backend_class = AttentionBackendEnum[backend].get_class()
    assert backend in NARROWED_BACKENDS and backend_class.get_name() == backend
    folder = saved(served_model("llama"), tmp_path / "llama")
    config = EngineArgs(str(folder), dtype="float32", max_model_len=64).create_engine_config()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    lengths, seq_lens = [3, 1, 5, 2, 4], [5, 9, 5, 20, 33]
    blocks = [[i, i + 10, i + 20] for i in range(5)]
    request_depths, step = [4, 1, 8, 2, 1], 1
    kept = [i for i, depth in enumerate(request_depths) if depth > step]
    depths = torch.tensor([d for d, n in zip(request_depths, lengths) for _ in range(n)])
    rows = (depths > step).nonzero().squeeze(1)
    with set_current_vllm_config(config):
        builder = backend_class.get_builder_cls()(spec, ["layer"], config, torch.device("cpu"))
        whole = builder.build(0, batch_description(lengths, seq_lens, blocks, range(5)))
        assert type(whole).__name__ == NARROWED_BACKENDS[backend]
        narrowed = builder.build(0, narrowed_description(whole, depths, step, rows))
        alone = builder.build(0, batch_description(lengths, seq_lens, blocks, kept))
    # Every field but the builder's scratch tensors (uninitialised workspaces, and the CPU backend's scheduler data,
    # which holds addresses), which it derives from the same description: counts, lengths, flags and the
    # per-request and per-token tensors.
    compared = 0
    for field in dataclasses.fields(alone):
        ours, theirs = getattr(narrowed, field.name), getattr(alone, field.name)
        if isinstance(theirs, torch.Tensor):
            if field.name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
                assert torch.equal(ours, theirs), (field.name, ours, theirs)
                compared += 1
        else:
            assert ours == theirs, (field.name, ours, theirs)
    assert compared == 4
    assert narrowed.num_actual_tokens == rows.numel() == 10


def count_attended_requests(model) -> None:
    """Record, per step, the numbers of requests each forward's core attention at that step ran for."""
    P, R, _ = model.model.shape
    model.attended = {}
    for layer in model.model.body.layers[P : P + R]:
        for step, attention in enumerate(layer.self_attn.attn.steps):
            forward = attention.impl.forward

            def counted(layer, query, key, value, kv_cache, metadata, *args, step=step, forward=forward, **kwargs):
                if metadata is not None:
                    model.attended.setdefault(step, set()).add(metadata.query_start_loc.numel() - 1)
                return forward(layer, query, key, value, kv_cache, metadata, *args, **kwargs)

            attention.impl.forward = counted


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_step_attends_for_the_requests_still_recurring_only(tmp_path, compiled):
    """The requests past their depth drop out of a step's attention too, not only out of its matrix products,
    eagerly and compiled: with requests of depths 8, 2 and 1 in every forward, step 1 attends for three, step 2
    for two and steps 3-8 for one, and each request still gets recurfit's tokens at its depth."""
    model = served_model("llama", mean_recurrence=2)
    folder, batch, depths = saved(model, tmp_path / "llama"), prompts(), [8, 2, 1]
    llm = vllm_engine(folder, compiled=compiled, max_recurrence=8)
    try:
        llm.apply_model(count_attended_requests)
        served = served_by_depth(llm, batch, depths)
        attended = llm.apply_model(lambda model: model.attended)[0]
    finally:
        del llm
        gc.collect()
    assert served == expected_by_depth(model, batch, depths)
    assert attended == {0: {3}, 1: {2}, **{step: {1} for step in range(2, 8)}}


@pytest.mark.parametrize("family", [f for f in SERVED if f != "llama"])
def test_greedy_tokens_equal_recurfit_for_each_family(tmp_path, family):
    """Prompts and outputs run past the sliding windows of Mistral and OLMo-3 (conftest's FAMILY_KWARGS)."""
    model = served_model(family, mean_recurrence=4)
    folder, batch = saved(model, tmp_path / family), prompts()
    assert vllm_greedy(folder, batch) == recurfit_greedy(model, batch, 4)


def test_olmo3s_yarn_rope_gives_recurfits_tokens(tmp_path):
    """OLMo-3's full layers with YaRN rotary scaling, its sliding layers with the default: vLLM's YaRN embedding,
    built from the same parameters, gives transformers' tokens (which YaRN changes)."""
    model = served_model("olmo3", mean_recurrence=4, olmo3_rope=OLMO3_YARN_ROPE)
    folder, batch = saved(model, tmp_path / "olmo3"), prompts()
    expected = recurfit_greedy(model, batch, 4)
    assert expected != recurfit_greedy(served_model("olmo3", mean_recurrence=4), batch, 4)
    assert vllm_greedy(folder, batch) == expected


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_latest_policy_equals_recurfits_latest_cache(tmp_path, compiled):
    """The `latest` cache, at the server's r and in a batch of depths 1-8: a token past its depth leaves its one
    cache entry as its last step wrote it. So does a token its exit rule stopped (requests with kl, state and argmax
    rules beside requests without; the compiled engine reads the rules' decisions every 3 steps, its stopped tokens
    frozen in the batch in between): the tokens and exit depths of `generate --exit` with a `latest` cache."""
    model = served_model("llama", mean_recurrence=4)
    folder, batch = saved(model, tmp_path / "llama"), prompts()
    expected = recurfit_greedy(model, batch, 4, policy="latest")
    assert expected != recurfit_greedy(model, batch, 4)  # the policies differ on this model
    # Each request's generated tokens one per forward, and a KV cache vLLM never preempts in (16 requests fit).
    one_forward = dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_seqs=16)
    check_every = 3 if compiled else 1
    llm = vllm_engine(
        folder, compiled, one_forward, cache_policy="latest", max_recurrence=8, exit_check_every=check_every
    )
    mixed, depths = mixed_prompts()[:8], [1, 2, 4, 8] * 2
    rules = [{**x, "num_steps": min(x.get("num_steps", 4), 8)} for x in EXIT_XARGS] + [{"num_steps": 2}]
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        served = served_by_depth(llm, mixed, depths)
        exited = served_with_exit(llm, mixed, rules, [])
    finally:
        del llm
        gc.collect()
    for r in (1, 2, 4, 8):
        chosen = [i for i, d in enumerate(depths) if d == r]
        rows = recurfit_greedy(model, [mixed[i] for i in chosen], r, policy="latest", new_tokens=MIXED_TOKENS)
        assert [served[i] for i in chosen] == rows, f"r = {r}"
    tokens, exit_depths = expected_with_exit(model, mixed, rules, policy="latest")
    assert exited[0] == tokens
    assert exited[1] == [None if d is None else d[: MIXED_TOKENS - 1] for d in exit_depths]
    assert min(d for stopped in exited[1] if stopped for d in stopped) < 8  # tokens stop before their cap


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("llama", {"adapter": "mlp"}, "adapter 'mlp' is not served"),
        ("llama", {"cache_policy": "every"}, "cache_policy must be one of"),
        (
            "llama",
            {"cache_policy": "latest"},
            r"recurfit on vLLM: cache_policy 'latest' .* turn off enable_prefix_caching and enable_chunked_prefill ",
        ),
        ("llama", {"max_recurrence": 1, "mean_recurrence": 2}, "max_recurrence must be an integer >= mean_rec"),
        (
            "llama",
            {"exit_check_every": 0},
            r"exit_check_every \(config.json or --hf-overrides\) must be an integer >= 1",
        ),
    ],
)
def test_unservable_settings_are_refused_in_one_line(tmp_path, family, overrides, message):
    folder = saved(served_model(family), tmp_path / family)
    with pytest.raises(ValueError, match=message):
        vllm_greedy(folder, prompts(), **overrides)


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("attention_bias", True, "text_config.attention_bias must be False for olmo2"),
        ("hidden_act", "gelu", "text_config.hidden_act must be 'silu' for olmo2"),
        ("head_dim", 16, "text_config.head_dim must be hidden_size / heads for olmo2"),
    ],
)
def test_olmo_settings_that_vllms_olmo_layers_fix_are_refused(setting, value, message):
    """OLMo-2/3 run on vLLM's OLMo Hybrid attention layers, which have no biases, a SiLU MLP and heads of
    hidden_size / heads: a parent that differs is refused, not served with other weights or arithmetic."""
    from recurfit.serving.families import check_servable

    config = served_model("olmo2").config
    setattr(config.text_config, setting, value)
    with pytest.raises(ValueError, match=message):
        check_servable(config)


def test_whole_forward_cuda_graphs_are_refused_and_piecewise_ones_chosen_when_none_is_named(tmp_path):
    """Each forward chooses its compiled depth on the host, which a CUDA graph of the whole forward (vLLM's FULL
    modes) would replay as captured: a FULL mode is refused in one line, PIECEWISE is chosen where none is named,
    and PIECEWISE or NONE stay as named."""
    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from recurfit.serving.engine import _piecewise_cuda_graphs

    folder = saved(served_model("llama"), tmp_path / "llama")
    for mode in ("FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"):
        args = EngineArgs(str(folder), dtype="float32", max_model_len=64, compilation_config={"cudagraph_mode": mode})
        with pytest.raises(ValueError, match=rf"recurfit on vLLM: cudagraph_mode {mode} captures whole forwards"):
            args.create_engine_config()
    for named, chosen in ((None, "PIECEWISE"), ("PIECEWISE", "PIECEWISE"), ("NONE", "NONE")):
        compilation = CompilationConfig(cudagraph_mode=named)
        _piecewise_cuda_graphs(compilation)
        assert compilation.cudagraph_mode == CUDAGraphMode[chosen], named


def test_the_core_attention_op_is_added_to_the_splitting_ops_vllm_chose():
    """vLLM's piecewise graphs split at the core's attention op too, after the ops vLLM chose itself (its attention
    ops and the KV-cache updates it keeps out of graphs), and at a list the user named; the op is not added twice.
    Left out, each core step would replay the attention of the step its graph was captured at."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    from recurfit.serving.attention import STEPPED_ATTENTION
    from recurfit.serving.pieces import split_at_stepped_attention

    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    compilation.set_splitting_ops_for_v1(all2all_backend="naive")  # what vLLM does when it builds the config
    vllms = list(compilation.splitting_ops)
    assert "vllm::unified_kv_cache_update" in vllms
    for _ in range(2):
        split_at_stepped_attention(compilation)
        assert compilation.splitting_ops == [*vllms, STEPPED_ATTENTION]
    named = CompilationConfig(splitting_ops=["vllm::unified_attention_with_output"])
    split_at_stepped_attention(named)
    assert named.splitting_ops == ["vllm::unified_attention_with_output", STEPPED_ATTENTION]


def test_the_core_attention_op_writes_into_an_output_the_compiled_region_allocated():
    """vLLM's piecewise CUDA graphs replay each segment reading the addresses of its capture, and the core's
    attention op runs between two segments: like vLLM's unified_attention_with_output it returns nothing and writes
    into an output it is given (allocated inside the compiled region, so at a fixed address); a tensor it returned
    would be new at each replay, and the next segment would read the one of its capture."""
    import recurfit.serving.attention  # noqa: F401  (registers the op)

    schema = torch.ops.recurfit.stepped_attention.default._schema
    assert not schema.returns
    (output,) = [argument for argument in schema.arguments if argument.name == "output"]
    assert output.alias_info is not None and output.alias_info.is_write


def test_breakable_cuda_graphs_are_refused_and_opted_out_of_before_vllm_turns_them_on(tmp_path, monkeypatch):
    """A breakable CUDA graph holds the whole forward, its core steps as captured: VLLM_USE_BREAKABLE_CUDAGRAPH=1
    is refused in one line naming it, and where it is unset it is set to 0 before vLLM would turn it on itself
    (VLLM_BATCH_INVARIANT=1 in bf16, or a listed architecture)."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    from vllm.engine.arg_utils import EngineArgs

    from recurfit.serving.engine import BREAKABLE_CUDA_GRAPHS

    folder = saved(served_model("llama"), tmp_path / "llama")
    args = EngineArgs(str(folder), dtype="float32", max_model_len=64)
    monkeypatch.setenv(BREAKABLE_CUDA_GRAPHS, "1")
    with pytest.raises(ValueError, match=rf"recurfit on vLLM: {BREAKABLE_CUDA_GRAPHS}=1 captures whole forwards"):
        args.create_engine_config()
    monkeypatch.delenv(BREAKABLE_CUDA_GRAPHS)
    args.create_engine_config()
    assert os.environ[BREAKABLE_CUDA_GRAPHS] == "0" and not is_breakable_cudagraph_enabled()


class EngineConfig(SimpleNamespace):
    """An engine's config (vLLM's object is one per engine, weakly referenced)."""


def v1_depth_table():
    """A V1 engine's config serving depth 2 (at most 8) to 4 requests, and its `RequestDepth` table."""
    from recurfit.serving.depth import RequestDepth

    served = SimpleNamespace(mean_recurrence=2, max_recurrence=8, depth_for_effort=None)
    engine = EngineConfig(
        model_config=SimpleNamespace(hf_config=served, runner_type="generate"),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=16),
        speculative_config=None,
        use_v2_model_runner=False,
    )
    return engine, RequestDepth(engine, torch.device("cpu"), False)


def test_token_depths_are_written_into_one_buffer_with_the_batchs_stops():
    """V1 runner: every forward's token depths are written into one buffer (the same address, warm-up runs
    included, allocated once), with the batch's distinct depths
    (its stops); a batch without requests (vLLM's profiling, warm-up and capture runs) has none; rows follow
    vLLM's moves; a forward without attention metadata while requests are live is an error, not a warm-up."""
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from recurfit.serving.depth import table_for

    engine, table = v1_depth_table()
    assert table_for(engine) is table
    warm, stops = table.token_depths(None, 5)
    assert stops is None
    asks = vllm.SamplingParams(extra_args={"num_steps": 4})
    table.update_state(BatchUpdate(2, [], [(0, asks, None, []), (1, vllm.SamplingParams(), None, [])], []))
    depths, stops = table.token_depths(torch.tensor([0, 3, 4]), 6)  # row 0: 3 tokens, row 1: 1, 2 of padding
    assert depths.tolist() == [4, 4, 4, 2, 1, 1] and stops == (2, 4) and depths.data_ptr() == warm.data_ptr()
    with pytest.raises(RuntimeError, match="has no attention metadata"):
        table.token_depths(None, 4)
    table.update_state(BatchUpdate(1, [0], [], [(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    depths, stops = table.token_depths(torch.tensor([0, 1]), 1)
    assert depths.tolist() == [2] and stops == (2,) and depths.data_ptr() == warm.data_ptr()
    table.update_state(BatchUpdate(0, [0], [], []))
    assert table.token_depths(torch.tensor([0, 1]), 1)[1] is None
    other = EngineConfig(**vars(engine))  # another engine in the same process: not this table's
    with pytest.raises(RuntimeError, match="runs without recurfit's depth logits processor"):
        table_for(other)


def test_a_decode_batch_finds_its_token_depths_without_waiting_on_the_device():
    """V1 runner: the attention metadata's token offsets are on the device (the V1 runner's metadata has no host
    copy), so reading them waits for the device; a batch whose longest query is one token (`max_query_len`, a host
    integer: every decode batch) needs none of them. Offsets on PyTorch's meta device, which cannot be read back,
    stand for offsets not yet computed: a decode batch gets its depths, a prefill batch reads (and fails here)."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    _, table = v1_depth_table()
    asks = vllm.SamplingParams(extra_args={"num_steps": 4})
    table.update_state(
        BatchUpdate(3, [], [(0, asks, None, []), (1, vllm.SamplingParams(), None, []), (2, asks, None, [])], [])
    )
    unreadable = torch.tensor([0, 1, 2, 3], device="meta")
    depths, stops = table.token_depths(unreadable, 4, max_query_len=1)
    assert depths.tolist() == [4, 2, 4, 1] and stops == (2, 4)
    with pytest.raises(NotImplementedError, match="meta"):
        table.token_depths(unreadable, 4, max_query_len=2)


def engine_config(folder, v2_runner: bool, engine_args: dict | None = None, **overrides):
    """The VllmConfig `vllm serve folder` builds (its config hook run; no engine started), under Model Runner V2
    or the V1 runner (VLLM_USE_V2_MODEL_RUNNER). vLLM refuses V2 configs where Triton is missing, as here (the CPU
    build's Triton has no CPU backend): the config check is told Triton is there, as it is on CUDA."""
    import vllm.config.vllm as config_module
    from vllm.engine.arg_utils import EngineArgs

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if v2_runner else "0")
        patch.setattr(config_module, "HAS_TRITON", True)
        settings = dict(dtype="float32", max_model_len=64, max_num_seqs=4, **(engine_args or {}))
        args = EngineArgs(str(folder), hf_overrides=overrides, **settings)
        return args.create_engine_config()


def test_on_a_vllm_without_the_v1_runner_the_plugin_takes_model_runner_v2s_routes(tmp_path, monkeypatch):
    """vLLM 0.34 removed the V1 runner, its logits-processor module (vllm.v1.sample.logits_processor) and
    `VllmConfig.use_v2_model_runner` with it. The CPU build's classes without them: the depth module loads, and the
    config hook of a V1 engine's config gives Model Runner V2's processor, which checks depths, and lets through a
    backend whose metadata the V1 runner could not read (FlashInfer's)."""
    import importlib.util

    from vllm.config import VllmConfig

    import recurfit.serving.depth as depth
    from recurfit.serving.attention import check_v1_backend
    from recurfit.serving.engine import RecurfitEngineConfig

    config = engine_config(saved(served_model("llama", mean_recurrence=2), tmp_path / "llama"), v2_runner=False)
    assert config.model_config.logits_processors == ["recurfit.serving.depth:RequestDepthUpTo4"]
    with pytest.raises(ValueError, match="FLASHINFER's"):
        check_v1_backend(config, True, "FLASHINFER")

    monkeypatch.setitem(sys.modules, "vllm.v1.sample.logits_processor", None)  # an import of it fails
    spec = importlib.util.spec_from_file_location("recurfit.serving.depth_without_v1", depth.__file__)
    without_v1 = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, without_v1)  # its dataclasses look their module up
    spec.loader.exec_module(without_v1)
    assert without_v1.LogitsProcessor is object and without_v1.DepthParamsUpTo4.maximum == 4
    with pytest.raises(VLLMValidationError, match=r"integer in \[1, 4\]"):
        without_v1.DepthParamsUpTo4.validate_params(vllm.SamplingParams(extra_args={"num_steps": 5}))

    monkeypatch.delattr(VllmConfig, "use_v2_model_runner")
    RecurfitEngineConfig.verify_and_update_config(config)
    assert config.model_config.logits_processors == ["recurfit.serving.depth:DepthParamsUpTo4"]
    assert not depth.one_depth_engine(config)
    check_v1_backend(config, True, "FLASHINFER")


def test_each_runners_frontend_validator_takes_the_plugin_and_checks_its_own_engines_depths(tmp_path):
    """The frontend builds its request validator from the engine's logits processors with the loader of the runner
    the engine uses; Model Runner V2's (the default on CUDA) takes classes of its own interface only. Each loads
    recurfit's, and two engines of different max_recurrence in one process each refuse depths past their own."""
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    folder = saved(served_model("llama", mean_recurrence=2), tmp_path / "llama")
    validators = {}
    for v2_runner in (True, False):
        for maximum in (4, 16):
            config = engine_config(folder, v2_runner, max_recurrence=maximum)
            processors = config.model_config.logits_processors
            name = "DepthParamsUpTo" if v2_runner else "RequestDepthUpTo"
            assert processors == [f"recurfit.serving.depth:{name}{maximum}"], processors
            if v2_runner:
                validators[v2_runner, maximum] = build_custom_logits_processors_params_validator(processors)
            else:
                validators[v2_runner, maximum] = lambda params, p=processors: validate_logits_processors_parameters(
                    p, params
                )
    for (_, maximum), validate in validators.items():
        for depth in (None, 1, maximum):
            validate(vllm.SamplingParams(extra_args=None if depth is None else {"num_steps": depth}))
        for bad in (0, maximum + 1, "deep", 2.0):
            with pytest.raises(VLLMValidationError, match=rf"num_steps .* integer in \[1, {maximum}\].* got {bad!r}"):
                validate(vllm.SamplingParams(extra_args={"num_steps": bad}))


def v2_batch(requests: list[tuple[str, int, int]], padded: int):
    """A Model Runner V2 `InputBatch` (vLLM's own, as its runner fills it) of `requests` (id, slot, tokens
    scheduled) in batch order, padded to `padded` tokens."""
    import dataclasses

    import numpy as np
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    lengths = np.array([n for _, _, n in requests], dtype=np.int32)
    dummy = InputBatch.make_dummy(len(requests), padded, InputBuffers(8, 64, torch.device("cpu")))
    return dataclasses.replace(
        dummy,
        req_ids=[r for r, _, _ in requests],
        idx_mapping_np=np.array([slot for _, slot, _ in requests], dtype=np.intp),
        num_scheduled_tokens=lengths,
        query_start_loc_np=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        num_tokens=int(lengths.sum()),
        num_tokens_after_padding=padded,
    )


def test_model_runner_v2s_model_state_gives_each_token_its_requests_depth(tmp_path):
    """Model Runner V2 asks the model for its state (`get_model_state_cls`), gives it each new request
    (`add_request`, vLLM's `NewRequestData`) and each batch (`prepare_inputs`, vLLM's `InputBatch`): each token
    gets its request's depth (padding tokens 1) in one buffer, for requests added, removed and reordered between
    batches, with the batch's distinct depths (its stops); the capture runs (`prepare_dummy_inputs`) and the
    runner's dummy batches get no stops (one step) and the same buffer; a batch mixing live requests with unknown
    ones is an error."""
    from vllm.v1.core.sched.output import NewRequestData

    from recurfit.serving.model_state import RecurfitModelState
    from recurfit.serving.vllm_model import RecurfitForCausalLM

    folder = saved(served_model("llama", mean_recurrence=2), tmp_path / "llama")
    config = engine_config(folder, v2_runner=True, max_recurrence=8)
    assert RecurfitForCausalLM.get_model_state_cls() is RecurfitModelState
    state = RecurfitModelState(config, torch.nn.Module(), None, torch.device("cpu"))

    def add(req_id: str, slot: int, depth: int | None):
        params = vllm.SamplingParams(extra_args=None if depth is None else {"num_steps": depth})
        data = NewRequestData(req_id, [2, 5, 7], [], params, None, ([],), 0, None, prefill_token_ids=[2, 5, 7])
        state.add_request(slot, data)

    def depths(requests, padded=None):
        batch = v2_batch(requests, padded or sum(n for _, _, n in requests))
        inputs = state.prepare_inputs(batch, None)
        return inputs["token_depths"].tolist(), inputs["depth_stops"], inputs["token_depths"].data_ptr()

    warm = state.prepare_dummy_inputs(2, 6)
    assert warm["depth_stops"] is None
    buffer = warm["token_depths"].data_ptr()
    add("a", 0, 4)
    add("b", 1, None)  # the default: r̄ = 2
    add("c", 2, 1)
    assert depths([("a", 0, 3), ("b", 1, 1), ("c", 2, 2)], padded=8) == ([4, 4, 4, 2, 1, 1, 1, 1], (1, 2, 4), buffer)
    assert depths([("c", 2, 1), ("a", 0, 1)]) == ([1, 4], (1, 4), buffer)  # reordered
    state.remove_request("a")
    add("d", 0, 8)  # a's slot, reused
    assert depths([("b", 1, 2), ("d", 0, 1), ("c", 2, 1)]) == ([2, 2, 8, 1], (1, 2, 8), buffer)
    assert depths([("warm-up-0", 0, 2), ("warm-up-1", 1, 2)])[1:] == (None, buffer)  # the runner's dummy run
    with pytest.raises(RuntimeError, match="never saw"):
        depths([("b", 1, 1), ("a", 0, 1)])  # a was removed


def test_every_request_gets_its_depth_or_a_400():
    """What EffortToDepth does to each request body: the depth it names, else its reasoning effort (chat's
    `reasoning_effort`, the Responses API's `reasoning.effort`, Anthropic's `output_config.effort`), else the
    default, in `vllm_xargs.num_steps`, the client's other fields kept (its cache salt too: the engine adds the
    depth's); refused (a 400 naming the field): a depth out of range, an effort not in the table, beam search at
    another depth than the default (vLLM's beam search drops per-request arguments)."""
    from recurfit.serving.depth import Limits
    from recurfit.serving.middleware import RefusedDepth, with_depth

    limits = Limits(default=4, maximum=16, effort={"low": 2, "high": 16}, policy="all")
    body = {"model": "m", "prompt": "hi"}
    assert with_depth(body, limits) == {**body, "vllm_xargs": {"num_steps": 4}}
    named = with_depth({**body, "vllm_xargs": {"num_steps": 8, "theirs": 1}, "cache_salt": "tenant"}, limits)
    assert named == {**body, "vllm_xargs": {"num_steps": 8, "theirs": 1}, "cache_salt": "tenant"}
    assert with_depth({**body, "reasoning_effort": "low"}, limits)["vllm_xargs"] == {"num_steps": 2}
    assert with_depth({**body, "reasoning": {"effort": "high"}}, limits)["vllm_xargs"] == {"num_steps": 16}
    assert with_depth({**body, "output_config": {"effort": "low"}}, limits)["vllm_xargs"] == {"num_steps": 2}
    assert with_depth({**body, "reasoning_effort": "low", "vllm_xargs": {"num_steps": 3}}, limits)["vllm_xargs"] == {
        "num_steps": 3
    }
    assert with_depth({**body, "use_beam_search": True}, limits)["vllm_xargs"] == {"num_steps": 4}
    refused = [
        ({"vllm_xargs": {"num_steps": 17}}, "num_steps", r"integer in \[1, 16\].* got 17"),
        ({"vllm_xargs": {"num_steps": "deep"}}, "num_steps", "got 'deep'"),
        ({"reasoning_effort": "max"}, "reasoning_effort", r"must be one of \['high', 'low'\]"),
        ({"reasoning": {"effort": "minimal"}}, "reasoning.effort", "got 'minimal'"),
        ({"output_config": {"effort": "max"}}, "output_config.effort", "got 'max'"),
        ({"use_beam_search": True, "vllm_xargs": {"num_steps": 8}}, "use_beam_search", "default depth \\(4\\)"),
        ({"use_beam_search": True, "reasoning_effort": "high"}, "use_beam_search", "depth 16 would not run"),
    ]
    for extra, parameter, message in refused:
        with pytest.raises(RefusedDepth, match=message) as error:
            with_depth({**body, **extra}, limits)
        assert error.value.parameter == parameter


def test_a_one_depth_server_refuses_every_other_depth_and_effort_with_a_400():
    """A server that runs every request at one depth (speculation on the V1 runner): the middleware refuses any other
    depth, named or through an effort, naming the field and why."""
    from recurfit.serving.depth import Limits
    from recurfit.serving.middleware import RefusedDepth, with_depth

    limits = Limits(default=4, maximum=16, effort={"low": 2, "medium": 4}, policy="all", only=4)
    body = {"model": "m", "prompt": "hi"}
    assert with_depth(body, limits)["vllm_xargs"] == {"num_steps": 4}
    assert with_depth({**body, "vllm_xargs": {"num_steps": 4}}, limits)["vllm_xargs"] == {"num_steps": 4}
    assert with_depth({**body, "reasoning_effort": "medium"}, limits)["vllm_xargs"] == {"num_steps": 4}
    for extra, parameter in (({"vllm_xargs": {"num_steps": 2}}, "num_steps"), ({"reasoning_effort": "low"}, None)):
        with pytest.raises(RefusedDepth, match=r"can only be 4 on this server.*V1 runner") as error:
            with_depth({**body, **extra}, limits)
        assert error.value.parameter == (parameter or "reasoning_effort")


def test_the_engines_scheduler_salts_each_request_by_its_depth_after_the_clients_salt(tmp_path):
    """The engine's scheduler (any route, with or without the middleware) gives each request the cache salt of the
    depth it runs at, `max_recurrence` and cache policy, after the client's own, and its block hashes are those of
    that salt; a scheduler named by the user, which would share blocks across depths, is refused."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from recurfit.serving.depth import Limits
    from recurfit.serving.engine import SCHEDULER
    from recurfit.serving.scheduler import salt_by_depth

    folder = saved(served_model("llama"), tmp_path / "llama")
    config = EngineArgs(str(folder), dtype="float32", max_model_len=64).create_engine_config()
    assert config.scheduler_config.scheduler_cls == SCHEDULER
    with pytest.raises(ValueError, match="scheduler_cls 'mine.Scheduler' would replace recurfit's scheduler"):
        EngineArgs(
            str(folder), dtype="float32", max_model_len=64, scheduler_cls="mine.Scheduler"
        ).create_engine_config()

    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)
    limits = Limits(default=4, maximum=16, effort={}, policy="all")

    def request(depth, salt=None):
        params = SamplingParams(extra_args=None if depth is None else {"num_steps": depth})
        made = Request("r", list(range(2, 14)), params, None, cache_salt=salt, block_hasher=hasher)
        salt_by_depth(made, limits)
        return made

    def hashes_with(salt):
        return Request("r", list(range(2, 14)), SamplingParams(), None, cache_salt=salt, block_hasher=hasher)

    for depth, client, expected in (
        (None, None, "recurfit-r4-max16-all"),
        (8, "tenant", "tenant;recurfit-r8-max16-all"),
    ):
        salted = request(depth, client)
        assert salted.cache_salt == expected
        assert salted.block_hashes == hashes_with(expected).block_hashes and len(salted.block_hashes) == 3
    assert request(2).block_hashes[0] != request(16).block_hashes[0]
    assert request(4).block_hashes == request(None).block_hashes  # the default depth is a depth like another


SCHEDULER_BLOCK = 16  # tokens per KV-cache block of the schedulers tests build (`depth_salted_scheduler_of`)


def depth_salted_scheduler_of(config, num_blocks: int = 64):
    """recurfit's scheduler for the engine `config` configures (`engine_config`), as vLLM's EngineCore builds it,
    over a KV cache of `num_blocks` blocks of SCHEDULER_BLOCK tokens in one group (the model's layers: not read by the
    scheduler; 16 tokens, not the CPU build's 128, so that a prompt of a few blocks fits max_model_len)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from recurfit.serving.scheduler import depth_salted_scheduler

    block = config.cache_config.block_size = SCHEDULER_BLOCK
    config.cache_config.num_gpu_blocks = num_blocks  # as EngineCore sets it, once the KV cache is sized
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=32, dtype=torch.float32)
    kv_cache = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    made = depth_salted_scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block,
    )
    assert isinstance(made, Scheduler)
    return made


def salted_request(name: str, prompt: list[int], depth: int | None, block_size: int, resumable: bool = False):
    """vLLM's engine-side Request asking for `depth`, with the engine's block hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=4, extra_args=None if depth is None else {"num_steps": depth})
    hasher = get_request_block_hasher(block_size, sha256)
    return Request(name, prompt, params, None, block_hasher=hasher, resumable=resumable)


def test_the_asynchronous_scheduler_never_gives_a_request_blocks_written_at_another_depth(tmp_path):
    """An engine that schedules asynchronously (vLLM's default on CUDA; its CPU build cannot) gets recurfit's
    asynchronous scheduler, built as vLLM's EngineCore builds it, with vLLM's Requests: a request reads the
    prefix-cache blocks a request of its own depth wrote and none of a request at another depth (the same prompt:
    without the salt the two would share their full blocks)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    folder = saved(served_model("llama"), tmp_path / "llama")
    config = engine_config(folder, False, dict(enable_prefix_caching=True))
    # vLLM decides it after recurfit's hook; its CPU platform turns it off, its CUDA one on: set here as on CUDA.
    config.scheduler_config.async_scheduling = True
    scheduler = depth_salted_scheduler_of(config)
    assert isinstance(scheduler, AsyncScheduler)
    block = SCHEDULER_BLOCK
    prompt = list(range(2, 2 + 3 * block))  # 3 full blocks; a hit covers at most the first 2 (the last token runs)
    scheduler.add_request(salted_request("shallow", prompt, 2, block))
    scheduler.schedule()  # its prompt's blocks are written and published under their hashes
    for name, depth in (("same", 2), ("deep", 8), ("default", None)):
        scheduler.add_request(salted_request(name, prompt, depth, block))
    output = scheduler.schedule()
    computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
    assert computed == {"same": 2 * block, "deep": 0, "default": 0}  # the default depth, 4, is another depth too


def test_latest_policy_is_refused_where_a_token_would_read_same_step_keys_of_its_own_request(tmp_path):
    """cache_policy 'latest' gives generate's tokens only where generated tokens run one per forward: a verify
    step (a token with its drafts) is refused at engine start, as a prompt split into chunks is; and so is a KV
    cache too small for max_num_seqs requests of max_model_len tokens, where vLLM would preempt a request and
    recompute its tokens as one prefill (its tokens then depending on the server's load). A draft's engine, whose
    tokens only propose, keeps 'latest'."""
    from recurfit.serving.depth import Limits
    from recurfit.serving.draft import write_draft

    folder = saved(served_model("llama", mean_recurrence=4), tmp_path / "llama")
    draft = write_draft(folder, 1, tmp_path / "draft")
    one_forward = dict(enable_prefix_caching=False, enable_chunked_prefill=False)
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match=r"cache_policy 'latest' .* turn off speculative decoding \(no --spec"):
        engine_config(folder, True, dict(one_forward, speculative_config=speculative), cache_policy="latest")
    from recurfit.serving.engine import _latest_keys_one_token_at_a_time

    config = engine_config(folder, True, dict(one_forward, speculative_config=speculative))
    draft_config = dataclasses.replace(config, model_config=config.speculative_config.draft_model_config)
    _latest_keys_one_token_at_a_time(draft_config, Limits(1, 1, {}, "latest"))  # a draft: not refused

    config = engine_config(folder, False, one_forward, cache_policy="latest")  # max_model_len 64, max_num_seqs 4
    block = SCHEDULER_BLOCK
    per_request = 64 // block + 1  # and the pool's null block
    with pytest.raises(ValueError, match=r"cache_policy 'latest' with a KV cache of .* set --max-num-seqs 3 "):
        depth_salted_scheduler_of(config, num_blocks=4 * per_request)
    depth_salted_scheduler_of(config, num_blocks=4 * per_request + 1)
    depth_salted_scheduler_of(engine_config(folder, False, one_forward), num_blocks=2)  # 'all': preemption is exact


def test_a_streaming_session_keeps_its_depth_and_a_chunk_at_another_is_refused(tmp_path):
    """A streaming-input session (vLLM's resumable requests, one id for every chunk) keeps the salt and block hashes
    of its first chunk's depth, whose caches it wrote: a next chunk at the same depth joins it, one at another
    depth is refused and ends the session, with an error to its client."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    folder = saved(served_model("llama"), tmp_path / "llama")
    config = engine_config(folder, False, dict(enable_prefix_caching=True))
    scheduler = depth_salted_scheduler_of(config)
    block = SCHEDULER_BLOCK
    prompt = list(range(2, 2 + 2 * block))
    scheduler.add_request(salted_request("session", prompt, 2, block, resumable=True))
    session = scheduler.requests["session"]
    scheduler.add_request(salted_request("session", [5, 6], 2, block, resumable=True))
    assert len(session.streaming_queue) == 1 and not scheduler.refused
    scheduler.add_request(salted_request("session", [5, 6], 4, block, resumable=True))
    assert "session" not in scheduler.requests and session.is_finished()
    (refused,) = scheduler.refused
    output = scheduler.update_from_output(scheduler.schedule(), EMPTY_MODEL_RUNNER_OUTPUT)
    (answer,) = [out for outs in output.values() for out in outs.outputs if out.request_id == "session"]
    assert answer.finish_reason == vllm.v1.engine.FinishReason.ERROR and refused.request_id == "session"


def test_the_v1_runner_refuses_an_attention_backend_whose_metadata_has_no_request_offsets(tmp_path, monkeypatch):
    """The V1 runner finds each token's request, hence its depth, in the attention metadata's query_start_loc,
    which FlashInfer's metadata lacks (it would fail on the first request, every request in flight with it): the
    model refuses it when it loads, naming the backends that carry it and Model Runner V2, whose model state carries
    the depths itself. An engine of one depth needs no offsets."""
    import recurfit.serving.attention

    folder = saved(served_model("llama"), tmp_path / "llama")
    # As the model loads: the CPU's backend taken for one without offsets, the engine does not start.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recurfit.serving.attention, "NARROWED_BACKENDS", {"FLASH_ATTN": "FlashAttentionMetadata"})
        with pytest.raises(Exception, match="query_start_loc, which CPU_ATTN's lacks"):
            vllm_engine(folder)
    from recurfit.serving.attention import check_v1_backend

    config = engine_config(folder, False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # vLLM reads the runner from the environment when asked
    with pytest.raises(ValueError, match="query_start_loc, which FLASHINFER's lacks: serve with --attention-backend"):
        check_v1_backend(config, True, "FLASHINFER")
    check_v1_backend(config, True, "CPU_ATTN")
    check_v1_backend(config, False, "FLASHINFER")  # one depth: no offsets needed
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    check_v1_backend(config, True, "FLASHINFER")


def test_a_full_cuda_graph_mode_vllm_sets_after_the_hook_is_refused_in_the_worker():
    """vLLM turns PIECEWISE into FULL after recurfit's config hook when asked to fuse attention with quantization
    (-cc.pass_config.fuse_attn_quant=true): the worker sees the final mode and refuses it, rather than replay
    whole forwards at the captured depth; NONE, named with it, stays."""
    from vllm.config import CompilationConfig, CompilationMode

    from recurfit.serving.engine import _piecewise_cuda_graphs
    from recurfit.serving.pieces import split_at_stepped_attention

    for named in (None, "PIECEWISE"):
        compilation = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=named, pass_config={"fuse_attn_quant": True}
        )
        _piecewise_cuda_graphs(compilation)  # recurfit's hook
        compilation.set_splitting_ops_for_v1(all2all_backend="naive")  # vLLM's, after it
        with pytest.raises(ValueError, match="cudagraph_mode is FULL on the final config .* drop fuse_attn_quant"):
            split_at_stepped_attention(compilation)
    compilation = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="NONE", pass_config={"fuse_attn_quant": True}
    )
    compilation.set_splitting_ops_for_v1(all2all_backend="naive")
    split_at_stepped_attention(compilation)


def test_dual_batch_overlap_and_micro_batches_are_refused_in_one_line(tmp_path):
    """vLLM's dual-batch overlap and micro-batching split a forward between threads, which recurfit's per-forward
    depths and step state do not follow: refused when the engine's config is built."""
    from vllm.engine.arg_utils import EngineArgs

    folder = saved(served_model("llama"), tmp_path / "llama")
    for setting in (dict(enable_dbo=True), dict(ubatch_size=2)):
        args = EngineArgs(str(folder), dtype="float32", max_model_len=64, **setting)
        with pytest.raises(ValueError, match=r"micro-batching \(enable_dbo, ubatch_size\) .* drop --enable-dbo"):
            args.create_engine_config()


def test_a_drafts_compiled_pieces_are_cached_under_vllms_draft_tag(tmp_path):
    """vLLM keeps a speculative draft's compiled artifacts apart from the target's by its model tag
    ("draft_model"): the pieces keep it before their own name, so a draft of another shape never loads the
    target's kernels; the target's pieces are apart from each other."""
    from torch import nn
    from vllm.compilation.backends import set_model_tag
    from vllm.config import VllmConfig, set_current_vllm_config

    from recurfit.serving.pieces import Pieces

    config = VllmConfig()
    with set_current_vllm_config(config):
        target = Pieces(nn.Module(), config)
        with set_model_tag("draft_model"):
            draft = Pieces(nn.Module(), config)
    pieces = ("prelude", "core_step", "coda")
    tags = [getattr(target, name)._compile_tag for name in pieces]
    assert len(set(tags)) == 3
    for name in pieces:
        tag = getattr(draft, name)._compile_tag
        assert tag.startswith("draft_model") and tag not in tags and name in tag


def test_the_middleware_without_a_recurfit_engine_fails_loudly():
    """EffortToDepth reads its limits from the server's own engine (the app's state): behind a server of another
    model, or none, each generation request is a 500 naming recurfit, not a request served at no depth."""
    import asyncio

    from recurfit.serving.middleware import EffortToDepth

    served = []

    async def app(scope, receive, send):
        served.append(scope["path"])

    def call(app_state, path="/v1/completions"):
        sent = []

        async def receive():
            return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": [], "app": SimpleNamespace(state=app_state)}
        asyncio.run(EffortToDepth(app)(scope, receive, send))
        return sent

    for state in (SimpleNamespace(), SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(
        architectures=["LlamaForCausalLM"]
    )))):  # fmt: skip
        start, body = call(state)
        assert (
            start["status"] == 500 and b"EffortToDepth: this server's engine serves no recurfit folder" in body["body"]
        )
    assert served == []
    call(SimpleNamespace(), path="/v1/models")  # not a generation request: passed through
    assert served == ["/v1/models"]


def asgi_call(middleware, path: str, body: dict, app_state) -> tuple[list, list]:
    """One POST through ASGI `middleware`: the bodies its app received and the messages it sent back."""
    import asyncio

    received, sent = [], []

    async def app(scope, receive, send):
        received.append(json.loads((await receive())["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "app": SimpleNamespace(state=app_state)}
    asyncio.run(middleware(app)(scope, receive, send))
    return received, sent


def recurfit_app_state(effort_map: dict | None = None) -> SimpleNamespace:
    """The app state of `vllm serve` for a recurfit folder of r̄ 4, max 16, efforts low 2 / medium 4 / high 16."""
    served = SimpleNamespace(mean_recurrence=4, max_recurrence=16, depth_for_effort={"low": 2, "medium": 4, "high": 16})
    model = SimpleNamespace(architectures=["RecurrentForCausalLM"], hf_config=served, runner_type="generate")
    engine = SimpleNamespace(model_config=model, speculative_config=None, use_v2_model_runner=True)
    return SimpleNamespace(vllm_config=engine, args=SimpleNamespace(reasoning_effort_map=effort_map))


def test_the_token_in_token_out_and_cohere_routes_report_their_depth_and_refuse_what_they_cannot_carry():
    """vLLM's token-in/token-out route (/inference/v1/generate) carries a request's arguments in
    `sampling_params.extra_args`, Cohere's chat (/cohere/v2/chat) none (its requests run at the default depth): both
    get the depth header and the count on /metrics; a depth out of range, or one Cohere's chat would drop, is a
    400 naming num_steps, and the request never reaches the engine."""
    from recurfit.serving.middleware import DEPTH_HEADER, EffortToDepth, requests_by_depth

    def counted(depth: int) -> float:
        return requests_by_depth().labels(depth=str(depth))._value.get()

    state, before = recurfit_app_state(), counted(8)
    generate = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "extra_args": {"num_steps": 8, "x": 1}}}
    received, sent = asgi_call(EffortToDepth, "/inference/v1/generate", generate, state)
    assert received == [{**generate, "cache_salt": "recurfit-r8-max16-all"}]
    assert (DEPTH_HEADER.encode(), b"8") in sent[0]["headers"]
    assert counted(8) == before + 1
    received, sent = asgi_call(EffortToDepth, "/inference/v1/generate", {**generate, "sampling_params": {}}, state)
    assert received[0]["sampling_params"] == {"extra_args": {"num_steps": 4}}
    assert (DEPTH_HEADER.encode(), b"4") in sent[0]["headers"]
    received, sent = asgi_call(EffortToDepth, "/inference/v1/generate", {"token_ids": [1]}, state)
    assert received == [{"token_ids": [1]}] and sent[0]["headers"] == []  # no sampling_params: vLLM's 422
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    received, sent = asgi_call(EffortToDepth, "/cohere/v2/chat", chat, state)
    assert received == [chat] and (DEPTH_HEADER.encode(), b"4") in sent[0]["headers"]
    refused = (
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"extra_args": {"num_steps": 17}}}, "got 17"),
        ("/cohere/v2/chat", {**chat, "vllm_xargs": {"num_steps": 8}}, r"default depth \(4\), not num_steps 8"),
    )
    for path, body, message in refused:
        received, sent = asgi_call(EffortToDepth, path, body, state)
        error = json.loads(sent[1]["body"])["error"]
        assert received == [] and sent[0]["status"] == 400 and error["param"] == "num_steps"
        assert re.search(message, error["message"]), error["message"]


def test_a_request_salted_by_the_middleware_keeps_the_block_hashes_vllm_computed_in_its_input_thread(tmp_path):
    """The middleware gives each body the cache salt the engine's scheduler would (after the client's), so vLLM
    hashes its prompt's blocks with it in its input thread and the scheduler keeps them rather than hashing again on
    the engine's thread; a salt whose last part is another depth's, or none of recurfit's, is salted and hashed
    again. Where vLLM would refuse the salt (over 128 characters), the body keeps the client's."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from recurfit.serving.depth import Limits
    from recurfit.serving.middleware import with_depth, with_salt
    from recurfit.serving.scheduler import salt_by_depth

    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)
    limits = Limits(default=4, maximum=16, effort={}, policy="all")
    body = with_salt(with_depth({"prompt": "hi", "cache_salt": "tenant"}, limits), limits, "/v1/completions")
    assert body["cache_salt"] == "tenant;recurfit-r4-max16-all"
    long = "t" * 120
    assert with_salt(with_depth({"cache_salt": long}, limits), limits, "/v1/completions")["cache_salt"] == long

    def salted(salt, depth=4):
        request = Request(
            "r",
            list(range(2, 14)),
            SamplingParams(extra_args={"num_steps": depth}),
            None,
            cache_salt=salt,
            block_hasher=hasher,
        )
        first = request.block_hashes
        salt_by_depth(request, limits)
        return request, first

    kept, first = salted(body["cache_salt"])
    assert kept.block_hashes is first and kept.cache_salt == body["cache_salt"]
    assert kept.block_hashes == salted("tenant")[0].block_hashes  # what the scheduler makes of the client's salt
    for salt, depth, expected in (
        ("tenant;recurfit-r4-max16-all", 8, "tenant;recurfit-r4-max16-all;recurfit-r8-max16-all"),
        ("recurfit-r4-max16-all-x", 4, "recurfit-r4-max16-all-x;recurfit-r4-max16-all"),
    ):
        again, first = salted(salt, depth)
        assert again.cache_salt == expected and again.block_hashes is not first
        assert again.block_hashes != first and len(again.block_hashes) == 3


def test_the_depth_follows_the_effort_the_chat_template_sees_after_the_servers_effort_map():
    """`vllm serve --reasoning-effort-map` rewrites a request's effort before the chat template sees it: the depth
    is that effort's (`depth_for_effort` of the rewritten one), on every effort field, and an effort the map makes
    one the table lacks is a 400 saying so."""
    from recurfit.serving.middleware import DEPTH_HEADER, EffortToDepth

    state = recurfit_app_state({"medium": "low", "xhigh": "max"})
    for body in (
        {"messages": [], "reasoning_effort": "medium"},
        {"input": "hi", "reasoning": {"effort": "medium"}},
        {"messages": [], "output_config": {"effort": "medium"}},
    ):
        path = "/v1/responses" if "input" in body else "/v1/chat/completions"
        received, sent = asgi_call(EffortToDepth, path, body, state)
        assert received[0]["vllm_xargs"] == {"num_steps": 2} and (DEPTH_HEADER.encode(), b"2") in sent[0]["headers"]
    received, sent = asgi_call(EffortToDepth, "/v1/chat/completions", {"reasoning_effort": "high"}, state)
    assert received[0]["vllm_xargs"] == {"num_steps": 16}  # not in the map: as it is
    received, sent = asgi_call(EffortToDepth, "/v1/chat/completions", {"reasoning_effort": "xhigh"}, state)
    error = json.loads(sent[1]["body"])["error"]
    assert received == [] and sent[0]["status"] == 400 and error["param"] == "reasoning_effort"
    assert "got 'xhigh' (which --reasoning-effort-map makes 'max')" in error["message"]


def test_two_engines_of_different_limits_in_one_process_keep_their_own(tmp_path):
    """Two engines in one process (as tests and benchmarks run them): each checks depths against its own
    max_recurrence, and each model reads its own engine's depths, so each request gets recurfit's tokens at its
    own depth from either engine."""
    model = served_model("llama", mean_recurrence=2)
    folder, batch = saved(model, tmp_path / "llama"), prompts()
    shallow, deep = vllm_engine(folder, max_recurrence=4), vllm_engine(folder, max_recurrence=8)
    try:
        with pytest.raises(VLLMValidationError, match=r"integer in \[1, 4\].* got 8"):
            served_by_depth(shallow, batch[:1], [8])
        served = served_by_depth(deep, batch, [8, 1, 8]), served_by_depth(shallow, batch, [4, 3, 1])
    finally:
        del shallow, deep
        gc.collect()
    assert served == (expected_by_depth(model, batch, [8, 1, 8]), expected_by_depth(model, batch, [4, 3, 1]))


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0", "dev"])
def test_an_untested_vllm_release_is_refused_in_one_line_unless_allowed(monkeypatch, version):
    monkeypatch.delenv(UNTESTED_VLLM, raising=False)
    for tested in ("0.32.0", "0.32.1+cpu", "0.33.0", "0.34.0"):
        check_vllm_version(tested)
    with pytest.raises(
        RuntimeError, match=rf"^recurfit on vLLM: vLLM {version} is untested .*0\.32\.x, 0\.33\.x, 0\.34\.x"
    ) as error:
        check_vllm_version(version)
    assert "\n" not in str(error.value) and "pip install 'vllm>=0.32,<0.35'" in str(error.value)
    monkeypatch.setenv(UNTESTED_VLLM, "1")
    check_vllm_version(version)


def test_the_installed_vllm_is_tested_and_a_newer_one_refused_when_the_model_loads(tmp_path, monkeypatch):
    check_vllm_version(vllm.__version__)
    folder = saved(served_model("llama"), tmp_path / "llama")
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.delenv(UNTESTED_VLLM, raising=False)
    with pytest.raises(RuntimeError, match="vLLM 0.35.0 is untested"):
        vllm_greedy(folder, prompts())


def test_qwen_with_some_sliding_layers_is_refused(tmp_path):
    torch.manual_seed(0)
    parent = tiny_parent("qwen2", place=False, **HEADS)  # sliding window on 3 of 6 layers (conftest)
    folder = saved(recurfit.retrofit(parent, (2, 2, 2), state_init_std=0.0), tmp_path / "qwen2")
    with pytest.raises(ValueError, match="layer_types mixes"):
        vllm_greedy(folder, prompts())


def start_server(tmp_path, folder, *args: str) -> tuple[subprocess.Popen, str]:
    """`vllm serve folder` on a free port of 127.0.0.1, in its own process group; its base URL once healthy."""
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "vllm"), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-bytes", str(64 << 20), *args,
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 400
    while True:
        if server.poll() is not None:
            raise AssertionError(f"vllm serve exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return server, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                stop_server(server)
                raise AssertionError("vllm serve did not start in 400 s") from None
            time.sleep(2)


def stop_server(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def depth_server(tmp_path, *args: str):
    """A tiny Llama retrofit (r̄ = 2) served eager as "tiny" at r = 3, depths up to 16, reasoning_effort low /
    medium / high at 1 / 3 / 8 through EffortToDepth, and a chat template that joins the messages: the model, the
    server and its URL."""
    model = served_model("llama", mean_recurrence=2)
    folder = saved(model, tmp_path / "llama")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    overrides = {"mean_recurrence": 3, "max_recurrence": 16, "depth_for_effort": {"low": 1, "medium": 3, "high": 8}}
    server, url = start_server(
        tmp_path, folder, "--enforce-eager", "--served-model-name", "tiny", "--hf-overrides", json.dumps(overrides),
        "--chat-template", str(template), "--middleware", "recurfit.serving.middleware.EffortToDepth", *args,
    )  # fmt: skip
    return model, server, url


def test_vllm_serve_answers_the_openai_client_at_each_requests_depth(tmp_path):
    """`vllm serve` driven by the `openai` package: completions at the server's r (3) and per request through
    vllm_xargs, chat (reasoning_effort through EffortToDepth) and the Responses API (reasoning.effort), beam search,
    streaming, n = 2, stop sequences, 32 concurrent requests of depths 1-16; then bad inputs, each a 400 naming the
    problem, and correct answers afterwards."""
    import openai

    model, server, url = depth_server(tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        greedy = dict(model="tiny", temperature=0, max_tokens=16)
        ids = dict(return_token_ids=True, ignore_eos=True)

        def completion(prompt, depth=None, **kwargs):
            extra = dict(ids, **({"vllm_xargs": {"num_steps": depth}} if depth is not None else {}))
            return client.completions.create(prompt=prompt, extra_body=extra, **dict(greedy, **kwargs))

        def check_answers():
            prompt = prompts()[1]
            answer = completion(prompt, max_tokens=NEW_TOKENS)
            assert answer.choices[0].token_ids == recurfit_greedy(model, [prompt], 3)[0]  # the server's r = 3
            assert answer.usage.completion_tokens == NEW_TOKENS
            return answer

        answer = check_answers()
        text = answer.choices[0].text
        assert len(text) > 20, text

        # A text prompt means one thing: the server's completion of it is `recurfit generate --prompt`'s (its raw
        # text, through prompt_ids), at the same depth.
        raw = completion("The cat sat on", depth=5).choices[0]
        tokenizer = load_tokenizer(tmp_path / "llama")
        assert raw.prompt_token_ids == prompt_ids(tokenizer, "The cat sat on")[0].tolist()
        assert raw.token_ids == recurfit_greedy(model, [raw.prompt_token_ids], 5, new_tokens=16)[0]

        # Each answer says the depth it ran at, and the server's metrics count the requests per depth.
        for depth, asked in ((5, 5), (3, None)):
            extra = dict(ids, **({"vllm_xargs": {"num_steps": asked}} if asked else {}))
            reply = client.completions.with_raw_response.create(prompt="The cat", extra_body=extra, **greedy)
            assert reply.headers["x-recurfit-depth"] == str(depth)
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
        counts = dict(re.findall(r'^recurfit:requests_total\{depth="(\d+)"\} (\S+)$', metrics, re.M))
        assert float(counts["5"]) >= 2 and float(counts["3"]) >= 2, counts

        # Streaming gives the same text in pieces.
        pieces = [c.choices[0].text for c in completion(prompts()[1], max_tokens=NEW_TOKENS, stream=True)]
        assert len(pieces) > 1 and "".join(pieces) == text

        # A stop sequence ends the text before it.
        stop = text[12:14]
        stopped = completion(prompts()[1], max_tokens=NEW_TOKENS, stop=[stop]).choices[0]
        assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]

        # n = 2 sampled answers.
        sampled = completion(prompts()[1], temperature=1.0, n=2, seed=3)
        assert len(sampled.choices) == 2 and sampled.choices[0].text != sampled.choices[1].text

        # Chat: the template joins the messages; reasoning_effort picks the depth through depth_for_effort.
        def chat(**kwargs):
            body = dict(ids, **kwargs.pop("extra_body", {}))
            messages = [{"role": "user", "content": "The cat sat"}]
            return client.chat.completions.create(messages=messages, extra_body=body, **dict(greedy, **kwargs))

        plain = chat()
        chat_prompt = plain.prompt_token_ids
        assert plain.choices[0].token_ids == recurfit_greedy(model, [chat_prompt], 3, new_tokens=16)[0]
        high = chat(reasoning_effort="high")
        assert high.choices[0].token_ids == recurfit_greedy(model, [chat_prompt], 8, new_tokens=16)[0]
        named = chat(reasoning_effort="high", extra_body={"vllm_xargs": {"num_steps": 2}})  # num_steps wins
        assert named.choices[0].token_ids == recurfit_greedy(model, [chat_prompt], 2, new_tokens=16)[0]

        # The Responses API: reasoning.effort picks the depth as chat's reasoning_effort does.
        def respond(effort: str) -> str:
            answer = client.responses.create(
                model="tiny", input="The cat sat", reasoning={"effort": effort}, temperature=0, max_output_tokens=16,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return answer.output_text

        by_effort = {effort: respond(effort) for effort in ("low", "high")}
        assert by_effort == {e: chat(reasoning_effort=e).choices[0].message.content for e in ("low", "high")}
        assert by_effort["low"] != by_effort["high"]

        # Beam search passes no per-request arguments to the model: it runs at the server's default depth, and a
        # request that names another is refused.
        beam = dict(greedy, prompt=prompts()[1], n=2)
        beamed = client.completions.create(**beam, extra_body={"use_beam_search": True})
        assert len(beamed.choices) == 2
        with pytest.raises(
            openai.BadRequestError, match=r"use_beam_search runs every request at .* default depth \(3\)"
        ):
            client.completions.create(**beam, extra_body={"use_beam_search": True, "vllm_xargs": {"num_steps": 8}})

        # 32 concurrent requests of depths 1-16, each answered at its own depth.
        batch = (mixed_prompts() * 4)[:32]
        depths = [DEPTHS[(i * 3) % 5] for i in range(32)]
        with ThreadPoolExecutor(32) as pool:
            served = list(pool.map(lambda pd: completion(pd[0], pd[1]).choices[0].token_ids, zip(batch, depths)))
        expected = {r: recurfit_greedy(model, mixed_prompts(), r, new_tokens=16) for r in DEPTHS}
        assert served == [expected[r][i % 10] for i, r in enumerate(depths)]

        # Bad inputs: a 400 each, naming the problem.
        bad = [
            (dict(extra_body={"vllm_xargs": {"num_steps": 0}}), r"num_steps .* integer in \[1, 16\].* got 0"),
            (dict(extra_body={"vllm_xargs": {"num_steps": 10**6}}), r"num_steps .* got 1000000"),
            (dict(extra_body={"vllm_xargs": {"num_steps": "deep"}}), r"num_steps .* got 'deep'"),
            (dict(max_tokens=-1), r"max_tokens"),
            (dict(prompt=[2] + [5] * 200), r"maximum context length|max_model_len|too long"),
        ]
        for kwargs, message in bad:
            arguments = {**greedy, "prompt": prompts()[0], **kwargs}
            with pytest.raises(openai.BadRequestError, match=message):
                client.completions.create(**arguments)
        with pytest.raises(openai.BadRequestError, match=r"reasoning_effort must be one of"):
            chat(reasoning_effort="max")

        check_answers()  # the server still answers, correctly
    finally:
        stop_server(server)


def route_request(path: str, text: str, ids: list[int], depth: int, salt: str | None) -> dict:
    """A request body for `path` (a generation route of vLLM's server) at `depth`, greedy, 12 tokens, with the
    client's own `salt` if any."""
    user = [{"role": "user", "content": text}]
    salted = {"cache_salt": salt} if salt else {}
    depth_args = {"vllm_xargs": {"num_steps": depth}}
    common = dict(model="tiny", temperature=0, max_tokens=12, **depth_args, **salted)
    return {
        "/v1/completions": dict(common, prompt=ids, ignore_eos=True, return_token_ids=True),
        "/v1/chat/completions": dict(common, messages=user, ignore_eos=True),
        "/v1/chat/completions/batch": dict(common, messages=[user], ignore_eos=True),
        "/v1/messages": dict(common, messages=user),
        "/v1/responses": dict(
            model="tiny", input=text, temperature=0, max_output_tokens=12, ignore_eos=True, **depth_args, **salted
        ),
        "/inference/v1/generate": dict(
            token_ids=ids,
            sampling_params={"max_tokens": 12, "temperature": 0, "extra_args": {"num_steps": depth}},
            **salted,
        ),
    }[path]


def route_answer(path: str, body: dict) -> str:
    """The generated text (or token ids) of an answer on `path`."""
    if path == "/v1/responses":
        return "".join(c["text"] for item in body["output"] for c in item.get("content") or [] if "text" in c)
    if path == "/v1/messages":
        return "".join(block.get("text", "") for block in body["content"])
    choice = body["choices"][0]
    if path in ("/inference/v1/generate", "/v1/completions"):
        return str(choice["token_ids"])
    return choice["message"]["content"]


GENERATION_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/messages",
    "/v1/responses",
    "/inference/v1/generate",
)


def test_without_the_middleware_no_route_reads_cache_blocks_written_at_another_depth(tmp_path):
    """`vllm serve` started without recurfit's middleware, prefix caching on (vLLM's default): on every generation
    route the server lists, a depth-16 request on a long prompt, sent after a depth-2 request on the same prompt
    (whose blocks are then cached), answers as it does with a fresh cache salt of its own, and differently from
    the depth-2 one; on completions, with recurfit's tokens at depth 16. The engine's start line says so."""
    model = served_model("llama", mean_recurrence=2)
    folder = saved(model, tmp_path / "llama")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    overrides = {"mean_recurrence": 3, "max_recurrence": 16}
    server, url = start_server(
        tmp_path, folder, "--enforce-eager", "--served-model-name", "tiny", "--hf-overrides", json.dumps(overrides),
        "--chat-template", str(template), "--enable-prefix-caching", "--block-size", "32",
    )  # fmt: skip
    text = "The cat sat on the mat, and the dog sat on the log by the old red door of the barn."  # 2 full blocks

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(
            url + path, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as answer:
            return json.loads(answer.read())

    try:
        listed = set(json.loads(urllib.request.urlopen(f"{url}/openapi.json", timeout=30).read())["paths"])
        ids = post("/tokenize", {"model": "tiny", "prompt": text})["tokens"]
        answers = {}
        for path in [route for route in GENERATION_ROUTES if route in listed]:
            shallow = route_answer(path, post(path, route_request(path, text, ids, 2, None)))
            deep = route_answer(path, post(path, route_request(path, text, ids, 16, None)))
            fresh = route_answer(path, post(path, route_request(path, text, ids, 16, f"fresh{len(answers)}")))
            answers[path] = (shallow, deep, fresh)
        log = (tmp_path / "serve.log").read_text()
    finally:
        stop_server(server)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"} <= answers.keys(), listed
    for path, (shallow, deep, fresh) in answers.items():
        assert deep == fresh and deep != shallow, (path, shallow, deep, fresh)
    expected = recurfit_greedy(model, [ids], 16, new_tokens=12)[0]
    assert answers["/v1/completions"][1] == str(expected)
    assert "V1 runner; CUDA graphs NONE; pieces eager; attention CPU_ATTN, narrowed" in log
    assert "depths 1..16 (default 3), cache policy all; prefix cache kept apart by depth" in log


def test_each_api_server_process_reads_the_depth_and_checks_it(tmp_path):
    """`vllm serve --api-server-count 2`: each API server process builds its own config, so each has the limits
    that check num_steps and the table that EffortToDepth reads. Requests on 24 connections of their own (which the
    processes share), so that both answer some: mixed depths, reasoning_effort and a bad depth, each as with one."""
    import openai

    model, server, url = depth_server(tmp_path, "--api-server-count", "2", "--enable-log-requests")
    try:
        ids = dict(return_token_ids=True, ignore_eos=True)

        def ask(index: int):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
            try:
                greedy = dict(model="tiny", temperature=0, max_tokens=16)
                if index % 3 == 0:
                    with pytest.raises(openai.BadRequestError, match=r"num_steps .* integer in \[1, 16\].* got 0"):
                        client.completions.create(
                            prompt=prompts()[0], extra_body={"vllm_xargs": {"num_steps": 0}}, **greedy
                        )
                    return None
                if index % 3 == 1:
                    messages = [{"role": "user", "content": "The cat sat"}]
                    answer = client.chat.completions.create(
                        messages=messages, reasoning_effort="high", extra_body=ids, **greedy
                    )
                    return answer.prompt_token_ids, 8, answer.choices[0].token_ids
                prompt, depth = mixed_prompts()[index % 10], DEPTHS[index % 5]
                extra = dict(ids, vllm_xargs={"num_steps": depth})
                answer = client.completions.create(prompt=prompt, extra_body=extra, **greedy)
                return prompt, depth, answer.choices[0].token_ids
            finally:
                client.close()

        with ThreadPoolExecutor(24) as pool:
            answers = [a for a in pool.map(ask, range(24)) if a is not None]
    finally:
        stop_server(server)
    assert len(answers) == 16
    for prompt, depth, tokens in answers:
        assert tokens == recurfit_greedy(model, [prompt], depth, new_tokens=16)[0], depth
    log = (tmp_path / "serve.log").read_text()
    assert all(re.search(rf"ApiServer_{i} .*Received request", log) for i in (0, 1)), "one process answered all"


def test_a_trained_folder_carries_depth_for_effort_and_the_server_reads_it(tmp_path, workspace):
    """`recurfit train` writes reasoning_effort's table into the final config.json (r̄ = 4: 2, 4, 8), and the
    server's mapping (what EffortToDepth reads, made by the engine's config hook) is that table, or the folder's
    edited one; --hf-overrides that change the depths and give no table get the defaults of the served depths."""
    from vllm.engine.arg_utils import EngineArgs

    from recurfit.serving import depth
    from recurfit.train import load_config, train

    train(load_config(None, [], base=small_run(workspace, tmp_path / "run")))
    final = tmp_path / "run" / "final"
    settings = json.loads((final / "config.json").read_text())

    def served_effort(**overrides) -> dict:
        args = EngineArgs(str(final), hf_overrides=overrides, dtype="float32", enforce_eager=True, max_model_len=64)
        # The config hook runs when the config is built (no engine starts), and the server reads its limits there.
        return depth.engine_limits(args.create_engine_config()).effort

    assert settings["mean_recurrence"] == 4 and settings["depth_for_effort"] == {"low": 2, "medium": 4, "high": 8}
    assert served_effort() == {"low": 2, "medium": 4, "high": 8}
    assert served_effort(max_recurrence=16) == {"low": 2, "medium": 4, "high": 16}
    assert served_effort(mean_recurrence=2, max_recurrence=2) == {"low": 1, "medium": 2, "high": 2}
    given = {"low": 1, "medium": 3, "high": 12}
    assert served_effort(mean_recurrence=3, max_recurrence=16, depth_for_effort=given) == given
    edited = {"low": 1, "medium": 4, "high": 6, "max": 8}
    (final / "config.json").write_text(json.dumps({**settings, "depth_for_effort": edited}))
    assert served_effort() == edited


def test_eval_through_vllm_reads_a_folder_without_running_its_own_code(tmp_path):
    """A folder whose config.json names classes in its own code (auto_map) is refused in one line, as every other
    loading call refuses it, before any engine starts (transformers would otherwise ask on a terminal)."""
    from recurfit.evaluate.vllm_backend import ServedFolder
    from recurfit.model.loading import NeedsOwnCode

    config = dict(model_type="raven_like", auto_map={"AutoConfig": "configuration_raven.RavenConfig"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "configuration_raven.py").write_text("raise SystemExit('the folder's own code ran')\n")
    with pytest.raises(NeedsOwnCode, match=r"names classes in the folder's own code \(auto_map\)"):
        ServedFolder.load(str(tmp_path))


def state_reading_smollm(folder: Path) -> Path:
    """The embedded SmolLM2 retrofitted to (4, 8, 4), its adapter reading the state too (so that r changes the
    answers), saved with its tokenizer to `folder`."""
    torch.manual_seed(0)
    model = recurfit.retrofit(load_model(None, dtype=torch.float32), (4, 8, 4), state_init_std=0.02).eval()
    with torch.no_grad():
        hidden = model.config.text_config.hidden_size
        model.model.adapter.weight[:, :hidden] += 0.1 * torch.eye(hidden)
    model.save_pretrained(folder)
    save_tokenizer(load_tokenizer(None), folder)
    return folder


def test_gsm8k_through_vllm_answers_and_scores_as_the_default_backend(tmp_path, capsys):
    """`eval tasks --backend vllm` on the embedded SmolLM2 retrofit, a model folder and then a run folder of
    snapshots: per problem, the same generated text, extracted answers and scores as the default backend, at r = 1
    and 4 (greedy, s_0 = 0 by --state-init zeros though the model's own state_init_std is not 0)."""
    folder = state_reading_smollm(tmp_path / "model")
    common = ["--tasks", "gsm8k_cot", "--limit", "3", "--max-new-tokens", "32", "--state-init", "zeros"]
    common += ["--log-samples", "--kv-cache-gib", "0.5"]
    code, text = run_cli(capsys, "eval", "tasks", folder, "-r", "1,4", *common, "--out", tmp_path / "hf")
    assert code == 0, text
    vllm_model = ["eval", "tasks", folder, "-r", "1,4", *common, "--backend", "vllm", "--out", tmp_path / "vllm"]
    code, text = run_cli(capsys, *vllm_model)
    assert code == 0, text
    ours, theirs = (Sweep.load(tmp_path / name / "results.json") for name in ("hf", "vllm"))
    assert [row.metrics for row in theirs.rows] == [row.metrics for row in ours.rows]
    assert theirs.details["backend"] == "vllm" and ours.details["backend"] == "hf"
    expected = json.loads((tmp_path / "hf" / "samples.json").read_text())
    served = json.loads((tmp_path / "vllm" / "samples.json").read_text())
    for r in ("r=1", "r=4"):
        assert_same_answers(served[r], expected[r])
    answers = {r: [sample["resps"] for sample in expected[r]["gsm8k_cot_offline"]] for r in ("r=1", "r=4")}
    assert all(len(answer[0][0]) > 20 for answer in answers["r=1"] + answers["r=4"])  # text, not an empty stop
    assert answers["r=1"] != answers["r=4"]  # the recurrence reached the engine

    # A training run's folder: its snapshot at the mean training recurrence (4), its final model at -r and 4.
    run = tmp_path / "run"
    (run / "snapshots").mkdir(parents=True)
    (run / "config.yaml").write_text("steps: 20\n")
    for step, target in ((10, run / "snapshots" / "step-000010"), (20, run / "final")):
        shutil.copytree(folder, target)
        record = dict(step=step, tokens=step * 1000, flops=step * 1e12, flops_paper=step * 1e12)
        (target / "training.json").write_text(json.dumps(dict(record, mean_recurrence=4, recurrent=True)))
    code, text = run_cli(capsys, "eval", "tasks", run, "-r", "1", *common, "--backend", "vllm", "--out", run / "eval")
    assert code == 0, text
    snapshot, final = (
        json.loads((run / "eval" / name / "samples.json").read_text()) for name in ("step-000010", "step-000020")
    )
    assert set(snapshot) == {"r=4"} and set(final) == {"r=1", "r=4"}
    assert_same_answers(snapshot["r=4"], expected["r=4"])
    for r in ("r=1", "r=4"):
        assert_same_answers(final[r], expected[r])
    assert json.loads((run / "eval" / "evaluation.json").read_text())["settings"]["backend"] == "vllm"


@pytest.mark.parametrize("quiet", [False, True], ids=["bars", "TQDM_DISABLE"])
def test_lm_evals_requests_get_the_sweeps_depth_and_no_bar_that_tqdm_disabled(monkeypatch, quiet):
    """lm-eval's VLLM hands `generate` the SamplingParams it built (one object repeated for a batch): each request
    goes to the engine with `num_steps`, on copies (lm-eval's own are left as they were). Under TQDM_DISABLE (the
    CLI without --verbose) no bar is asked for: vLLM divides by a disabled bar's elapsed time, which is 0."""
    from recurfit.evaluate.vllm_backend import AtDepth

    class Engine:
        served = SimpleNamespace(mean_recurrence=2, max_recurrence=8, depth_for_effort=None)
        llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=served)))

        def generate(self, prompts, sampling_params=None, **kwargs):
            self.sent = (prompts, sampling_params, kwargs)
            return "answers"

    if quiet:
        monkeypatch.setenv("TQDM_DISABLE", "1")
    else:
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
    params = vllm.SamplingParams(temperature=0, max_tokens=1, extra_args={"theirs": 1})
    llm = AtDepth(Engine(), num_steps=4)
    assert llm.generate(["a", "b"], sampling_params=[params, params], use_tqdm=True) == "answers"
    prompts, sent, kwargs = llm.llm.sent
    assert prompts == ["a", "b"]  # as lm-eval gave them: the engine salts each request's cache by its depth
    assert kwargs == {"use_tqdm": not quiet}
    assert [p.extra_args for p in sent] == [{"theirs": 1, "num_steps": 4}] * 2 and sent[0] is sent[1]
    assert params.extra_args == {"theirs": 1} and sent[0].max_tokens == 1
    llm.num_steps = None  # a fixed-depth model: its requests as lm-eval built them
    llm.generate(["a"], sampling_params=params)
    assert (
        llm.llm.sent[0] == ["a"] and llm.llm.sent[1] is params and llm.sent == llm.llm.sent
    )  # everything else is the engine's


def test_one_eager_engine_serves_a_sweep_with_the_scores_of_one_engine_per_r(tmp_path, monkeypatch):
    """`eval tasks --backend vllm` with eager engines: one engine per group of tasks serves every r of the sweep
    (each request names its depth), and gives, per document, the answers and log-likelihoods of an engine started
    for that r alone: GSM8K (generation, its group at max_length 1024) and ARC-Easy (log-likelihoods, its own
    group). The sweep runs r = 1 before r = 4 on the same prompts, so prefix caching would hand r = 4 the blocks
    r = 1 wrote unless they are kept apart by depth."""
    from recurfit.evaluate import vllm_backend
    from recurfit.evaluate.suite import task_sweep

    started = []
    engine = vllm_backend.vllm_lm

    def counted(served, **kwargs):
        started.append((tuple(kwargs["depths"]), kwargs["max_length"]))
        return engine(served, **kwargs)

    monkeypatch.setattr(vllm_backend, "vllm_lm", counted)
    served = vllm_backend.ServedFolder.load(
        str(state_reading_smollm(tmp_path / "model")),
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 29,
    )
    settings = dict(tasks=["gsm8k_cot", "arc_easy"], limit=3, max_new_tokens=32, state_init="zeros", backend="vllm")

    def sweep(depths):
        return task_sweep(served, None, recurrences=depths, log_samples=True, **settings)

    shared, shared_raw = sweep([1, 4])
    assert started == [((1, 4), 1024), ((1, 4), None)]  # one engine per group, serving both depths
    alone = {r: sweep([r]) for r in (1, 4)}
    assert started[2:] == [((1,), 1024), ((1,), None), ((4,), 1024), ((4,), None)]
    for row, r in zip(shared.rows, (1, 4)):
        assert row.metrics == alone[r][0].rows[0].metrics, r
    for r in ("r=1", "r=4"):
        ours, theirs = shared_raw["samples"][r], alone[int(r[2:])][1]["samples"][r]
        assert_same_answers(ours, theirs)
        arc = [(s["doc_id"], s["resps"], s["acc"]) for s in ours["arc_easy_offline"]]
        assert arc == [(s["doc_id"], s["resps"], s["acc"]) for s in theirs["arc_easy_offline"]] and len(arc) == 3
    generated = {r: [s["resps"] for s in shared_raw["samples"][r]["gsm8k_cot_offline"]] for r in ("r=1", "r=4")}
    assert generated["r=1"] != generated["r=4"]  # each request ran at its own depth


# ---------------------------------------------------------------- speculative decoding with a draft folder


def draft_logprobs(model, rows: list[list[int]], generated: list[list[int]], r: int) -> torch.Tensor:
    """recurfit's log-probability of each generated token at depth `r` (teacher forcing on prompt + tokens)."""
    values = []
    with torch.no_grad():
        for prompt, tokens in zip(rows, generated):
            ids = torch.tensor([prompt + tokens])
            logprobs = model(ids, num_steps=r).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            values.append(logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0])
    return torch.cat(values)


# vLLM's logprobs against recurfit's, float32: the two sum in other orders through up to P + R·r + C = 20 layers of
# the tiny model; measured 6e-6 at r = 4 (an AVX2 EPYC), so 1e-3 leaves room for other kernels' orders. Depth 1,
# the draft's, differs by 7.5.
SPECULATED_LOGPROB_ATOL = 1e-3


@pytest.mark.parametrize("compiled, depth", [(False, 8), (True, 4)], ids=["eager-r8", "compiled-r4"])
def test_speculation_with_a_draft_folder_gives_the_servers_tokens_and_target_logprobs(tmp_path, compiled, depth):
    """vLLM's `draft_model` speculation (the V1 runner: the server's one depth) with `recurfit draft`'s folder at
    depth 1: drafts are made and some accepted, and every greedy token, and its log-probability, is the target's at
    the server's depth (recurfit's `generate`, which the server without speculation equals), not the draft's. A
    request naming another depth is refused before it runs; one naming the server's depth runs."""
    from recurfit.serving.draft import write_draft

    model = served_model("llama", mean_recurrence=depth)
    folder, batch = saved(model, tmp_path / "llama"), prompts()
    draft = write_draft(folder, 1, tmp_path / "draft")
    expected = recurfit_greedy(model, batch, depth)
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = vllm_engine(folder, compiled, dict(speculative_config=speculative, disable_log_stats=False))
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        served = torch.tensor(
            [step[token].logprob for o in outputs for token, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        )
        torch.testing.assert_close(
            served, draft_logprobs(model, batch, expected, depth), rtol=0, atol=SPECULATED_LOGPROB_ATOL
        )
        assert (served - draft_logprobs(model, batch, expected, 1)).abs().max() > 2 * SPECULATED_LOGPROB_ATOL
        counts = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        assert counts["vllm:spec_decode_num_draft_tokens"] > 0 and counts["vllm:spec_decode_num_accepted_tokens"] > 0
        assert_compiled(llm, compiled)
        short = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
        refused, own = llm.generate(
            [{"prompt_token_ids": batch[0]}] * 2,
            [vllm.SamplingParams(**short, extra_args={"num_steps": r}) for r in (depth // 2, depth)],
            use_tqdm=False,
        )
        assert (refused.outputs[0].finish_reason, list(refused.outputs[0].token_ids)) == ("error", [])
        assert list(own.outputs[0].token_ids) == expected[0][:8]
    finally:
        del llm
        gc.collect()


def test_speculating_engines_keep_depth_per_request_on_model_runner_v2_only(tmp_path, monkeypatch):
    """With `--speculative-config`: Model Runner V2 keeps recurfit's depth processor (its model state carries each
    request's depth to the target's verification) and refuses adaptive verification, whose draft tokens move between
    requests on the device; the V1 runner, which refuses logits processors beside speculation, has none and runs
    every request at the default; the draft runs at its own folder's depth."""
    from recurfit.serving.depth import engine_limits
    from recurfit.serving.draft import write_draft

    folder = saved(served_model("llama", mean_recurrence=4), tmp_path / "llama")
    draft = write_draft(folder, 1, tmp_path / "draft")
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    for v2_runner in (True, False):  # the runner is read from the environment whenever it is asked for
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if v2_runner else "0")
        config = engine_config(folder, v2_runner, dict(speculative_config=speculative))
        if v2_runner:
            assert config.model_config.logits_processors == ["recurfit.serving.depth:DepthParamsUpTo8"]
            assert engine_limits(config).only is None
        else:
            assert config.model_config.logits_processors == [] and engine_limits(config).only == 4
        draft_model = config.speculative_config.draft_model_config
        assert draft_model.runner_type == "draft" and engine_limits(SimpleNamespace(
            model_config=draft_model, speculative_config=config.speculative_config, use_v2_model_runner=v2_runner
        )).only == 1  # fmt: skip
    adaptive = dict(speculative, enable_adaptive_verification=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(Exception, match="enable_adaptive_verification reassigns draft tokens"):
        engine_config(folder, True, dict(speculative_config=adaptive))


def test_vllm_serve_with_a_draft_folder_answers_the_openai_client_at_its_depth_and_refuses_others(tmp_path):
    """`vllm serve --speculative-config` with `recurfit draft`'s folder and the middleware, driven by the `openai`
    package: a completion gives recurfit's tokens at the server's depth and says so; a request naming another depth
    is a 400 that says why; the log's first recurfit lines say what each engine runs."""
    import openai

    from recurfit.serving.draft import write_draft

    model = served_model("llama", mean_recurrence=4)
    folder = saved(model, tmp_path / "llama")
    draft = write_draft(folder, 1, tmp_path / "draft")
    speculative = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    server, url = start_server(
        tmp_path, folder, "--enforce-eager", "--served-model-name", "tiny", "--speculative-config", speculative,
        "--middleware", "recurfit.serving.middleware.EffortToDepth",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        prompt, body = prompts()[1], dict(return_token_ids=True, ignore_eos=True)
        reply = client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, temperature=0, max_tokens=NEW_TOKENS, extra_body=body
        )
        assert reply.headers["x-recurfit-depth"] == "4"
        assert reply.parse().choices[0].token_ids == recurfit_greedy(model, [prompt], 4)[0]
        with pytest.raises(openai.BadRequestError, match=r"can only be 4 on this server.*V1 runner"):
            client.completions.create(
                model="tiny", prompt=prompt, max_tokens=4, extra_body=dict(body, vllm_xargs={"num_steps": 2})
            )
        log = (tmp_path / "serve.log").read_text()
        assert "every request at depth 4 (speculation on the V1 runner" in log
        assert "speculative draft, every token at depth 1" in log
    finally:
        stop_server(server)
