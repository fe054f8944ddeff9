"""Tests of `recurfit/surgery/pruning.py`."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import pruned, tiny_parent, token_batch

import recurfit
from recurfit.surgery.layer_scores import block_influence
from recurfit.surgery.pruning import prune_layers


def test_shortgpt_pruning_keeps_the_highest_influence_layers_and_computes_the_pruned_parent(family):
    parent = tiny_parent(family, num_layers=6)
    ids = token_batch(length=10)
    scores = block_influence(parent, ids)
    kept = sorted(sorted(range(6), key=lambda i: -scores[i])[:3])
    reference = pruned(parent, kept)
    model = prune_layers(copy.deepcopy(parent), 3, ids)
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    # Kept layers are renumbered, so the KV cache works: cached greedy decoding equals uncached.
    prompt = ids[:1, :6]
    cached = model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_shortgpt_drops_the_layers_that_do_not_change_the_residual_stream():
    parent = tiny_parent("llama", num_layers=8)
    with torch.no_grad():  # layers 2 and 5 become exact identities: Block Influence 0
        for i in (2, 5):
            parent.model.layers[i].self_attn.o_proj.weight.zero_()
            parent.model.layers[i].mlp.down_proj.weight.zero_()
    ids = token_batch(4, 16)
    scores = block_influence(parent, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert len(scores) == 8 and scores[2] == pytest.approx(0.0, abs=1e-6) and scores[5] == pytest.approx(0.0, abs=1e-6)
    assert min(s for i, s in enumerate(scores) if i not in (2, 5)) > 1e-3
    model = recurfit.retrofit(parent, shape=(2, 3, 1), select="shortgpt", calibration=ids)
    assert model.config.source_layers == {"prelude": [0, 1], "core": [3, 4, 6], "coda": [7]}
