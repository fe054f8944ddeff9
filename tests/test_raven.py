"""Import of the paper authors' huginn_raven checkpoints: a checkpoint written in their layout loads back
to a model with the same logits at every r."""

import json

import pytest
import torch
from conftest import tiny_parent, token_batch
from safetensors.torch import save_file

import recurfit
from recurfit.errors import RecurfitError
from recurfit.surgery.raven import import_raven

THEIR_NORMS = {
    "llama": ("input_layernorm", "post_attention_layernorm"),
    "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


def write_raven_checkpoint(model: recurfit.RecurrentForCausalLM, folder, family: str, padded_vocab: int):
    """Write `model` the way the reference code names and fuses its tensors."""
    sd, text = model.state_dict(), model.config.text_config
    pad = padded_vocab - text.vocab_size
    out = {
        "transformer.wte.weight": torch.cat([sd["model.embed_tokens.weight"], torch.randn(pad, text.hidden_size)]),
        "lm_head.weight": torch.cat([sd["lm_head.weight"], torch.randn(pad, text.hidden_size)]),
        "transformer.ln_f.weight": sd["model.norm.weight"],
        "transformer.adapter.weight": sd["model.adapter.weight"],
    }
    for ours, theirs in {"prelude": "prelude", "core": "core_block", "coda": "coda"}.items():
        for i in range(len(getattr(model.model, ours))):
            src, dst = f"model.{ours}.{i}.", f"transformer.{theirs}.{i}."
            out[dst + "attn.Wqkv.weight"] = torch.cat([sd[src + f"self_attn.{p}_proj.weight"] for p in "qkv"])
            out[dst + "attn.proj.weight"] = sd[src + "self_attn.o_proj.weight"]
            out[dst + "mlp.fc.weight"] = torch.cat([sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]])
            out[dst + "mlp.proj.weight"] = sd[src + "mlp.down_proj.weight"]
            norm_1, norm_2 = THEIR_NORMS[family]
            out[dst + "norm_1.weight"], out[dst + "norm_2.weight"] = (
                sd[src + f"{norm_1}.weight"],
                sd[src + f"{norm_2}.weight"],
            )
            if family == "olmo2":
                out[dst + "attn.q_norm.weight"] = sd[src + "self_attn.q_norm.weight"]
                out[dst + "attn.k_norm.weight"] = sd[src + "self_attn.k_norm.weight"]
    save_file({k: v.contiguous() for k, v in out.items()}, folder / "model.safetensors")
    P, R, C = model.config.shape
    config = {
        "model_type": "huginn_raven",
        "architectures": ["RavenForCausalLM"],
        "n_embd": text.hidden_size,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "head_dim": text.hidden_size // text.num_attention_heads,
        "intermediate_size": text.intermediate_size,
        "n_layers": P + R + C,
        "n_layers_in_prelude": P,
        "n_layers_in_recurrent_block": R,
        "n_layers_in_coda": C,
        "norm_eps": text.rms_norm_eps,
        "vocab_size": text.vocab_size,
        "padded_vocab_size": padded_vocab,
        "rope_base": text.rope_parameters["rope_theta"],
        "tie_embeddings": False,
        "mean_recurrence": 8,
        "mean_backprop_depth": 4,
        "init_values": {"std": 0.02, "embed_scale": 1.0},
        "max_position_embeddings": text.max_position_embeddings,
    }
    (folder / "config.json").write_text(json.dumps(config))


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


def test_import_raven_command_writes_a_loadable_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from recurfit.cli import main

    original = recurfit.retrofit(tiny_parent("olmo2"), shape=(1, 2, 1), adapter_init="random")
    (tmp_path / "raven").mkdir()
    write_raven_checkpoint(original, tmp_path / "raven", "olmo2", padded_vocab=97)
    assert main(["import-raven", str(tmp_path / "raven"), "--out", str(tmp_path / "out")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids, zero = token_batch(), torch.zeros(2, 12, 64)
    with torch.no_grad():
        expected = original.eval()(ids, num_steps=3, initial_state=zero).logits
        assert torch.allclose(loaded(ids, num_steps=3, initial_state=zero).logits, expected, atol=1e-5)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out"), "--recurrence", "1,2"]) == 0
    assert "core (2 layers) ×r" in " ".join(capsys.readouterr().out.split())
