"""The names of the installed transformers, decided once.

transformers 5.24 renamed the KV cache argument `past_key_values` to `cache` (model inputs and outputs, decoder
layers, mask builders, `generate`'s model kwargs), keeping the old name as a deprecated alias for layers and mask
builders but not for a custom model's `forward`, and renamed `gradient_checkpointing_enable` to
`activation_checkpointing_enable`. recurfit runs on both sides: every call into transformers and every output uses
the names below, found by looking at what the installed release has (no version comparisons).
"""

from __future__ import annotations

import warnings

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

# What transformers calls the KV cache: in `forward(**inputs)`, outputs, decoder layers and mask builders.
CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
DEPRECATED_CACHE_ARG = "past_key_values" if CACHE_ARG == "cache" else None


def _sliding_layers_roll_back() -> bool:
    """Whether a sliding-window cache layer can record its past for a rollback and still hand attention no more
    keys than its mask sizes advertise, over forwards between two crops (as drafting runs them). Releases without
    `activate_past_recording` cannot; those before 5.24 recorded but then returned every key, which no longer fit
    the sliding mask. Probed on a window of 2: the third of three one-token forwards must return 2 keys."""
    layer = DynamicSlidingWindowLayer(sliding_window=2)
    if not hasattr(layer, "activate_past_recording"):
        return False
    layer.activate_past_recording()
    one = torch.zeros(1, 1, 1, 1)
    for _ in range(3):
        keys, _ = layer.update(one, one)
    return keys.shape[-2] == layer.get_mask_sizes(1)[0]


# Speculative decoding keeps sliding-window layers' past in them where this holds, else in full-attention layers.
SLIDING_LAYERS_ROLL_BACK = _sliding_layers_roll_back()


class RecurfitDeprecationWarning(FutureWarning):
    """A recurfit API called by a name the installed transformers has deprecated (the tests make it an error)."""


def cache_kwargs(cache) -> dict:
    """`{name: cache}` under the installed transformers' name, for `model(...)`, layers, masks and outputs."""
    return {CACHE_ARG: cache}


def take_cache(past_key_values=None, cache=None):
    """The cache a caller passed to recurfit's `forward` under either name (both at once is an error)."""
    if past_key_values is not None and cache is not None:
        raise ValueError("Pass the KV cache once, as `cache` or as `past_key_values`, not both.")
    if past_key_values is not None and DEPRECATED_CACHE_ARG == "past_key_values":
        warnings.warn(
            "`past_key_values` is deprecated by the installed transformers; pass the cache as `cache`.",
            RecurfitDeprecationWarning,
            stacklevel=3,
        )
    return cache if cache is not None else past_key_values


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant checkpointing)."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
