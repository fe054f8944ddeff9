"""Layer selection: the paper's rule, explicit indices, ShortGPT, bad specs, meta-device parents."""

import pytest
import torch
from conftest import tiny_parent, token_batch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import recurfit
from recurfit.surgery.layer_scores import block_influence
from recurfit.surgery.selection import LayerSelection


def test_paper_rule_reproduces_the_papers_layer_choices():
    assert LayerSelection.paper_rule((4, 8, 4), 22).as_dict() == {
        "prelude": [0, 1, 2, 3],
        "core": list(range(10, 18)),
        "coda": [18, 19, 20, 21],
    }
    assert LayerSelection.paper_rule((2, 4, 2), 22).as_dict() == {
        "prelude": [0, 1],
        "core": [16, 17, 18, 19],
        "coda": [20, 21],
    }
    assert LayerSelection.paper_rule((6, 10, 6), 22).kept == list(range(22))
    assert LayerSelection.paper_rule((4, 6, 4), 16).as_dict() == {
        "prelude": [0, 1, 2, 3],
        "core": list(range(6, 12)),
        "coda": [12, 13, 14, 15],
    }
    assert LayerSelection.paper_rule((4, 8, 4), 22).dropped(22) == [4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prelude=[0, 1], core=[1, 2], coda=[5]), "Layer 1 is in both prelude and core"),
        (dict(prelude=[0], core=[2, 3], coda=[9]), r"out of range: the parent has 6 layers"),
        (dict(prelude=[0], core=[3, 2], coda=[5]), "strictly increasing"),
        (dict(prelude=[0], core=[], coda=[5]), "core is empty"),
        (dict(shape=(3, 3, 3)), "needs 9 layers but the parent has only 6"),
        (dict(shape=(1, 0, 1)), "core of at least 1 layer"),
        (dict(shape=(-1, 2, 1)), "non-negative"),
        (dict(shape=(1, 2)), "three integers"),
        (dict(shape=(1, 2, 1), core=[2, 3]), "not both"),
        (dict(), "Give shape"),
        (dict(shape=(1, 2, 1), select="random"), "select must be one of"),
        (dict(shape=(1, 2, 1), adapter="mlp"), "adapter must be one of"),
        (dict(shape=(1, 2, 1), adapter_init="zeros"), "adapter_init must be one of"),
        (dict(shape=(1, 2, 1), state_init_std=-1.0), "state_init_std must be >= 0"),
        (dict(shape=(1, 2, 1), select="shortgpt"), "calibration token ids"),
    ],
)
def test_bad_specs_raise_a_value_error_naming_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        recurfit.retrofit(tiny_parent("llama"), **kwargs)


def test_unsupported_architecture_names_the_supported_ones():
    config = CONFIG_MAPPING["gpt2"](n_layer=2, n_embd=32, n_head=2, vocab_size=50)
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*supported families are llama .*olmo2"):
        recurfit.retrofit(AutoModelForCausalLM.from_config(config), shape=(0, 1, 1))


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
