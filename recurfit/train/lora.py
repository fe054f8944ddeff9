"""LoRA through PEFT: adapters injected into the decoder layers of chosen parts, trained in place, and merged
into the base weights for the exported model, which then loads without PEFT.

PEFT is imported lazily: only runs with a `lora:` section need it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..defaults import LAYER_PARTS
from ..errors import RecurfitError
from ..extras import require
from .config import LoraConfig

LORA_MARKERS = (".lora_A.", ".lora_B.")  # PEFT's names for a LoRA layer's two factors


def _peft():
    require("`lora:` in a training config", "peft")
    import peft

    return peft


def is_lora_parameter(name: str) -> bool:
    return any(marker in name for marker in LORA_MARKERS)


def lora_targets(model: nn.Module, settings: LoraConfig, parts: dict[str, list[nn.Module]]) -> list[str]:
    """The full names of the linear modules named `settings.targets` in the layers of `settings.parts`."""
    names = {id(module): name for name, module in model.named_modules()}
    chosen = [part for part in settings.parts or LAYER_PARTS if part in parts]
    linear, found = set(), []
    for part in chosen:
        layers = parts[part][0]  # the part's decoder layers (its ModuleList; not the final norm)
        for name, module in layers.named_modules():
            if isinstance(module, nn.Linear):
                leaf = name.rpartition(".")[2]
                linear.add(leaf)
                if leaf in settings.targets:
                    found.append(names[id(module)])
    missing = [target for target in settings.targets if not any(n.endswith("." + target) for n in found)]
    if missing or not found:
        raise RecurfitError(
            f"lora.targets: {(missing or settings.targets)[0]!r} is no linear module of the layers of "
            f"{', '.join(chosen) or 'the parts named'}; they have {', '.join(sorted(linear)) or 'none'}."
        )
    return found


def add_lora(model: nn.Module, settings: LoraConfig, parts: dict[str, list[nn.Module]], seed: int) -> nn.Module:
    """Inject LoRA layers (PEFT's `inject_adapter_in_model`) into `model` in place. B starts at zero, so the
    model computes what it did; A is drawn from a generator seeded by `seed`, so a run starts the same way."""
    peft = _peft()
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=lora_targets(model, settings, parts),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.inject_adapter_in_model(config, model)


def merged(model: nn.Module) -> nn.Module:
    """A copy of `model` with every LoRA layer merged into its base weight and replaced by it (PEFT's
    merge-and-unload), so it saves as a plain model; `model` itself when it has no LoRA layers."""
    peft = _peft() if any(is_lora_parameter(name) for name, _ in model.named_parameters()) else None
    if peft is None:
        return model
    copied = copy.deepcopy(model)
    for name, module in list(copied.named_modules()):
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()
            parent, _, leaf = name.rpartition(".")
            setattr(copied.get_submodule(parent), leaf, module.get_base_layer())
    return copied
