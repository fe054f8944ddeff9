"""Tests of `recurfit/cli/generate.py`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import (
    GREEDY_TOKENS,
    char_tokenizer,
    model_with_state,
    run_cli,
)
from conftest import run_cli as run

import recurfit
import recurfit.generation
from recurfit.cli import console, main
from recurfit.generation import ExitRule, GenerationSettings, generate_text


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.float32_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_generate_streams_and_reports_depth(workspace, tmp_path, capsys):
    code, _ = run(capsys, "retrofit", "--model", workspace / "parent", "--shape", "2,2,2", "--out", tmp_path / "rec")
    assert code == 0
    code, text = run(
        capsys, "generate", tmp_path / "rec", "--prompt", "the cat", "-r", "3", "--max-new-tokens", "5", "--stream"
    )
    assert code == 0 and "5 tokens in" in text and "mean 3.0 (min 3, max 3)" in text
    with pytest.raises(SystemExit) as refused:  # the old name of --recurrence is gone (a usage error)
        main(["generate", str(tmp_path / "rec"), "--prompt", "the cat", "--steps", "3"])
    assert refused.value.code == 2 and "unrecognized arguments: --steps" in capsys.readouterr().err
    code, text = run(
        capsys,
        "generate",
        tmp_path / "rec",
        "--prompt",
        "the cat",
        "-r",
        "6",
        "--exit",
        "state:1e9",
        "--max-new-tokens",
        "4",
    )
    assert code == 0 and "(min 2, max 6)" in text  # the prompt runs 6 steps, each new token exits at min-steps 2
    code, text = run(capsys, "generate", tmp_path / "rec", "--prompt", "x", "--exit", "entropy:1")
    assert code == 2 and "--exit takes CRITERION" in text


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.float32_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_ctrl_c_in_chat_stops_the_answer_and_the_chat_goes_on(workspace, capsys, monkeypatch):
    lines = iter(["first question", "second question", ""])
    monkeypatch.setattr(console, "input", lambda prompt="": next(lines))
    asked = []

    def generate_text(model, tokenizer, ids, settings, stream=False):
        asked.append(tokenizer.decode(ids[0]).replace(" ", ""))  # a character tokenizer: "s e c o n d"
        if len(asked) == 1:
            raise KeyboardInterrupt
        return SimpleNamespace(text="an answer", tokens=2, seconds=1.0, steps_per_token=[], acceptance_rate=None)

    monkeypatch.setattr(recurfit.generation, "generate_text", generate_text)
    code, text = run_cli(capsys, "chat", workspace / "parent")
    assert code == 0 and "stopped" in text and "2 tokens in 1.0 s" in text
    assert "secondquestion" in asked[1] and "firstquestion" not in asked[1]
    assert text.count("This tokenizer has no chat template: the messages go in as plain text.") == 1


def completion_and_chat_tokenizer():
    """The character tokenizer with what real ones have: a BOS added to plain text (`add_special_tokens`) and a
    chat template that writes its own BOS."""
    from tokenizers import processors

    tokenizer = char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = "<s>{% for m in messages %}question {{ m['content'] }}\n{% endfor %}answer "
    return tokenizer


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.float32_only(GREEDY_TOKENS)
def test_generate_continues_the_raw_prompt_as_a_vllm_completion_and_chat_wraps_it(tmp_path, capsys, monkeypatch):
    model, tokenizer = model_with_state(), completion_and_chat_tokenizer()
    model.save_pretrained(tmp_path / "rec")
    tokenizer.save_pretrained(tmp_path / "rec")
    seen = []

    def spy(model, tokenizer, ids, settings, stream=False):
        seen.append((ids[0].tolist(), generate_text(model, tokenizer, ids, settings, stream)))
        return seen[-1][1]

    monkeypatch.setattr(recurfit.generation, "generate_text", spy)
    argv = ("generate", tmp_path / "rec", "--prompt", "the cat", "-r", "3", "--max-new-tokens", "6")
    assert run(capsys, *argv)[0] == 0
    # vLLM's /v1/completions encodes a prompt with `tokenizer.encode(prompt, add_special_tokens=True)` (the
    # request's default), so the server's completion of "the cat" at r = 3 starts from these ids and is greedy.
    completion = tokenizer.encode("the cat", add_special_tokens=True)
    assert completion[0] == tokenizer.bos_token_id and seen[0][0] == completion
    expected = model.generate(
        torch.tensor([completion]), num_steps=3, max_new_tokens=6, do_sample=False, pad_token_id=0
    )[0, len(completion) :]
    assert seen[0][1].text == tokenizer.decode(expected, skip_special_tokens=True).strip()

    # With the chat template: the prompt as a user message, one BOS (the template's), as /v1/chat/completions.
    assert run(capsys, *argv, "--chat-template", "on")[0] == 0
    chat = tokenizer.decode(seen[1][0])
    assert chat.replace(" ", "").startswith("<s>questionthecat\nanswer") and chat.count("<s>") == 1
    with pytest.raises(SystemExit) as refused:
        main([str(a) for a in argv] + ["--chat-template", "auto"])
    assert refused.value.code == 2 and "invalid choice: 'auto'" in capsys.readouterr().err


@pytest.mark.cpu_only("drives lm-eval, which the GPU check's machine does not have")
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


@pytest.mark.float32_only(GREEDY_TOKENS)
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
