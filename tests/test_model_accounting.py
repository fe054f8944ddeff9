"""Tests of `recurfit/model/accounting.py`."""

import math

import pytest
import torch
from conftest import tiny_parent, token_batch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import recurfit
from recurfit.model.accounting import paper_ramp
from recurfit.model.sampling import Curriculum

# Public configs of the paper's parents.
PARENTS = {
    "tinyllama": (
        "llama",
        dict(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        ),
    ),
    "llama-3.2-1b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=True,
        ),
    ),
    "olmo-2-0425-1b": (
        "olmo2",
        dict(
            vocab_size=100352,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            tie_word_embeddings=False,
        ),
    ),
}


def meta_parent(name: str, **overrides):
    model_type, kwargs = PARENTS[name]
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**{**kwargs, **overrides}))


@pytest.mark.parametrize(
    "name, overrides, embeddings, body",
    [
        ("tinyllama", {}, 131_072_000, 968_976_384),
        ("llama-3.2-1b", {"tie_word_embeddings": False}, 525_336_576, 973_146_112),
        ("olmo-2-0425-1b", {}, 411_041_792, 1_073_874_944),
    ],
)
def test_non_recurrent_parameter_table(name, overrides, embeddings, body):
    counts = recurfit.count_parameters(meta_parent(name, **overrides))
    assert (counts["embeddings"], counts["body"]) == (embeddings, body)


@pytest.mark.parametrize(
    "name, shape, embeddings, body, prelude, core, coda",
    [
        ("tinyllama", (4, 8, 4), 131_072_000, 704_708_608, 176_177_152, 352_354_304, 176_177_152),
        ("tinyllama", (6, 10, 6), 131_072_000, 968_974_336, 264_265_728, 440_442_880, 264_265_728),
        ("tinyllama", (2, 4, 2), 131_072_000, 352_354_304, 88_088_576, 176_177_152, 88_088_576),
        ("llama-3.2-1b", (2, 4, 2), 525_336_576, 486_572_032, 121_643_008, 243_286_016, 121_643_008),
        ("llama-3.2-1b", (4, 6, 4), 525_336_576, 851_501_056, 243_286_016, 364_929_024, 243_286_016),
        ("olmo-2-0425-1b", (4, 6, 4), 411_041_792, 939_638_784, 268_468_224, 402_702_336, 268_468_224),
    ],
)
def test_recurrent_parameter_table(name, shape, embeddings, body, prelude, core, coda):
    counts = recurfit.count_parameters(recurfit.retrofit(meta_parent(name), shape=shape))
    assert (counts["embeddings"], counts["body"]) == (embeddings, body)
    assert (counts["prelude"], counts["core"], counts["coda"]) == (prelude, core, coda)
    assert counts["adapter"] == 2 * 2048 * 2048 and counts["final_norm"] == 2048


def test_effective_parameters_and_the_papers_flop_rule():
    counts = recurfit.count_parameters(recurfit.retrofit(meta_parent("tinyllama"), shape=(4, 8, 4)))
    assert recurfit.effective_parameters(counts, 1) == 704_708_608
    assert recurfit.effective_parameters(counts, 32) == 176_177_152 * 2 + 32 * 352_354_304
    step = counts["core"] + counts["adapter"]
    fixed = counts["prelude"] + counts["coda"] + counts["final_norm"]
    # Mean recurrence 32, backprop depth 8: 8 steps with gradient, 24 without.
    assert recurfit.training_flops(counts, 1000, 32, 8) == 1000 * (6 * (fixed + 8 * step) + 2 * 24 * step)
    # Below the backprop depth every step gets gradient.
    assert recurfit.training_flops(counts, 10, 4, 8) == 10 * 6 * (fixed + 4 * step)
    parent = recurfit.count_parameters(meta_parent("tinyllama"))
    assert recurfit.training_flops(parent, 10) == 10 * 6 * 968_976_384


@pytest.mark.parametrize("num_steps", [1, 3])
def test_inference_flops_match_the_counted_matmuls(num_steps):
    model = recurfit.retrofit(tiny_parent("llama", num_layers=6), shape=(2, 2, 1))
    ids = token_batch(2, 8)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids, num_steps=num_steps)
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = sum(n for op, n in by_op.items() if "attention" in op or "bmm" in op)
    head = 2 * ids.numel() * model.lm_head.weight.numel()
    counted = (counter.get_total_flops() - attention - head) / ids.numel()
    predicted = recurfit.inference_flops_per_token(model, num_steps)
    assert counted == pytest.approx(predicted, rel=0.01)  # the formula also counts norm weights


def test_ceil_rounding_moves_each_ramp_boundary_up_to_the_next_whole_step():
    # W = 6,250, r̄ = 32: depth d ends at d · 195.3125, which floor truncates and ceil rounds up.
    floor = [paper_ramp(step, 32, "linear", 0.25, 25000) for step in range(6300)]
    ceil = [paper_ramp(step, 32, "linear", 0.25, 25000, "ceil") for step in range(6300)]
    assert floor.index(2) == 195 and ceil.index(2) == 196
    assert floor.index(32) == 6054 and ceil.index(32) == 6055 and floor[6250:] == ceil[6250:] == [32] * 50
    # A boundary that falls on a whole step stays there (integer arithmetic, as their ceil_div).
    assert paper_ramp(3124, 32, "linear", 0.25, 25000, "ceil") == 16
    assert paper_ramp(3125, 32, "linear", 0.25, 25000, "ceil") == 17


def test_the_papers_ramp_differs_from_the_run_only_by_rounding():
    # The authors' accounting truncates where their scheduler rounds up: at most one depth apart on the ramp.
    curriculum = Curriculum(32, "linear", math.ceil(0.25 * 25000))
    ramp = [paper_ramp(step, 32, "linear", 0.25, 25000) for step in range(25000)]
    assert all(abs(a - curriculum.at(step)) <= 1 for step, a in enumerate(ramp))
    assert ramp[0] == 1 and ramp.count(1) == int(6250 / 32) and ramp.count(32) == 25000 - int(31 / 32 * 6250)
