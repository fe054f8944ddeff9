"""Decoding beyond plain `generate`: exit specs, the body's output, adaptive depth that skips settled rows,
warm starts, and the generate command's refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import GREEDY_TOKENS, VOCAB, char_tokenizer, close, generate_adaptive, placed, tiny_parent
from conftest import run_cli as run
from transformers import AutoModel
from transformers.utils import ModelOutput

import recurfit
from recurfit.generation import ExitRule, GenerationSettings, generate_text
from recurfit.model.cache import RecurrentCache


def model_with_state(family: str = "llama", shape=(2, 2, 2), **kwargs):
    """A retrofit whose adapter reads the state (random init) and whose s_0 is zeros (deterministic)."""
    torch.manual_seed(0)
    kwargs = {"adapter_init": "random", "state_init_std": 0.0, **kwargs}
    return recurfit.retrofit(tiny_parent(family), shape, **kwargs).eval()


def prompts(batch=2, length=11, seed=0):
    ids = placed(torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)))
    mask = torch.ones_like(ids)
    mask[1:, :4] = 0  # left padding
    return ids, mask


# ---------------------------------------------------------------- exit specs


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


# ---------------------------------------------------------------- the body


def test_auto_model_returns_a_model_output_with_the_depth_run(tmp_path):
    model = model_with_state(mean_recurrence=3)
    model.save_pretrained(tmp_path)
    body = placed(AutoModel.from_pretrained(tmp_path))
    assert isinstance(body, recurfit.RecurrentModel)
    ids = prompts()[0]
    with torch.no_grad():
        out = body(ids)
        expected = model(ids, output_hidden_states=True)
    assert isinstance(out, ModelOutput)
    assert out.num_steps == (0, 3) and out.steps_per_token.tolist() == [3, 3]  # the model's mean recurrence
    torch.testing.assert_close(model.lm_head(out.last_hidden_state), expected.logits, **close(1.3e-6, 1e-5))


# ---------------------------------------------------------------- adaptive depth saves compute


def core_rows(model) -> list[int]:
    """Records the batch size of every call to the first core layer."""
    calls: list[int] = []
    model.model.core[0].register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(args[0].shape[0]), with_kwargs=True
    )
    return calls


def test_adaptive_batch_runs_the_core_only_on_rows_still_recurring():
    """A batch's core compute is the sum of its rows' depths, not batch × the deepest row's."""
    model = model_with_state("qwen3")
    ids, mask = prompts(batch=3)
    calls = core_rows(model)
    depths = generate_adaptive(model, ids, mask, "kl", threshold=1e-3).steps_per_token
    assert len(set(depths[:, 1:].flatten().tolist())) > 1  # rows really stop at different steps
    assert sum(calls) == depths.sum().item()  # prefill: 3 rows × 12 steps, then each row its own depth


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


# ---------------------------------------------------------------- warm starts


def test_warm_start_starts_each_token_from_the_previous_final_state():
    model = model_with_state("llama")
    ids = prompts(batch=1)[0]
    kwargs = dict(
        max_new_tokens=4, do_sample=False, num_steps=3, pad_token_id=0, return_dict_in_generate=True, output_logits=True
    )
    warm, cold = model.generate(ids, warm_start=True, **kwargs), model.generate(ids, **kwargs)
    cache, logits = RecurrentCache(model.config), []
    with torch.no_grad():
        out = model(ids, num_steps=3, past_key_values=cache, output_hidden_states=True)
        for _ in range(4):
            logits.append(out.logits[:, -1].float())  # generate returns its logits in float32
            token = logits[-1].argmax(-1, keepdim=True)
            previous = out.hidden_states[-1][:, -1:]  # s_r of the last position
            out = model(token, num_steps=3, past_key_values=cache, initial_state=previous, output_hidden_states=True)
    torch.testing.assert_close(torch.stack(warm.logits), torch.stack(logits), **close(1.3e-6, 1e-5))
    assert (warm.logits[-1] - cold.logits[-1]).abs().max() > 1e-3  # the state matters here: the test has teeth


@pytest.mark.cpu_only("drives lm-eval, which the GPU machine of the suite does not have")
def test_warm_start_runs_in_the_cli_and_lm_eval(workspace, tmp_path, capsys):
    from lm_eval.api.instance import Instance

    from recurfit.evaluate.lm import RecurfitLM

    code, _ = run(capsys, "retrofit", "--model", workspace / "parent", "--shape", "2,2,2", "--out", tmp_path / "rec")
    assert code == 0
    code, text = run(
        capsys,
        "generate",
        tmp_path / "rec",
        "--prompt",
        "the cat",
        "--recurrence",
        "4",
        "--warm-start",
        "--exit",
        "argmax:1",
        "--max-new-tokens",
        "4",
    )
    assert code == 0 and "4 tokens in" in text
    lm = RecurfitLM(
        pretrained=model_with_state(),
        tokenizer=char_tokenizer(),
        batch_size=2,
        num_steps=3,
        state_init="previous",
        exit="argmax:2",
    )
    request = Instance("generate_until", doc={}, arguments=("the cat", {"until": ["."], "max_gen_toks": 5}), idx=0)
    assert isinstance(lm.generate_until([request])[0], str)
    assert lm.exit_rule == ExitRule("argmax", patience=2) and lm.get_model_info()["state_init"] == "previous"


# ---------------------------------------------------------------- the generate command's refusals


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recurrence", "0"], "--recurrence must be between 1 and 1024"),
        (["-r", "100000"], "--recurrence must be between 1 and 1024"),
        (["--prompt", ""], "The prompt is empty"),
        (["--prompt", "  "], "The prompt is empty"),
    ],
)
def test_generate_refuses_bad_settings_in_one_line(workspace, capsys, argv, message):
    argv = argv if "--prompt" in argv else ["--prompt", "the cat", *argv]
    code, text = run(capsys, "generate", workspace / "parent", *argv, "--max-new-tokens", "2")
    assert code == 2 and message in text and "Traceback" not in text


# ---------------------------------------------------------------- self-speculative decoding


@pytest.mark.float32_only(GREEDY_TOKENS)
def test_speculative_greedy_equals_plain_greedy_at_the_full_recurrence(family):
    from recurfit.generation.speculative import speculative_generate

    model = model_with_state(family)
    with torch.no_grad():
        model.model.adapter.weight[:, :64] *= 0.1  # a state that settles: shallow drafts are sometimes right
    ids, mask = prompts(length=9)  # the drafts run past the sliding windows (5), which the rollback must handle
    plain = model.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_steps=6, pad_token_id=0, eos_token_id=None
    )
    fast = speculative_generate(model, ids, mask, max_new_tokens=10, num_steps=6, draft_steps=1, lookahead=3)
    assert torch.equal(fast.sequences, plain)
    assert 0 < fast.acceptance_rate < 1  # some drafts kept, some rolled back: both paths ran


def test_speculative_decoding_stops_rows_at_eos_as_generate_does():
    from recurfit.generation.speculative import speculative_generate

    model = model_with_state("qwen2")
    ids, mask = prompts(length=9)
    kwargs = dict(max_new_tokens=10, do_sample=False, num_steps=6, pad_token_id=0)
    eos = int(model.generate(ids, attention_mask=mask, eos_token_id=None, **kwargs)[0, -7])  # row 0's 4th new token
    plain = model.generate(ids, attention_mask=mask, eos_token_id=eos, **kwargs)
    fast = speculative_generate(
        model, ids, mask, max_new_tokens=10, num_steps=6, draft_steps=1, lookahead=4, eos_token_id=eos
    )
    assert torch.equal(fast.sequences[:, : plain.shape[1]], plain) and (plain[0, -6:] == 0).all()


def test_speculative_accept_ratio_keeps_more_drafts():
    from recurfit.generation.speculative import speculative_generate

    model = model_with_state("llama")
    ids, mask = prompts(length=9)
    exact = speculative_generate(model, ids, mask, max_new_tokens=12, num_steps=6, draft_steps=1, lookahead=4)
    loose = speculative_generate(
        model, ids, mask, max_new_tokens=12, num_steps=6, draft_steps=1, lookahead=4, accept_ratio=1e-6
    )
    assert loose.acceptance_rate == 1.0 > exact.acceptance_rate


def test_generate_command_decodes_speculatively(workspace, tmp_path, capsys):
    code, _ = run(capsys, "retrofit", "--model", workspace / "parent", "--shape", "2,2,2", "--out", tmp_path / "rec")
    code, text = run(
        capsys,
        "generate",
        tmp_path / "rec",
        "--prompt",
        "the cat",
        "--recurrence",
        "4",
        "--draft-steps",
        "1",
        "--lookahead",
        "3",
        "--max-new-tokens",
        "6",
    )
    assert code == 0 and "of drafted tokens accepted" in text
    model, ids = model_with_state(), torch.tensor([[5, 6, 7, 8]])
    plain = generate_text(model, char_tokenizer(), ids, GenerationSettings(recurrence=4, max_new_tokens=8))
    fast = generate_text(
        model, char_tokenizer(), ids, GenerationSettings(recurrence=4, max_new_tokens=8, draft_steps=2)
    )
    assert fast.text == plain.text and fast.tokens == plain.tokens and 0 <= fast.acceptance_rate <= 1
    code, text = run(capsys, "generate", tmp_path / "rec", "--prompt", "the cat", "--draft-steps", "1", "--exit", "kl")
    assert code == 2 and "--draft-steps (speculative decoding) is greedy" in text
