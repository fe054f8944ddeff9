"""The names of the installed transformers, decided once.

transformers 5.24 renamed the KV cache argument `past_key_values` to `cache` (model inputs and outputs, decoder
layers, mask builders, `generate`'s model kwargs), keeping the old name as a deprecated alias for layers and mask
builders but not for a custom model's `forward`, and renamed `gradient_checkpointing_enable` to
`activation_checkpointing_enable`. recurfit runs on both sides: every call into transformers and every output uses
the names below, found by looking at what the installed release has (no version comparisons).
"""

from __future__ import annotations

import warnings

from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# What transformers calls the KV cache: in `forward(**inputs)`, outputs, decoder layers and mask builders.
CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
DEPRECATED_CACHE_ARG = "past_key_values" if CACHE_ARG == "cache" else None


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
