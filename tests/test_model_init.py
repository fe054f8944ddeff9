"""Tests of `recurfit/model/init.py`."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_parent

import recurfit
from recurfit.model.init import scaled_init_
from recurfit.surgery.retrofit import retrofit


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_torch_default_adapter_is_nn_linears_own_draw_from_the_seed():
    # The authors' conversions never write the adapter, so it keeps nn.Linear's default Kaiming-uniform draw.
    parent = tiny_parent("llama")
    hidden = parent.config.hidden_size
    model = recurfit.retrofit(parent, shape=(1, 2, 1), adapter_init="torch-default", seed=7)
    torch.manual_seed(7)
    reference = torch.nn.Linear(2 * hidden, hidden, bias=False)
    assert torch.equal(model.model.adapter.weight, reference.weight)
    other = recurfit.retrofit(tiny_parent("llama"), shape=(1, 2, 1), adapter_init="torch-default", seed=8)
    assert not torch.equal(other.model.adapter.weight, reference.weight)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.parametrize("adapter_init", ["torch-default", "random"])
def test_the_adapter_is_the_same_draw_under_a_default_device_context(adapter_init):
    """The adapter is drawn on the CPU (its generator's device) whatever device a context makes the default, as a
    parent built on a GPU under `with torch.device("cuda")` has it: the meta device stands in for the GPU here."""
    parent = tiny_parent("llama")
    plain = recurfit.retrofit(parent, shape=(1, 2, 1), adapter_init=adapter_init, seed=3)
    with torch.device("meta"):
        under = recurfit.retrofit(parent, shape=(1, 2, 1), adapter_init=adapter_init, seed=3)
    assert torch.equal(under.model.adapter.weight, plain.model.adapter.weight)
    assert under.model.rotary_emb.inv_freq.device.type == "cpu"  # the weights' device, not the context's


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_the_scaled_init_gives_the_glu_linear_half_the_depth_scaled_std():
    model = retrofit(tiny_parent("llama", num_layers=6, hidden_size=256, intermediate_size=512), (2, 2, 2))
    model.config.mean_recurrence = 8
    scaled_init_(model, torch.Generator().manual_seed(0))
    std = math.sqrt(2 / (5 * 256))
    small = std / math.sqrt(2 * (2 + 8 * 2 + 2))
    mlp = model.model.core[0].mlp
    truncated = 0.9866  # the std of a normal cut at ±3σ, in units of σ
    assert abs(mlp.gate_proj.weight.std().item() - std * truncated) < 0.05 * std
    for weight in (mlp.up_proj.weight, mlp.down_proj.weight, model.model.core[0].self_attn.o_proj.weight):
        assert weight.abs().max() <= 3 * small + 1e-7
        assert abs(weight.std().item() - small * truncated) < 0.05 * small


def test_scaled_init_statistics():
    from recurfit import retrofit
    from recurfit.model.init import scaled_init_

    model = scaled_init_(
        retrofit(tiny_parent("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4), (2, 2, 2))
    )
    std = math.sqrt(2 / (5 * 256))
    depth = 2 + model.config.mean_recurrence * 2 + 2
    q = model.model.core[0].self_attn.q_proj.weight
    down = model.model.core[0].mlp.down_proj.weight
    assert q.std().item() == pytest.approx(std, rel=0.05) and q.abs().max() <= 3 * std + 1e-6
    assert down.std().item() == pytest.approx(std / math.sqrt(2 * depth), rel=0.05)
    assert torch.all(model.model.norm.weight == 1)
