"""Registry of the parent families recurfit can retrofit, and their quirks.

Every supported family keeps transformers' standard layout (``model.embed_tokens``, ``model.layers``,
``model.norm``, ``model.rotary_emb``, ``lm_head``), so recurfit reuses the family's own decoder layer,
RMSNorm and rotary embedding classes instead of re-implementing attention. A family entry only records
where those classes live and what is unusual about the family.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass

from transformers import PreTrainedConfig


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # class-name prefix in transformers.models.<model_type>.modeling_<model_type>
    examples: str
    scale_embeddings: bool = False  # Gemma multiplies token embeddings by sqrt(hidden_size)

    def _class(self, suffix: str) -> type:
        module = importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")
        return getattr(module, f"{self.prefix}{suffix}")

    @property
    def decoder_layer(self) -> type:
        return self._class("DecoderLayer")

    @property
    def norm(self) -> type:
        return self._class("RMSNorm")

    @property
    def rotary_embedding(self) -> type:
        return self._class("RotaryEmbedding")


FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama", "Llama", "TinyLlama, Llama-2/3.x, SmolLM/SmolLM2"),
        Family("mistral", "Mistral", "Mistral-7B"),
        Family("qwen2", "Qwen2", "Qwen2, Qwen2.5"),
        Family("qwen3", "Qwen3", "Qwen3"),
        Family("olmo2", "Olmo2", "OLMo-2"),
        Family("olmo3", "Olmo3", "OLMo-3"),
        Family("gemma", "Gemma", "Gemma", scale_embeddings=True),
    )
}


def supported_families() -> str:
    return ", ".join(f"{f.model_type} ({f.examples})" for f in FAMILIES.values())


def family_of(config: PreTrainedConfig) -> Family:
    """The registry entry for a parent config; a ValueError naming the supported families otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"recurfit cannot retrofit model_type {model_type!r}: supported families are {supported_families()}."
        )
    return FAMILIES[model_type]


def attention_types(config: PreTrainedConfig) -> list[str]:
    """Each layer's attention kind ("full_attention" or "sliding_attention"), read from the family config."""
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    # Families without `layer_types` (Mistral) apply their sliding window, if any, to every layer.
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * config.num_hidden_layers


def config_for_layers(parent: PreTrainedConfig, layers: list[int]) -> PreTrainedConfig:
    """The parent's config rewritten to describe only `layers` (parent indices), in that order.

    Per-layer fields (`layer_types`) follow the kept layers, so a kept sliding-window layer stays sliding.
    """
    config = copy.deepcopy(parent)
    types = attention_types(parent)
    config.num_hidden_layers = len(layers)
    if getattr(parent, "layer_types", None):
        config.layer_types = [types[i] for i in layers]
    config.tie_word_embeddings = False
    return config
