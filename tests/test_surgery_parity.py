"""A retrofitted model with the identity adapter is the parent with the dropped layers removed, exactly."""

import pytest
import torch
from conftest import FAMILIES, PLACEMENT, control_margin, placed, pruned, tiny_parent, token_batch, tolerance

import recurfit

TOLERANCE = 1e-5  # fp32; reusing the family's own layers gives 0.0 in practice (bf16: conftest.tolerance)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("num_steps", [1, 32])
def test_identity_adapter_equals_pruned_parent(family, num_steps):
    parent = tiny_parent(family, num_layers=7)
    model = recurfit.retrofit(parent, shape=(2, 2, 1))
    assert model.config.source_layers == {"prelude": [0, 1], "core": [4, 5], "coda": [6]}
    ids = token_batch(length=12)
    with torch.no_grad():
        expected = pruned(parent, [0, 1, 4, 5, 6])(ids).logits
        got = model(ids, num_steps=num_steps).logits
    assert max_diff(got, expected) <= tolerance(TOLERANCE)


def test_keeping_every_layer_equals_the_parent(family):
    parent = tiny_parent(family, num_layers=6)
    model = recurfit.retrofit(parent, shape=(2, 3, 1))
    ids = token_batch()
    with torch.no_grad():
        assert max_diff(model(ids, num_steps=4).logits, parent(ids).logits) <= tolerance(TOLERANCE)


def test_explicit_indices_match_the_paper_rule():
    parent = tiny_parent("llama", num_layers=8)
    by_rule = recurfit.retrofit(parent, shape=(2, 3, 2))
    explicit = recurfit.retrofit(parent, prelude=[0, 1], core=[3, 4, 5], coda=[6, 7])
    assert by_rule.config.source_layers == explicit.config.source_layers
    for (name, a), (_, b) in zip(by_rule.state_dict().items(), explicit.state_dict().items()):
        assert torch.equal(a, b), name


def test_add_adapter_with_zero_state_equals_pruned_parent_at_one_step():
    parent = tiny_parent("llama")
    model = recurfit.retrofit(parent, shape=(2, 2, 1), adapter="add", state_init_std=0.0)
    ids = token_batch()
    with torch.no_grad():
        expected = pruned(parent, [0, 1, 3, 4, 5])(ids).logits
        assert max_diff(model(ids, num_steps=1).logits, expected) <= tolerance(TOLERANCE)
        # From the second step on, s + e feeds the state back: no longer the pruned parent (0.47 in float32 and
        # bf16, measured), by more than the check above allows.
        assert max_diff(model(ids, num_steps=2).logits, expected) > control_margin(TOLERANCE)


def test_untrained_retrofit_ignores_the_random_state():
    """Identity adapter: the output does not depend on s_0 nor on r, so every depth gives the same logits."""
    model = recurfit.retrofit(tiny_parent("qwen3"), shape=(2, 2, 2))
    ids = token_batch()
    with torch.no_grad():
        logits = [model(ids, num_steps=r).logits for r in (1, 3, 8)]
    assert all(max_diff(x, logits[0]) == 0.0 for x in logits)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "olmo3"])
def test_left_padded_batch_equals_each_sequence_alone(model_type):
    """With a trained-like (random) adapter and a zero state the state matters, and padding must not leak."""
    parent = tiny_parent(model_type)
    model = recurfit.retrofit(parent, shape=(2, 2, 1), adapter_init="random", state_init_std=0.0)
    lengths = [12, 7, 3]
    rows = [token_batch(1, n, seed=n)[0] for n in lengths]
    ids = placed(torch.zeros(len(rows), max(lengths), dtype=torch.long))
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, -len(row) :], mask[i, -len(row) :] = row, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, num_steps=4).logits
        for i, row in enumerate(rows):
            alone = model(row[None], num_steps=4).logits[0]
            assert max_diff(batched[i, -len(row) :], alone) <= tolerance(TOLERANCE)


@pytest.mark.parametrize("implementation", ["sdpa", "flex_attention"])
@pytest.mark.parametrize("model_type", ["olmo2", "mistral"])  # mistral: a sliding window shorter than the batch
def test_attention_implementations_agree(implementation, model_type):
    parent = tiny_parent(model_type)
    model = recurfit.retrofit(parent, shape=(2, 2, 2), adapter_init="random", state_init_std=0.0)
    ids = token_batch()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=mask, num_steps=3).logits
        model.set_attn_implementation(implementation)
        other = model(ids, attention_mask=mask, num_steps=3).logits
    real = mask.bool()
    assert max_diff(eager[real], other[real]) <= tolerance(1e-4)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_attention_gets_queries_keys_and_values_of_one_dtype_in_low_precision(model_type, monkeypatch):
    """A bf16 retrofit keeps its stream in float32 while its products run in bf16 (it autocasts itself): RoPE must
    not turn queries and keys into float32 beside bf16 values, or flex_attention (which autocast does not cover)
    gets two dtypes, which on CUDA gave logits 0.3-0.7 off for the families whose RoPE keeps the cos/sin dtype
    (Llama, Mistral, Qwen3; OLMo's casts back and was right). Every attention call gets one dtype, the products'.
    (Training runs SDPA, whose inputs autocast casts to one dtype.)"""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    flex = ALL_ATTENTION_FUNCTIONS["flex_attention"]
    seen = set()

    def recorded(module, query, key, value, *args, **kwargs):
        seen.add((query.dtype, key.dtype, value.dtype))
        return flex(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flex_attention", recorded)
    model = recurfit.retrofit(tiny_parent(model_type), shape=(2, 2, 2), adapter_init="random", state_init_std=0.0)
    model.set_attn_implementation("flex_attention")
    model.to(torch.bfloat16)
    ids = token_batch()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask, num_steps=3)
    assert seen == {(torch.bfloat16,) * 3}, seen


def test_the_tests_models_and_tokens_are_where_the_options_put_them():
    """Under --device/--dtype the tests above must really run there, not silently on the CPU in float32."""
    parent = tiny_parent("llama")
    model = recurfit.retrofit(parent, shape=(2, 2, 1))
    assert {p.device for p in model.parameters()} == {PLACEMENT.device} == {token_batch().device}
    assert {p.dtype for p in model.parameters()} == {PLACEMENT.dtype}
