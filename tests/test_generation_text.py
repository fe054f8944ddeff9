"""Decoding beyond plain `generate`: exit specs, the body's output, adaptive depth that skips settled rows,
warm starts, and the generate command's refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    model_with_state,
    prompts,
)
from conftest import run_cli as run

from recurfit.model.cache import RecurrentCache
from recurfit.model.compat import cache_kwargs


@pytest.mark.float32_only(
    "warm and cold starts differ by 0.006-0.016 in this tiny model's logits (measured), below bf16's logit "
    "tolerance (0.1): in bf16 the check could not tell a warm start from an ignored one"
)
def test_warm_start_starts_each_token_from_the_previous_final_state():
    model = model_with_state("llama")
    ids = prompts(batch=1)[0]
    kwargs = dict(
        max_new_tokens=4, do_sample=False, num_steps=3, pad_token_id=0, return_dict_in_generate=True, output_logits=True
    )
    warm, cold = model.generate(ids, warm_start=True, **kwargs), model.generate(ids, **kwargs)
    cache, logits = RecurrentCache(model.config), []
    with torch.no_grad():
        out = model(ids, num_steps=3, **cache_kwargs(cache), output_hidden_states=True)
        for _ in range(4):
            logits.append(out.logits[:, -1].float())  # generate returns its logits in float32
            token = logits[-1].argmax(-1, keepdim=True)
            previous = out.hidden_states[-1][:, -1:]  # s_r of the last position
            out = model(token, num_steps=3, **cache_kwargs(cache), initial_state=previous, output_hidden_states=True)
    torch.testing.assert_close(torch.stack(warm.logits), torch.stack(logits), rtol=1.3e-6, atol=1e-5)
    # The state matters here (0.014 at the last token, measured), 100 times the check's atol: the test has teeth
    assert (warm.logits[-1] - cold.logits[-1]).abs().max() > 1e-3


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
