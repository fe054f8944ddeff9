"""The parent families recurfit serves on vLLM: which vLLM body builds each, what each cannot serve, and the fixes
that make vLLM's layers compute what the parent computes (OLMo-2/3 on OLMo Hybrid's attention layers)."""

from __future__ import annotations

import copy

from torch import nn
from vllm.compilation.decorators import ignore_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.rotary_embedding import get_rope

from ..defaults import ADAPTERS, CACHE_POLICIES
from ..model.families import attention_types

# The parent families vLLM has layers for: model_type -> (vLLM module, the family's body class, its CausalLM
# class, whose weight mapper loads the body where the body has no `load_weights` of its own).
VLLM_FAMILIES = {
    "llama": ("vllm.model_executor.models.llama", "LlamaModel", "LlamaForCausalLM"),
    "mistral": ("vllm.model_executor.models.mistral", "MistralModel", "MistralForCausalLM"),
    "qwen2": ("vllm.model_executor.models.qwen2", "Qwen2Model", "Qwen2ForCausalLM"),
    "qwen3": ("vllm.model_executor.models.qwen3", "Qwen3Model", "Qwen3ForCausalLM"),
    "gemma": ("vllm.model_executor.models.gemma", "GemmaModel", "GemmaForCausalLM"),
    # vLLM has no OLMo-2/3 model: OLMo Hybrid's attention layers are OLMo-2's (q/k norms over all heads, norms
    # after attention and MLP), and none of its Gated DeltaNet layers is built where layer_types names none.
    "olmo2": ("vllm.model_executor.models.olmo_hybrid", "OlmoHybridModel", "OlmoHybridForCausalLM"),
    "olmo3": ("vllm.model_executor.models.olmo_hybrid", "OlmoHybridModel", "OlmoHybridForCausalLM"),
}
OLMO_HYBRID = {"olmo2", "olmo3"}  # families served by OlmoHybridModel's layers
# Settings OlmoHybridModel's layers fix (no biases, SiLU MLP), with the value they fix them to.
OLMO_HYBRID_FIXED = {"attention_bias": False, "hidden_act": "silu"}
# Families whose vLLM layers take one attention kind for every layer (vLLM asserts max_window_layers = layers).
ONE_ATTENTION_KIND = {"qwen2", "qwen3"}
SCALED_EMBEDDINGS = {"gemma"}  # families whose token embeddings are multiplied by sqrt(hidden_size)


def check_servable(config) -> None:
    """A ValueError in one line naming the setting when vLLM cannot serve this recurfit config as trained."""
    family = config.text_config.model_type
    if family not in VLLM_FAMILIES:
        raise ValueError(
            f"recurfit on vLLM: text_config.model_type {family!r} has no vLLM layers here; "
            f"served families: {', '.join(VLLM_FAMILIES)}."
        )
    kinds = set(getattr(config.text_config, "layer_types", None) or [])
    if family in ONE_ATTENTION_KIND and len(kinds) > 1:
        raise ValueError(
            f"recurfit on vLLM: text_config.layer_types mixes {sorted(kinds)}, which vLLM's {family} layers do not "
            "serve (the parent's use_sliding_window with max_window_layers below the layer count)."
        )
    if family in OLMO_HYBRID:
        _check_olmo_hybrid(config.text_config)
    policy = getattr(config, "cache_policy", "all")
    if policy not in CACHE_POLICIES:
        raise ValueError(f"recurfit on vLLM: cache_policy must be one of {CACHE_POLICIES}, got {policy!r}.")
    if not (isinstance(config.mean_recurrence, int) and config.mean_recurrence >= 1):
        raise ValueError(f"recurfit on vLLM: mean_recurrence must be an integer >= 1, got {config.mean_recurrence!r}.")
    if config.adapter not in ADAPTERS:
        raise ValueError(f"recurfit on vLLM: adapter {config.adapter!r} is not served ({', '.join(ADAPTERS)}).")


def _check_olmo_hybrid(text) -> None:
    """A ValueError naming the first OLMo setting that OlmoHybridModel's layers would silently compute otherwise."""
    for name, value in OLMO_HYBRID_FIXED.items():
        if getattr(text, name, value) != value:
            raise ValueError(f"recurfit on vLLM: text_config.{name} must be {value!r} for {text.model_type}.")
    head_dim = text.hidden_size // text.num_attention_heads
    if (getattr(text, "head_dim", None) or head_dim) != head_dim:
        raise ValueError(f"recurfit on vLLM: text_config.head_dim must be hidden_size / heads for {text.model_type}.")


def _rope_for(text, kind: str) -> dict:
    """A layer kind's rotary parameters: OLMo-3 keeps one set per kind, OLMo-2 one for all."""
    return text.rope_parameters.get(kind, text.rope_parameters)


def olmo_hybrid_config(text):
    """OLMo-2/3's config as OlmoHybridModel reads it: a `layer_types` with no "linear_attention" (its Gated
    DeltaNet kind), so every layer is an attention one, and one flat `rope_parameters`, the full-attention
    layers' (`fit_sliding_layers` gives OLMo-3's sliding layers theirs)."""
    body = copy.copy(text)
    body.layer_types = attention_types(text)
    body.rope_parameters = _rope_for(text, "full_attention")
    return body


def fit_sliding_layers(body: nn.Module, text, vllm_config: VllmConfig) -> None:
    """OlmoHybridModel builds each attention layer without a window and with one rotary embedding: OLMo-3's
    sliding layers get a new `Attention` with their window under the same name (a window is fixed when the
    Attention is built, and each attention backend keeps it in its own form) and their kind's rotary embedding."""
    registered = get_current_vllm_config().compilation_config.static_forward_context
    for layer, kind in zip(body.layers, attention_types(text)):
        if kind != "sliding_attention":
            continue
        attention = layer.self_attn
        name = attention.attn.layer_name
        del registered[name]  # the new Attention registers itself under this name
        attention.attn = attention_like(attention.attn, name, vllm_config, window=text.sliding_window)
        attention.rotary_emb = get_rope(
            attention.head_dim, attention.max_position_embeddings, rope_parameters=_rope_for(text, kind)
        )


def body_config(vllm_config: VllmConfig, text_config) -> VllmConfig:
    """`vllm_config` seen by the family's body: the same settings, with the parent family's config as hf_config."""
    inner = copy.copy(vllm_config)
    model_config = copy.copy(vllm_config.model_config)
    object.__setattr__(model_config, "hf_config", text_config)
    object.__setattr__(inner, "model_config", model_config)
    return inner


def attention_like(attention: Attention, prefix: str, vllm_config: VllmConfig, window: int | None = None) -> Attention:
    """A new vLLM `Attention` with `attention`'s shape and window (or `window`), registered under `prefix` (its
    own KV cache)."""
    return Attention(
        attention.num_heads,
        attention.head_size,
        attention.impl.scale,
        num_kv_heads=attention.num_kv_heads,
        cache_config=vllm_config.cache_config,
        quant_config=vllm_config.quant_config,
        logits_soft_cap=getattr(attention.impl, "logits_soft_cap", None),
        per_layer_sliding_window=window or attention.sliding_window,
        prefix=prefix,
        attn_type=attention.attn_type,
    )


def uncompiled(body_class: type) -> type:
    """The family's body class without its own `@support_torch_compile`: `RecurrentModel` compiles the recurrence
    that calls its layers, and the body's forward never runs."""
    return ignore_torch_compile(type(f"Uncompiled{body_class.__name__}", (body_class,), {}))
