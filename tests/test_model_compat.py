"""The installed transformers' names, decided once: the cache argument on both sides of 5.24's rename."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import model_with_state_for_cache, prompts_for_cache

from recurfit.model import compat
from recurfit.model.cache import RecurrentCache


def test_the_cache_comes_back_under_the_installed_name():
    model = model_with_state_for_cache("llama")
    ids, mask = prompts_for_cache()
    cache = RecurrentCache(model.config)
    output = model(ids, attention_mask=mask, num_steps=2, **compat.cache_kwargs(cache))
    assert output[compat.CACHE_ARG] is cache and cache.get_seq_length() == ids.shape[1]


def test_passing_the_cache_under_both_names_is_an_error():
    model = model_with_state_for_cache("llama")
    ids, _ = prompts_for_cache()
    cache = RecurrentCache(model.config)
    with pytest.raises(ValueError, match="not both"):
        model(ids, num_steps=2, cache=cache, past_key_values=cache)


def test_the_old_name_warns_only_where_transformers_deprecated_it():
    model = model_with_state_for_cache("llama")
    ids, _ = prompts_for_cache()
    cache = RecurrentCache(model.config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(ids, num_steps=2, past_key_values=cache)
    ours = [w for w in caught if issubclass(w.category, compat.RecurfitDeprecationWarning)]
    assert len(ours) == (1 if compat.CACHE_ARG == "cache" else 0)
    assert cache.get_seq_length() == ids.shape[1]  # the old name still reaches the model


def test_recurfits_own_deprecation_warnings_are_errors_in_the_tests():
    """pyproject.toml's filterwarnings: recurfit calling itself by a deprecated name fails the suite."""
    with pytest.raises(compat.RecurfitDeprecationWarning):
        warnings.warn("deprecated", compat.RecurfitDeprecationWarning, stacklevel=1)
