"""Tests of `recurfit/surgery/raven.py`."""

import json
import math

import pytest
import torch
from conftest import (
    assert_never_asked,
    char_tokenizer,
    error_lines,
    raven_folder,
    run_in_terminal,
    tiny_parent,
    token_batch,
    write_raven_checkpoint,
)
from safetensors.torch import save_file

import recurfit
from recurfit.errors import RecurfitError
from recurfit.model.loading import load_tokenizer
from recurfit.surgery.raven import import_raven


def same_logits(imported, original, steps=(1, 3)):
    ids, zero = token_batch(), torch.zeros(2, 12, original.config.hidden_size)
    with torch.no_grad():
        for r in steps:
            expected = original.eval()(ids, num_steps=r, initial_state=zero).logits
            torch.testing.assert_close(imported(ids, num_steps=r, initial_state=zero).logits, expected)


def test_import_keeps_the_checkpoints_special_tokens(tmp_path):
    original = recurfit.retrofit(tiny_parent("llama"), shape=(1, 2, 1), adapter_init="random")
    folder = raven_folder(tmp_path, original, bos_token_id=40, eos_token_id=41, pad_token_id=42)
    imported = import_raven(folder)
    for model in (imported.config.text_config, imported.config, imported.generation_config):
        assert (model.bos_token_id, model.eos_token_id, model.pad_token_id) == (40, 41, 42)
    bare = import_raven(raven_folder(tmp_path, original, name="bare"))
    assert bare.generation_config.eos_token_id is None and bare.config.text_config.bos_token_id is None


def test_import_applies_the_embedding_scale_and_huginns_defaults(tmp_path):
    original = recurfit.retrofit(tiny_parent("llama"), shape=(1, 2, 1), adapter_init="random")
    hidden = original.config.hidden_size
    folder = raven_folder(tmp_path, original, init_values={"std": 0.02, "embed_scale": 3.0})
    imported = import_raven(folder)
    assert imported.config.state_init_std == pytest.approx(0.06)  # their s₀ is scaled by embed_scale too
    original.config.embedding_scale = 3.0
    same_logits(imported, original)
    # No init_values: Huginn's RavenConfig computes σ = sqrt(2 / 5h) and an embedding scale of sqrt(h).
    defaults = import_raven(raven_folder(tmp_path, original, name="defaults", init_values=None))
    assert defaults.config.embedding_scale == pytest.approx(math.sqrt(hidden))
    assert defaults.config.state_init_std == pytest.approx(math.sqrt(2 / (5 * hidden)) * math.sqrt(hidden))
    original.config.embedding_scale = math.sqrt(hidden)
    same_logits(defaults, original)


def test_import_reproduces_qk_bias(tmp_path):
    heads = 4
    parent = tiny_parent("llama", num_key_value_heads=heads, attention_bias=True)
    original = recurfit.retrofit(parent, shape=(1, 2, 1), adapter_init="random")
    biases, generator = {}, torch.Generator().manual_seed(0)
    for theirs, ours in {"prelude": "prelude", "core_block": "core", "coda": "coda"}.items():
        for i, layer in enumerate(getattr(original.model, ours)):
            attention = layer.self_attn
            with torch.no_grad():  # their model has q and k biases only
                attention.v_proj.bias.zero_()
                attention.o_proj.bias.zero_()
                attention.q_proj.bias.copy_(torch.randn(attention.q_proj.bias.shape, generator=generator))
                attention.k_proj.bias.copy_(torch.randn(attention.k_proj.bias.shape, generator=generator))
            pair = torch.stack([attention.q_proj.bias, attention.k_proj.bias]).detach()
            biases[f"transformer.{theirs}.{i}.attn.qk_bias"] = pair.view(2, 1, heads, -1)
    imported = import_raven(raven_folder(tmp_path, original, tensors=biases, qk_bias=True))
    same_logits(imported, original)


@pytest.mark.parametrize(
    "family, kwargs, tensors, message",
    [
        ("llama", {"bias": True}, {}, "adapter bias"),
        ("llama", {}, {"transformer.adapter.bias": torch.ones(64)}, "adapter bias"),
        ("llama", {}, {"transformer.prelude.0.attn.qk_bias": torch.ones(2, 1, 4, 16)}, "grouped-query"),
        ("olmo2", {}, {"transformer.prelude.0.attn.qk_bias": torch.ones(2, 1, 4, 16)}, "olmo2"),
    ],
)
def test_import_refuses_what_it_cannot_reproduce(tmp_path, family, kwargs, tensors, message):
    parent = tiny_parent(family, num_key_value_heads=2) if family == "llama" else tiny_parent(family)
    original = recurfit.retrofit(parent, shape=(1, 2, 1), adapter_init="random")
    folder = raven_folder(tmp_path, original, family, tensors=tensors, **kwargs)
    with pytest.raises(RecurfitError, match=message):
        import_raven(folder)


@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_imported_checkpoint_gives_the_same_logits_at_every_r(tmp_path, family):
    original = recurfit.retrofit(tiny_parent(family), shape=(2, 2, 1), adapter_init="random")
    write_raven_checkpoint(original, tmp_path, family, padded_vocab=128)
    imported = import_raven(tmp_path)
    assert imported.config.text_config.model_type == family and imported.config.shape == (2, 2, 1)
    assert imported.config.state_init_std == 0.02 and imported.config.mean_recurrence == 8
    assert imported.config.backprop_depth == 4  # Huginn's own key, mean_backprop_depth
    ids = token_batch()
    zero = torch.zeros(2, 12, 64)
    with torch.no_grad():
        for r in (1, 4, 9):
            expected = original.eval()(ids, num_steps=r, initial_state=zero).logits
            assert torch.allclose(imported(ids, num_steps=r, initial_state=zero).logits, expected, atol=1e-5)


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(RecurfitError, match="no config.json"):
        import_raven(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"n_embd": 64}))
    with pytest.raises(RecurfitError, match="No \\*.safetensors"):
        import_raven(tmp_path)
    save_file({"transformer.wte.weight": torch.zeros(4, 64)}, tmp_path / "model.safetensors")
    with pytest.raises(RecurfitError, match="Not a huginn_raven config"):
        import_raven(tmp_path)


def test_import_raven_copies_a_tokenizer_that_needs_no_code(folders, tmp_path):
    out = tmp_path / "out"
    result = run_in_terminal(tmp_path, "import-raven", folders / "raven", "--out", out)
    assert_never_asked(folders, result)
    assert result.returncode == 0 and "Tokenizer copied" in result.stdout, result.stdout + result.stderr
    assert "auto_map" not in (out / "tokenizer_config.json").read_text()
    assert load_tokenizer(str(out))("cat").input_ids == char_tokenizer()("cat").input_ids


def test_import_raven_says_so_when_the_tokenizer_needs_its_code(folders, tmp_path):
    out = tmp_path / "out"
    raven = folders / "raven-own-tokenizer"
    result = run_in_terminal(tmp_path, "import-raven", raven, "--out", out)
    assert_never_asked(folders, result)
    assert result.returncode == 0, result.stdout + result.stderr
    said = " ".join(result.stderr.split())  # a notice: stderr, with progress and statistics
    assert "No tokenizer saved" in said and f"{raven}/tokenizer_config.json" in said and "--tokenizer" in said, said
    assert (out / "config.json").is_file() and not (out / "tokenizer_config.json").exists()
    # what it suggests works: a tokenizer from a folder that has one readable without code
    result = run_in_terminal(tmp_path, "import-raven", raven, "--tokenizer", folders / "raven", "--out", out, "--force")
    assert_never_asked(folders, result)
    assert result.returncode == 0 and "Tokenizer copied" in result.stdout, result.stdout + result.stderr
    assert (out / "tokenizer_config.json").is_file()


def test_import_raven_with_a_tokenizer_that_needs_code_writes_nothing(folders, tmp_path):
    out = tmp_path / "out"
    result = run_in_terminal(
        tmp_path, "import-raven", folders / "raven", "--tokenizer", folders / "raven-own-tokenizer", "--out", out
    )
    assert_never_asked(folders, result)
    assert result.returncode == 2 and len(error_lines(result)) == 1, result.stdout + result.stderr
    assert not out.exists()


# Huginn-0125's config as the authors' conversions load it (`AutoConfig.from_pretrained("models/huginn-0125")`,
# class `RavenConfig` of their raven_config_minimal.py) before they overwrite the parent's sizes: what their saved
# config.json keeps of it. `RavenConfig.attribute_map` stores num_attention_heads and hidden_size as n_heads and
# n_embd, so neither standard name is written.
HUGINN_0125 = {
    "architectures": ["RavenForCausalLM"],
    "auto_map": {
        "AutoConfig": "raven_config_minimal.RavenConfig",
        "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
    },
    "model_type": "huginn_raven",
    "block_size": 4096,
    "padding_multiple": 4096,
    "tie_embeddings": True,
    "tie_word_embeddings": True,
    "bias": False,
    "architecture_class_name": "RecurrentGPT",
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "init_strategy": "takase",
    "init_orthogonal": False,
    "state_init": "like-init",
    "injection_type": "linear",
    "mean_recurrence": 32,
    "sampling_scheme": "poisson-lognormal-filling",
    "mean_backprop_depth": 8,
    "qk_bias": True,
    "activation_checkpoint_impl": "per-iteration",
    "rope_base": 50000,
    "test_time_noise": 0,
    "test_time_noise_type": "fixed",
    "effective_expected_depth": 132,
    "init_values": {  # computed by RavenConfig for Huginn's width 5280, and not recomputed for the parent's
        "std": math.sqrt(2 / (5 * 5280)),
        "out_proj": math.sqrt(2 / (5 * 5280)) / math.sqrt(2 * 132),
        "embedding": math.sqrt(2 / (5 * 5280)),
        "embed_scale": math.sqrt(5280),
    },
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def authors_config(model, family: str, rope_theta: float, rope_scaling: dict | None) -> dict:
    """config.json as their convert_llama.py (`get_llama_huginn_config`) or convert_olmo.py
    (`get_olmo_huginn_config`) writes it for `model`'s parent: Huginn-0125's config with their `update_dict`."""
    text, (P, R, C) = model.config.text_config, model.config.shape
    config = HUGINN_0125 | {
        "head_dim": text.hidden_size // text.num_attention_heads,
        "intermediate_size": text.intermediate_size,
        "n_embd": text.hidden_size,
        "n_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "n_layers": P + R + C,
        "n_layers_in_prelude": P,
        "n_layers_in_recurrent_block": R,
        "n_layers_in_coda": C,
        "norm_eps": text.rms_norm_eps,
        "vocab_size": text.vocab_size,
        "padded_vocab_size": text.vocab_size,
        "tie_embeddings": False,
        "torch_dtype": "float32",
        "qk_bias": False,
        "max_position_embeddings": text.max_position_embeddings,
    }
    config["init_values"] = config["init_values"] | {"embed_scale": 1.0}
    if family == "olmo2":  # rope_base is the parent's rope_theta; tie_word_embeddings is dropped after saving
        del config["tie_word_embeddings"]
        return config | {"rope_base": rope_theta}
    # Llama: rope_base is fixed at 500000.0, rope_theta copied from the parent, which is what their model computes
    # with (LlamaRotaryEmbedding reads rope_theta); TinyLlama's 10000 differs from rope_base.
    config |= {"rope_base": 500000.0, "rope_theta": rope_theta}
    return config | ({"rope_scaling": rope_scaling} if rope_scaling else {})


@pytest.mark.parametrize(
    "family, rope_theta, rope_scaling",
    [
        ("llama", 500000.0, LLAMA3_ROPE),  # Llama-3.2-1B
        ("llama", 10000.0, None),  # TinyLlama-1.1B-3T
        ("olmo2", 500000.0, None),  # OLMo-2-0425-1B
    ],
    ids=["llama-3.2", "tinyllama", "olmo-2"],
)
def test_import_reads_the_config_and_tensors_their_conversion_code_writes(tmp_path, family, rope_theta, rope_scaling):
    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    parent = tiny_parent(family, rope_parameters=rope, tie_word_embeddings=False)
    original = recurfit.retrofit(parent, shape=(1, 2, 1), adapter_init="random")
    write_raven_checkpoint(original, tmp_path, family, padded_vocab=original.config.text_config.vocab_size)
    (tmp_path / "config.json").write_text(json.dumps(authors_config(original, family, rope_theta, rope_scaling)))
    imported = import_raven(tmp_path)
    text = imported.config.text_config
    assert (text.num_attention_heads, text.num_key_value_heads) == (4, 2)  # from n_heads, grouped-query kept
    assert text.rope_parameters["rope_theta"] == rope_theta and imported.config.embedding_scale is None
    # s₀'s σ: Huginn-0125's std, which their converted models keep, times their embed_scale of 1
    assert imported.config.state_init_std == pytest.approx(math.sqrt(2 / (5 * 5280)))
    assert (imported.config.mean_recurrence, imported.config.backprop_depth) == (32, 8)
    # Untied although their config.json says tie_word_embeddings: their model reads tie_embeddings.
    assert imported.lm_head.weight.data_ptr() != imported.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(1, text.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    zero = torch.zeros(2, 48, text.hidden_size)
    with torch.no_grad():
        for r in (1, 4):
            expected = original.eval()(ids, num_steps=r, initial_state=zero).logits
            torch.testing.assert_close(imported(ids, num_steps=r, initial_state=zero).logits, expected)
