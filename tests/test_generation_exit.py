"""Tests of `recurfit/generation/exit.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    PADDED_ROWS,
    char_tokenizer,
    generate_adaptive,
    model_with_state,
    model_with_state_for_cache,
    prompts,
    prompts_for_cache,
    tiny_parent,
)

import recurfit
from recurfit.errors import RecurfitError
from recurfit.generation import ExitRule, GenerationSettings, generate_text


def core_rows(model) -> list[int]:
    """Records the batch size of every call to the first core layer."""
    calls: list[int] = []
    model.model.core[0].register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(args[0].shape[0]), with_kwargs=True
    )
    return calls


@pytest.mark.parametrize("criterion", ["kl", "state", "argmax"])
def test_adaptive_depth_reports_steps_and_never_exits_at_threshold_zero(criterion):
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    fixed = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, num_steps=12, pad_token_id=0)
    never = (
        generate_adaptive(model, ids, mask, criterion, threshold=0.0)
        if criterion != "argmax"
        else (generate_adaptive(model, ids, mask, criterion, min_steps=13))
    )
    assert torch.equal(never.sequences, fixed) and torch.all(never.steps_per_token == 12)
    some = generate_adaptive(model, ids, mask, criterion, threshold=10.0, min_steps=3)
    assert some.steps_per_token.shape == (2, 6)
    assert torch.all(some.steps_per_token[:, 0] == 12)  # the prompt runs all its steps
    assert torch.all(some.steps_per_token[:, 1:] >= 3) and torch.all(some.steps_per_token <= 12)
    if criterion == "argmax":  # settles once the argmax holds: some tokens before the full depth
        assert torch.any(some.steps_per_token[:, 1:] < 12)
    else:  # a change below 10 at every step: each decoded token stops as soon as it may
        assert torch.all(some.steps_per_token[:, 1:] == 3)


@pytest.mark.float32_only(PADDED_ROWS)
def test_adaptive_rows_in_a_batch_equal_each_prompt_alone():
    model = model_with_state_for_cache("qwen3")
    ids, mask = prompts_for_cache()
    kwargs = dict(criterion="kl", threshold=1e-3, min_steps=2)
    batched = generate_adaptive(model, ids, mask, **kwargs)
    assert len(set(batched.steps_per_token[:, 1:].flatten().tolist())) > 1  # rows really stop at different steps
    for row in range(2):
        alone = ids[row : row + 1, mask[row].bool()]
        single = generate_adaptive(model, alone, torch.ones_like(alone), **kwargs)
        assert torch.equal(batched.sequences[row, -6:], single.sequences[0, -6:])
        assert torch.equal(batched.steps_per_token[row], single.steps_per_token[0])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("entropy", "CRITERION one of kl, state, argmax"),
        ("kl:x", "is not a number"),
        ("argmax:2.5", "not an integer"),
        ("argmax:0", "patience must be >= 1"),
    ],
)
def test_bad_exit_spec_is_a_clear_error(spec, message):
    with pytest.raises(RecurfitError, match=message):
        ExitRule.parse(spec)


@pytest.mark.parametrize("patience", [3, 5])
def test_argmax_patience_from_the_spec_is_the_number_of_steps_waited(patience):
    """`argmax:N`: the prediction must hold for N steps after it first appears. On an identity-adapter retrofit
    every step computes the same logits, so the token holds from step 1 and each new token stops at N + 1."""
    model = recurfit.retrofit(tiny_parent("llama"), (2, 2, 2)).eval()
    settings = GenerationSettings(recurrence=12, exit=f"argmax:{patience}", min_steps=1, max_new_tokens=4)
    ids = torch.tensor([[5, 6, 7, 8]])
    steps = generate_text(model, char_tokenizer(), ids, settings).steps_per_token
    assert steps == [12] + [patience + 1] * 3  # the prompt runs all 12 steps


def test_exit_specs_parse_to_rules():
    assert ExitRule.parse("kl:1e-3", min_steps=3) == ExitRule("kl", threshold=1e-3, min_steps=3)
    assert ExitRule.parse("state") == ExitRule("state")
    assert ExitRule.parse("argmax:4").patience == 4
    assert ExitRule.parse(None) is None


def test_adaptive_batch_runs_the_core_only_on_rows_still_recurring():
    """A batch's core compute is the sum of its rows' depths, not batch × the deepest row's."""
    model = model_with_state("qwen3")
    ids, mask = prompts(batch=3)
    calls = core_rows(model)
    depths = generate_adaptive(model, ids, mask, "kl", threshold=1e-3).steps_per_token
    assert len(set(depths[:, 1:].flatten().tolist())) > 1  # rows really stop at different steps
    assert sum(calls) == depths.sum().item()  # prefill: 3 rows × 12 steps, then each row its own depth


@pytest.mark.float32_only(PADDED_ROWS)
def test_adaptive_kl_with_skipped_rows_equals_each_prompt_alone():
    """Gathering the running rows keeps every row's tokens and depths those of the prompt decoded alone."""
    model = model_with_state("mistral")  # sliding windows shorter than the sequence
    ids, mask = prompts(batch=3, length=9)
    mask[2, :2] = 0
    kwargs = dict(
        max_new_tokens=6,
        do_sample=False,
        num_steps=10,
        pad_token_id=0,
        return_dict_in_generate=True,
        exit_rule=ExitRule("argmax", patience=1, min_steps=2),
    )
    batched = model.generate(ids, attention_mask=mask, **kwargs)
    assert len(set(batched.steps_per_token[:, 1:].flatten().tolist())) > 1
    for row in range(3):
        alone = ids[row : row + 1, mask[row].bool()]
        single = model.generate(alone, attention_mask=torch.ones_like(alone), **kwargs)
        assert torch.equal(batched.sequences[row, -6:], single.sequences[0, -6:])
        assert torch.equal(batched.steps_per_token[row], single.steps_per_token[0])


@pytest.mark.float32_only("compares greedy tokens and exit depths of two computation orders")
@pytest.mark.parametrize("criterion", ["kl", "argmax"])  # where these rows settle at different depths
def test_frozen_rows_checked_every_few_steps_give_the_same_tokens_and_depths(criterion):
    """Settled rows kept in the batch (masked writes, a host check every 3 steps) against rows dropped at once."""
    model = model_with_state("mistral")  # sliding windows shorter than the sequence
    ids, mask = prompts(batch=3, length=9)
    mask[2, :2] = 0
    runs = {}
    for every in (1, 3):
        rule = ExitRule.parse("kl:1e-3" if criterion == "kl" else "argmax:1", min_steps=2, check_every=every)
        runs[every] = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, num_steps=10, pad_token_id=0,
            return_dict_in_generate=True, exit_rule=rule,
        )  # fmt: skip
    assert len(set(runs[1].steps_per_token[:, 1:].flatten().tolist())) > 1  # rows really stop at different steps
    assert torch.equal(runs[3].sequences, runs[1].sequences)
    assert torch.equal(runs[3].steps_per_token, runs[1].steps_per_token)


def test_frozen_rows_stay_in_the_core_batch():
    model = model_with_state("qwen3")
    ids, mask = prompts(batch=3)
    calls = core_rows(model)
    rule = ExitRule("kl", threshold=1e-3, check_every=4)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_steps=12, pad_token_id=0,
                   exit_rule=rule)  # fmt: skip
    assert set(calls) == {3}  # no gather: every call runs the whole batch


@pytest.mark.parametrize("vocabulary_slices", [1, 3])
def test_a_bf16_models_exit_probe_reads_float32_logits(monkeypatch, vocabulary_slices):
    """With bf16 weights the probe's logits are the float32 product of the bf16 hidden states and the bf16 head
    (exact products, float32 sums), not rounded to bf16 (relative 2^-9, the size of a KL near its threshold), whether
    the head is upcast whole or a slice of the vocabulary at a time; the output logits stay bf16. The float32 sums'
    order differs from F.linear's by at most 3e-8, measured on an AMD EPYC with AVX512-BF16 (no AMX), natively and under
    ONEDNN_MAX_CPU_ISA=AVX512_CORE and =AVX2 (the tolerance 1e-6 is 33x that)."""
    import recurfit.model.modeling as modeling

    model = model_with_state_for_cache("llama").to(torch.bfloat16)
    head = model.lm_head.weight
    monkeypatch.setattr(modeling, "PROBE_CHUNK_ELEMENTS", head.numel() // vocabulary_slices)
    hidden_states, probes = [], []
    probe = model.model._coda_probe
    monkeypatch.setattr(
        model.model, "_coda_probe", lambda *args: hidden_states.append(probe(*args)) or hidden_states[-1]
    )

    class Recording(ExitRule):
        def start(self, batch, device):
            tracker = super().start(batch, device)
            check = tracker.check

            def recorded(step, previous, state, logits):
                return check(step, previous, state, lambda *args: probes.append(logits(*args)) or probes[-1])

            tracker.check = recorded
            return tracker

    ids, mask = prompts_for_cache()
    model.generate(
        ids, attention_mask=mask, max_new_tokens=3, do_sample=False, num_steps=4, pad_token_id=0,
        exit_rule=Recording("kl"),
    )  # fmt: skip
    assert probes and len(probes) == len(hidden_states)
    with torch.no_grad():
        assert model(ids, attention_mask=mask, num_steps=2).logits.dtype == torch.bfloat16
    for hidden, logits in zip(hidden_states, probes, strict=True):
        assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
        torch.testing.assert_close(logits, F.linear(hidden.float(), head.float()), rtol=1e-6, atol=1e-6)
    rounded = torch.cat([logits.flatten() for logits in probes])
    assert (rounded != rounded.bfloat16().float()).float().mean() > 0.5  # most are not bf16 numbers


@pytest.mark.float32_only("compares greedy tokens and exit depths of two computation orders")
def test_compiled_exit_gives_uncompiled_tokens_and_depths_without_recompiles():
    """`generate(compile=..., exit_rule=...)` keeps settled rows in the batch, frozen, and asks the device whether all
    settled once per `check_every` steps: the tokens and per-token depths of uncompiled `generate` with the same rule
    and cache (which drops settled rows at once when checking every step), batched and for one row alone, through
    transformers' loop and recurfit's; after the first call of each criterion no graph is traced again, whatever the
    threshold or `check_every`."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()  # counts the graphs dynamo makes and runs them eagerly (no inductor cost here)
    model = model_with_state("mistral")  # sliding windows shorter than the sequence
    ids, mask = prompts(batch=3, length=9)
    mask[2, :2] = 0

    def run(rule, compile=False, ids=ids, mask=mask, dict_output=True):
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=5, do_sample=False, num_steps=8, pad_token_id=0,
            return_dict_in_generate=dict_output, exit_rule=rule, compile=compile,
        )  # fmt: skip

    for spec, every in (("kl:1e-3", 1), ("argmax:1", 3), ("kl:3e-3", 2)):
        rule = ExitRule.parse(spec, min_steps=2, check_every=every)
        eager, compiled = run(rule), run(rule, counter)
        assert len(set(eager.steps_per_token[:, 1:].flatten().tolist())) > 1  # rows really stop at different steps
        assert torch.equal(compiled.sequences, eager.sequences)
        assert torch.equal(compiled.steps_per_token, eager.steps_per_token)
        assert torch.equal(run(rule, counter, dict_output=False), eager.sequences)  # recurfit's loop
        if spec == "argmax:1":
            traced = counter.frame_count  # prelude, exit step (kl), exit step (argmax), coda; prompts run eagerly
    assert counter.frame_count == traced == 4
    alone = ids[2:, 2:]  # the padded row, unpadded: a decoder of batch size 1
    single, eager = (
        run(rule, counter, ids=alone, mask=torch.ones_like(alone)),
        run(rule, ids=alone, mask=torch.ones_like(alone)),
    )
    assert torch.equal(single.sequences, eager.sequences)
    assert torch.equal(single.steps_per_token, eager.steps_per_token)


def test_compile_takes_an_exit_rule_and_not_draft_steps():
    assert GenerationSettings(exit="kl:5e-4", exit_check_every=4, compile=True).exit_rule.check_every == 4
    with pytest.raises(RecurfitError, match="--draft-steps"):
        GenerationSettings(draft_steps=2, compile=True)
