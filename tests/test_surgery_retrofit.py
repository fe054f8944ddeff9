"""Tests of `recurfit/surgery/retrofit.py`."""

from __future__ import annotations

import torch
from conftest import tiny_parent, token_batch
from transformers import AutoModelForCausalLM

import recurfit
from recurfit.surgery.pruning import untie_embeddings


def test_untying_keeps_the_outputs_and_lets_the_head_train_on_its_own(tmp_path):
    parent = tiny_parent("llama", tie_word_embeddings=True)
    assert parent.lm_head.weight is parent.model.embed_tokens.weight
    ids = token_batch()
    before = parent(ids).logits
    untie_embeddings(parent)
    assert parent.lm_head.weight is not parent.model.embed_tokens.weight
    assert torch.equal(parent(ids).logits, before)
    parent.lm_head.weight.data.add_(1.0)
    assert not torch.equal(parent.lm_head.weight, parent.model.embed_tokens.weight)
    parent.save_pretrained(tmp_path / "untied")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "untied")
    assert not reloaded.config.tie_word_embeddings
    assert torch.equal(reloaded.lm_head.weight, parent.lm_head.weight)
    assert torch.equal(reloaded.model.embed_tokens.weight, parent.model.embed_tokens.weight)


def test_a_saved_retrofit_names_no_local_folder_as_its_parent(workspace, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from recurfit import retrofit
    from recurfit.io.assets import EMBEDDED_HUB_ID

    local = AutoModelForCausalLM.from_pretrained(workspace / "parent")
    assert retrofit(local, (2, 2, 2)).config.parent_name_or_path is None
    monkeypatch.setenv("RECURFIT_CACHE", str(tmp_path / "cache"))
    local.save_pretrained(tmp_path / "cache" / "smollm2-135m-instruct")  # where the embedded model is converted
    embedded = AutoModelForCausalLM.from_pretrained(tmp_path / "cache" / "smollm2-135m-instruct")
    model = retrofit(embedded, (2, 2, 2))
    assert model.config.parent_name_or_path == EMBEDDED_HUB_ID
    model.save_pretrained(tmp_path / "saved")
    assert str(tmp_path) not in (tmp_path / "saved" / "config.json").read_text()
    local.config.name_or_path = "someone/some-model"
    assert retrofit(local, (2, 2, 2)).config.parent_name_or_path == "someone/some-model"


def test_retrofit_on_the_meta_device_matches_real_weights():
    real = recurfit.retrofit(tiny_parent("olmo2", num_layers=8), shape=(2, 3, 2))
    config = tiny_parent("olmo2", num_layers=8).config
    with torch.device("meta"):
        parent = AutoModelForCausalLM.from_config(config)
    planned = recurfit.retrofit(parent, shape=(2, 3, 2))
    assert all(p.is_meta for p in planned.parameters())
    assert recurfit.count_parameters(planned) == recurfit.count_parameters(real)
    assert planned.config.source_layers == real.config.source_layers


def test_untie_is_the_default_and_tying_is_an_option():
    parent = tiny_parent("llama", tie_word_embeddings=True)
    assert parent.lm_head.weight is parent.model.embed_tokens.weight
    untied = recurfit.retrofit(parent, shape=(1, 2, 1))
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert torch.equal(untied.lm_head.weight, parent.lm_head.weight)
    tied = recurfit.retrofit(parent, shape=(1, 2, 1), untie_embeddings=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_retrofit_copies_weights_instead_of_sharing_them():
    parent = tiny_parent("llama")
    model = recurfit.retrofit(parent, shape=(1, 2, 1))
    before = parent.model.layers[0].mlp.up_proj.weight.clone()
    with torch.no_grad():
        model.model.prelude[0].mlp.up_proj.weight.add_(1.0)
    assert torch.equal(parent.model.layers[0].mlp.up_proj.weight, before)
