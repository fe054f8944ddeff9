"""Layer selection: the paper's rule, explicit indices, ShortGPT, bad specs, meta-device parents."""

import pytest
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import recurfit


def test_unsupported_architecture_names_the_supported_ones():
    config = CONFIG_MAPPING["gpt2"](n_layer=2, n_embd=32, n_head=2, vocab_size=50)
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*supported families are llama .*olmo2"):
        recurfit.retrofit(AutoModelForCausalLM.from_config(config), shape=(0, 1, 1))
