"""Import the paper authors' released checkpoints ("huginn_raven" format) as recurfit models.

Their retrofitted Llama and OLMo-2 models name things `transformer.wte`, `transformer.prelude.{i}`,
`transformer.adapter`, `transformer.core_block.{i}`, `transformer.coda.{i}`, `transformer.ln_f`, `lm_head`,
with fused `attn.Wqkv` (rows q; k; v) and `mlp.fc` (rows gate; up). Their code ignores the attention mask
and applies `ln_f` after the coda only, which is what recurfit computes for unpadded inputs.

Their config class (Huginn-0125's `RavenConfig`) fills what a config.json leaves out: `init_values` (σ of s₀
= sqrt(2 / 5h), embedding scale sqrt(h)), `qk_bias` (true) and `bias` (false, the adapter's). The import reads
the same defaults, so it reproduces the checkpoint exactly, or refuses naming the setting it cannot express.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..defaults import BACKPROP_DEPTH, MEAN_RECURRENCE
from ..errors import RecurfitError
from ..model.config import RecurrentConfig
from ..model.modeling import RecurrentForCausalLM

# Per family: huginn norm name -> the family's decoder-layer norm (Llama is pre-norm, OLMo-2 post-norm).
NORMS = {
    "llama": {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm"},
    "olmo2": {"norm_1": "post_attention_layernorm", "norm_2": "post_feedforward_layernorm"},
}
PARTS = {"prelude": "prelude", "core_block": "core", "coda": "coda"}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def read_raven_state(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: safetensors (single or sharded), or a .bin loaded weights-only."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(f).items()}
    files = sorted(folder.glob("*.bin"))
    if files:
        return {k: v for f in files for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}
    raise RecurfitError(f"No *.safetensors or *.bin weights in {folder}.")


def detect_family(state: dict[str, torch.Tensor]) -> str:
    """OLMo-2 checkpoints carry QK-norm weights; Llama ones do not."""
    return "olmo2" if any(k.endswith("attn.q_norm.weight") for k in state) else "llama"


def raven_settings(raw: dict) -> dict:
    """What their model computes with: the config's values, or `RavenConfig`'s defaults for those it omits."""
    hidden = raw["n_embd"]
    init_values = raw.get("init_values") or {}
    return {
        "std": init_values.get("std", math.sqrt(2 / (5 * hidden))),
        "embed_scale": init_values.get("embed_scale", math.sqrt(hidden)),
        "adapter_bias": raw.get("bias", False),
    }


def has_qk_bias(state: dict[str, torch.Tensor]) -> bool:
    """Whether their q/k biases change anything: `qk_bias` (on by default) adds `attn.qk_bias` tensors, which
    start at zero; a missing or all-zero one adds nothing."""
    return any(k.endswith("attn.qk_bias") and bool(v.any()) for k, v in state.items())


def check_supported(raw: dict, state: dict[str, torch.Tensor], family: str) -> None:
    """Refuse, naming the setting, what recurfit's layers cannot compute exactly."""
    if raven_settings(raw)["adapter_bias"] or "transformer.adapter.bias" in state:
        raise RecurfitError(
            "This checkpoint has an adapter bias (config bias: true), which recurfit's adapter does not have; "
            "it cannot be imported exactly."
        )
    heads = raw.get("num_attention_heads", raw.get("n_heads"))
    if has_qk_bias(state) and (family != "llama" or raw.get("num_key_value_heads", heads) != heads):
        kind = "grouped-query attention" if family == "llama" else f"the {family} variant (bias after QK-norm)"
        raise RecurfitError(
            f"This checkpoint has non-zero qk_bias tensors, which recurfit reproduces only for the Llama variant "
            f"without grouped-query attention, not for {kind}; it cannot be imported exactly."
        )


def raven_config(raw: dict, family: str, dtype: torch.dtype, qk_bias: bool = False) -> RecurrentConfig:
    """Translate their config.json keys to a `RecurrentConfig` over the family's own config (`qk_bias`: the
    weights carry non-zero q/k biases)."""
    try:
        hidden = raw["n_embd"]
        heads = raw.get("num_attention_heads", raw.get("n_heads"))
        shape = (raw["n_layers_in_prelude"], raw["n_layers_in_recurrent_block"], raw["n_layers_in_coda"])
        theta = raw.get("rope_theta", raw.get("rope_base", 10000.0))
        settings = raven_settings(raw)
        text = dict(
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=sum(shape),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=raw.get("norm_eps", 1e-5),
            max_position_embeddings=raw.get("max_position_embeddings", raw.get("block_size", 4096)),
            rope_parameters={"rope_type": "default", **_rope_scaling(raw.get("rope_scaling")), "rope_theta": theta},
            tie_word_embeddings=False,
            # The checkpoint's own special tokens (None where it has none), never the family config's defaults.
            **{name: raw.get(name) for name in TOKEN_IDS},
        )
    except KeyError as missing:
        raise RecurfitError(f"Not a huginn_raven config: it has no {missing} key.") from None
    if qk_bias:
        text["attention_bias"] = True  # q and k get theirs; v and o get zero biases (see convert_state)
    scale = settings["embed_scale"]
    return RecurrentConfig(
        text_config=CONFIG_MAPPING[family](**text),
        num_prelude_layers=shape[0],
        num_core_layers=shape[1],
        num_coda_layers=shape[2],
        # Their s₀ is TruncNormal(0, std², ±3 std) times the embedding scale: the same as σ = std · scale.
        state_init_std=settings["std"] * scale,
        embedding_scale=None if scale == 1 else scale,
        mean_recurrence=raw.get("mean_recurrence", MEAN_RECURRENCE),
        backprop_depth=raw.get("mean_backprop_depth", BACKPROP_DEPTH),
        dtype=dtype,
        **{name: raw.get(name) for name in TOKEN_IDS},
    )


def _rope_scaling(scaling: dict | None) -> dict:
    if not scaling:
        return {}
    scaling = dict(scaling)
    scaling["rope_type"] = scaling.pop("rope_type", scaling.pop("type", "default"))
    return scaling


def convert_state(state: dict[str, torch.Tensor], config: RecurrentConfig, family: str) -> dict[str, torch.Tensor]:
    """Rename and split their tensors into recurfit's state dict."""
    text = config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    q_rows, kv_rows = text.num_attention_heads * head_dim, text.num_key_value_heads * head_dim
    vocab = text.vocab_size
    out = {
        "model.embed_tokens.weight": state["transformer.wte.weight"][:vocab],
        "lm_head.weight": state["lm_head.weight"][:vocab],
        "model.norm.weight": state["transformer.ln_f.weight"],
        "model.adapter.weight": state["transformer.adapter.weight"],
    }
    for theirs, ours in PARTS.items():
        prefix = f"transformer.{theirs}."
        for i in sorted({int(k[len(prefix) :].split(".")[0]) for k in state if k.startswith(prefix)}):
            src, dst = f"{prefix}{i}.", f"model.{ours}.{i}."
            q, k, v = state[src + "attn.Wqkv.weight"].split([q_rows, kv_rows, kv_rows])
            gate, up = state[src + "mlp.fc.weight"].chunk(2)
            out |= {
                dst + "self_attn.q_proj.weight": q,
                dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": state[src + "attn.proj.weight"],
                dst + "mlp.gate_proj.weight": gate,
                dst + "mlp.up_proj.weight": up,
                dst + "mlp.down_proj.weight": state[src + "mlp.proj.weight"],
            }
            out |= {
                dst + f"{name}.weight": state[src + f"{theirs_norm}.weight"]
                for theirs_norm, name in NORMS[family].items()
            }
            if text.attention_bias:  # their per-head q and k biases, added before RoPE as a projection bias is
                q_bias, k_bias = state[src + "attn.qk_bias"].flatten(1).unbind()
                out |= {
                    dst + "self_attn.q_proj.bias": q_bias,
                    dst + "self_attn.k_proj.bias": k_bias,
                    dst + "self_attn.v_proj.bias": q_bias.new_zeros(kv_rows),
                    dst + "self_attn.o_proj.bias": q_bias.new_zeros(text.hidden_size),
                }
            if family == "olmo2":
                out[dst + "self_attn.q_norm.weight"] = state[src + "attn.q_norm.weight"]
                out[dst + "self_attn.k_norm.weight"] = state[src + "attn.k_norm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def import_raven(folder: str | Path, family: str | None = None) -> RecurrentForCausalLM:
    """Load a huginn_raven checkpoint folder (config.json + weights) as a `RecurrentForCausalLM`."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise RecurfitError(f"{folder} is not a checkpoint folder: it has no config.json.")
    raw = json.loads((folder / "config.json").read_text())
    state = read_raven_state(folder)
    family = family or detect_family(state)
    if family not in NORMS:
        raise RecurfitError(f"huginn_raven variants are {sorted(NORMS)}, got {family!r}.")
    try:
        check_supported(raw, state, family)
    except KeyError as missing:
        raise RecurfitError(f"Not a huginn_raven config: it has no {missing} key.") from None
    config = raven_config(raw, family, state["transformer.wte.weight"].dtype, has_qk_bias(state))
    try:
        model = RecurrentForCausalLM.from_state_dict(config, convert_state(state, config, family))
    except (KeyError, RuntimeError) as problem:
        raise RecurfitError(f"The weights in {folder} do not match its config ({family} variant): {problem}") from None
    return model.eval()
