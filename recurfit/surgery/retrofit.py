"""Surgery: a parent becomes a `RecurrentForCausalLM`, its kept layers' weights moved over.

    retrofit(parent, shape=(4, 8, 4))                                   # the paper's rule
    retrofit(parent, prelude=[0, 1], core=[4, 5, 6, 7], coda=[8, 9])    # explicit parent indices
    retrofit(parent, shape=(4, 8, 4), select="shortgpt", calibration=ids)  # keep high Block-Influence layers
    retrofit(parent, shape=(4, 8, 4), select="angular", calibration=ids)   # core from the angular "think" region
    retrofit(parent, select="angular", calibration=ids)                    # the knees choose P, R and C too

Works on a parent on the meta device too (plan shapes and FLOPs from a config alone).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from ..defaults import ADAPTER_INITS, BACKPROP_DEPTH, DEFAULT_STATE_INIT_STD, MEAN_RECURRENCE
from ..io.assets import public_name
from ..model.adapter import LinearAdapter
from ..model.config import RecurrentConfig
from ..model.families import config_for_layers, family_of
from ..model.modeling import RecurrentForCausalLM
from .selection import LayerSelection, select_layers


def retrofit(
    parent: PreTrainedModel,
    shape: Sequence[int] | None = None,
    *,
    prelude: Sequence[int] | None = None,
    core: Sequence[int] | None = None,
    coda: Sequence[int] | None = None,
    select: str = "paper",
    calibration=None,
    adapter: str = "linear",
    adapter_init: str = "identity",
    seed: int = 0,
    untie_embeddings: bool = True,
    state_init_std: float = DEFAULT_STATE_INIT_STD,
    mean_recurrence: int = MEAN_RECURRENCE,
    backprop_depth: int = BACKPROP_DEPTH,
) -> RecurrentForCausalLM:
    """Turn a pretrained causal LM into a `RecurrentForCausalLM` (see module docstring for the layer choices).

    With the identity adapter (`adapter="linear", adapter_init="identity"`), the result computes exactly the
    parent with the dropped layers removed, at every number of recurrences, until it is trained.
    `adapter_init="torch-default"` starts the adapter where the paper's runs started: `nn.Linear`'s default
    Kaiming-uniform draw, here from a generator seeded with `seed` (so the same seed gives the same model).
    """
    family_of(parent.config)  # a clear error for unsupported architectures, before any work
    num_layers = parent.config.num_hidden_layers
    selection = select_layers(parent, num_layers, shape, prelude, core, coda, select, calibration)
    if adapter_init not in ADAPTER_INITS:
        raise ValueError(f"adapter_init must be one of {ADAPTER_INITS}, got {adapter_init!r}.")
    text = config_for_layers(parent.config, selection.kept)
    text.tie_word_embeddings = not untie_embeddings
    text.name_or_path = public_name(parent.config.name_or_path) or ""  # a local path is not saved (nor pushed)
    P, R, C = selection.shape
    config = RecurrentConfig(
        text_config=text,
        num_prelude_layers=P,
        num_core_layers=R,
        num_coda_layers=C,
        source_layers=selection.as_dict(),
        parent_name_or_path=public_name(parent.config.name_or_path),
        adapter=adapter,
        state_init_std=state_init_std,
        mean_recurrence=mean_recurrence,
        backprop_depth=backprop_depth,
        tie_word_embeddings=not untie_embeddings,
        dtype=parent.dtype,
    )
    config._attn_implementation = parent.config._attn_implementation
    model = RecurrentForCausalLM.from_state_dict(
        config, _transfer_weights(parent, selection, config, adapter_init, seed)
    )
    if parent.generation_config is not None:
        model.generation_config = copy.deepcopy(parent.generation_config)  # the parent's own stays untouched
    return model.train(parent.training)


def _transfer_weights(parent, selection: LayerSelection, config: RecurrentConfig, adapter_init: str, seed: int) -> dict:
    """The new model's state dict, copied (not shared) from the parent's kept layers, embeddings and head."""
    embeddings = parent.get_input_embeddings().weight
    state = {
        "model.embed_tokens.weight": embeddings,
        # The parent's head may be its embedding matrix (tied); the copy below unties them.
        "lm_head.weight": parent.get_output_embeddings().weight,
        **{f"model.norm.{k}": v for k, v in parent.model.norm.state_dict().items()},
    }
    for part, indices in selection.as_dict().items():
        for new, old in enumerate(indices):
            for key, value in parent.model.layers[old].state_dict().items():
                state[f"model.{part}.{new}.{key}"] = value
    state = {key: value.detach().clone() for key, value in state.items()}
    if config.adapter == "linear":
        state["model.adapter.weight"] = _adapter_weight(config, embeddings, adapter_init, seed)
    return state


def _adapter_weight(config: RecurrentConfig, like: torch.Tensor, init: str, seed: int) -> torch.Tensor:
    # Drawn on the CPU in fp32 (the generator's device), then moved and cast as the parent's weights: the same values
    # whatever device the parent is on, also under a `torch.device(...)` context.
    with torch.device("cpu"):
        adapter = LinearAdapter(config.text_config.hidden_size)
    generator = torch.Generator().manual_seed(seed)
    if init == "identity":
        adapter.reset_to_identity()
    elif init == "torch-default":
        # nn.Linear.reset_parameters' draw, from our generator instead of the global one: the same values as
        # `torch.manual_seed(seed); nn.Linear(2h, h, bias=False)`.
        nn.init.kaiming_uniform_(adapter.weight, a=math.sqrt(5), generator=generator)
    else:
        std = getattr(config.text_config, "initializer_range", 0.02)
        nn.init.normal_(adapter.weight, std=std, generator=generator)
    return adapter.weight.detach().to(device=like.device, dtype=like.dtype)
