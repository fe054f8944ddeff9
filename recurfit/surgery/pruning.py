"""The parent made smaller, for the baselines and the parity check: only its highest-scoring layers
(`prune_layers`), its head untied from its embeddings (`untie_embeddings`), or running only some layers for a
while (`pruned_parent`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn
from transformers import PreTrainedModel

from ..model.families import config_for_layers
from .layer_scores import block_influence
from .selection import highest_scoring


def prune_layers(parent: PreTrainedModel, keep: int, calibration) -> PreTrainedModel:
    """The parent with only its `keep` layers of highest Block Influence (ShortGPT), in place: a smaller
    non-recurrent model, the baseline the paper compares its layer choice against. Returns `parent`."""
    num_layers = parent.config.num_hidden_layers
    if not 1 <= keep <= num_layers:
        raise ValueError(f"Cannot keep {keep} layers of a {num_layers}-layer parent: choose 1..{num_layers}.")
    kept = highest_scoring(block_influence(parent, calibration), keep)
    tied = parent.config.tie_word_embeddings
    parent.config = config_for_layers(parent.config, kept)
    parent.config.tie_word_embeddings = tied
    parent.model.config = parent.config
    parent.model.layers = nn.ModuleList(parent.model.layers[i] for i in kept)
    for index, layer in enumerate(parent.model.layers):
        # A layer's KV-cache slot is its `layer_idx`: renumber the kept layers 0..keep-1.
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = index
    return parent


def untie_embeddings(model: PreTrainedModel) -> PreTrainedModel:
    """Give a model whose head shares the embedding matrix its own copy of it (in place; no-op when untied).
    Outputs are unchanged; training then updates the two separately, as the paper's Llama-3.2-1B baseline."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    if head.weight is embeddings.weight:
        head.weight = nn.Parameter(embeddings.weight.detach().clone())
    return model


@contextmanager
def pruned_parent(parent: PreTrainedModel, kept: Sequence[int]) -> Iterator[PreTrainedModel]:
    """The parent itself, temporarily running only the `kept` layers (no copy). Call it with use_cache=False."""
    layers, config = parent.model.layers, parent.config
    saved = {key: getattr(config, key) for key in ("num_hidden_layers", "layer_types") if hasattr(config, key)}
    parent.model.layers = nn.ModuleList(layers[i] for i in kept)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None):
        config.layer_types = [saved["layer_types"][i] for i in kept]
    try:
        yield parent
    finally:
        parent.model.layers = layers
        for key, value in saved.items():
            setattr(config, key, value)
