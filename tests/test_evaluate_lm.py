"""Tests of `recurfit/evaluate/lm.py`."""

import pytest
import torch
from conftest import (
    _requests,
    char_tokenizer,
    recurrent,
    tiny_parent,
)


def test_lm_eval_loglikelihoods_batched_equal_unbatched_and_depend_on_r(lm_pair):
    pairs = [("the cat sat", " on the mat"), ("a", " dog ran far and then"), ("big red tree", "."), ("x", " y")]
    batched = lm_pair(4).loglikelihood(_requests("loglikelihood", pairs))
    alone = lm_pair(1).loglikelihood(_requests("loglikelihood", pairs))
    for (a, greedy_a), (b, greedy_b) in zip(batched, alone):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
    shallow = lm_pair(4)
    shallow.num_steps = 1
    assert any(
        abs(a[0] - b[0]) > 1e-3 for a, b in zip(shallow.loglikelihood(_requests("loglikelihood", pairs)), batched)
    )


def test_lm_eval_generation_batched_equals_unbatched(lm_pair):
    prompts = [
        ("the cat", {"until": ["."], "max_gen_toks": 6, "do_sample": False}),
        ("a big red tree and then", {"until": ["."], "max_gen_toks": 6, "do_sample": False}),
        ("x", {"until": ["."], "max_gen_toks": 6, "do_sample": False}),
    ]
    batched = lm_pair(3).generate_until(_requests("generate_until", prompts))
    alone = lm_pair(1).generate_until(_requests("generate_until", prompts))
    assert batched == alone and all(isinstance(text, str) for text in batched)


def test_lm_eval_compiled_generation_equals_eager(lm_pair):
    prompts = [
        ("the cat", {"until": ["."], "max_gen_toks": 6, "do_sample": False}),
        ("a big red tree and then", {"until": ["."], "max_gen_toks": 6, "do_sample": False}),
    ]
    # "eager": torch.compile's tracing without inductor, so the test checks the static-cache path and the compiled
    # step's plumbing quickly (inductor itself: tests/test_model_compiled.py)
    compiled = lm_pair(2, compile="eager").generate_until(_requests("generate_until", prompts))
    assert compiled == lm_pair(2).generate_until(_requests("generate_until", prompts))


def test_lm_eval_compiled_generation_under_an_exit_rule_equals_eager():
    """compile=true with exit: the token ids lm-eval's generation gets equal eager decoding's under the same rule,
    and differ from the fixed depth's (at r = 16, argmax:1 stops rows early enough to change the tiny model's
    tokens), so the rule reaches the compiled decoder. Token ids, not text: most of the tiny model's 97 ids are
    outside the character tokenizer's 46, which decode to nothing."""
    from recurfit.evaluate.lm import RecurfitLM

    model, tokenizer = recurrent(state_init_std=0.0), char_tokenizer()
    context = torch.tensor([[4, 5, 6, 7, 8], [9, 10, 11, 12, 13]])

    def generated(**kwargs) -> torch.Tensor:
        lm = RecurfitLM(pretrained=model, tokenizer=tokenizer, batch_size=2, num_steps=16, **kwargs)
        return lm._model_generate(context, 13, stop=["@@@"], attention_mask=torch.ones_like(context), do_sample=False)

    compiled = generated(exit="argmax:1", compile="eager")
    assert torch.equal(compiled, generated(exit="argmax:1")) and not torch.equal(compiled, generated())


def test_lm_eval_runs_a_fixed_depth_parent_without_num_steps():
    from recurfit.evaluate.lm import RecurfitLM

    lm = RecurfitLM(pretrained=tiny_parent("llama"), tokenizer=char_tokenizer(), batch_size=2, num_steps=4)
    assert not lm.recurrent
    ((logprob, _),) = lm.loglikelihood(_requests("loglikelihood", [("the cat", " sat")]))
    assert logprob < 0


def test_add_bos_token_prepends_bos_as_hflm_does_with_a_tokenizer_it_loads_by_name(saved):
    """The authors' `add_bos_token=True`: HFLM passes it to AutoTokenizer.from_pretrained, which then prepends BOS;
    a tokenizer given as an object HFLM would use as it is, so RecurfitLM applies the flag to a copy."""
    from lm_eval.models.huggingface import HFLM

    from recurfit.evaluate.lm import RecurfitLM

    tokenizer = char_tokenizer()
    text = "the cat sat"
    assert tokenizer(text)["input_ids"][0] != tokenizer.bos_token_id  # this tokenizer adds no BOS by itself
    by_name = HFLM(pretrained=str(saved / "parent"), add_bos_token=True, device="cpu", batch_size=1)
    ours = RecurfitLM(pretrained=recurrent(), tokenizer=tokenizer, batch_size=1, add_bos_token=True)
    expected = [tokenizer.bos_token_id, *tokenizer(text)["input_ids"]]
    assert by_name.tok_encode(text) == ours.tok_encode(text) == expected
    assert ours.tok_batch_encode([text])[0][0].tolist() == by_name.tok_batch_encode([text])[0][0].tolist() == expected
    assert tokenizer(text)["input_ids"] == expected[1:]  # the caller's tokenizer is left as it was
    plain = RecurfitLM(pretrained=recurrent(), tokenizer=tokenizer, batch_size=1)
    assert plain.tok_encode(text) == expected[1:]


def test_lm_eval_requests_advance_recurfits_bar_and_lm_evals_bars_stay_off(lm_pair, monkeypatch, capsys):
    from recurfit.progress import progress_bar

    monkeypatch.setenv("TQDM_DISABLE", "1")  # as `recurfit` without --verbose sets it
    monkeypatch.setenv("RECURFIT_PROGRESS_EVERY", "1")
    lm = lm_pair(2)
    pairs = [("the cat sat", " on the mat"), ("a", " dog"), ("big red tree", "."), ("x", " y")]
    prompts = [("the cat", {"until": ["."], "max_gen_toks": 3, "do_sample": False})] * 2
    with progress_bar() as bar:  # captured output is not a terminal: plain lines
        lm.progress = (bar, "model at r=3")
        lm.loglikelihood(_requests("loglikelihood", pairs))
        lm.generate_until(_requests("generate_until", prompts))
    said = capsys.readouterr()
    lines = [line.split("  ")[0] for line in said.err.splitlines()]
    assert lines == [
        *(f"model at r=3: log-likelihood requests: {i}/4 ({i / 4:.0%})" for i in range(1, 5)),
        *(f"model at r=3: generation requests: {i}/2 ({i / 2:.0%})" for i in range(1, 3)),
    ]
    assert "Running generate_until requests" not in said.err and "it/s]" not in said.err  # no bar of lm-eval's


def test_lm_eval_model_type_refuses_to_run_a_folders_code(folders):
    from recurfit.evaluate.lm import RecurfitLM

    with pytest.raises(ValueError, match="own code"):
        RecurfitLM(pretrained=str(folders / "raven"), trust_remote_code=True)
    assert not (folders / "marker").exists()
