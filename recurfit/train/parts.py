"""Training part of a model: `model.trainable` names the parts that train; every other parameter is frozen
(`requires_grad` False), so it gets no gradient and no place in any optimizer (`optim.build_optimizers`).

    recurrent model:         embeddings, prelude, adapter, core, coda (+ final norm), head
    non-recurrent baseline:  embeddings, layers (+ final norm), head

With `lora:`, the base weights are frozen and LoRA matrices train (`lora.py`), plus any parts `model.trainable`
names in full.
"""

from __future__ import annotations

from torch import nn

from ..defaults import BASELINE_PARTS, RECURRENT_PARTS
from ..errors import RecurfitError
from ..model.modeling import RecurrentForCausalLM
from .config import TrainConfig
from .lora import add_lora, is_lora_parameter


def part_modules(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The modules that make up each part of `model`, in its kind's part names."""
    body = model.model
    if isinstance(model, RecurrentForCausalLM):
        layers = {"prelude": [body.prelude], "adapter": [body.adapter], "core": [body.core], "coda": [body.coda]}
        layers["coda"].append(body.norm)
    else:
        layers = {"layers": [body.layers, body.norm]}
    return {"embeddings": [model.get_input_embeddings()], **layers, "head": [model.get_output_embeddings()]}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer of `model` (of any family), in order."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def parameter_parts(model: nn.Module) -> dict[int, set[str]]:
    """The parts each parameter (by id) belongs to: two for a tied embedding matrix, one otherwise."""
    owners: dict[int, set[str]] = {}
    for part, modules in part_modules(model).items():
        for module in modules:
            for parameter in module.parameters():
                owners.setdefault(id(parameter), set()).add(part)
    return owners


def check_part_names(config: TrainConfig, recurrent: bool) -> tuple[str, ...]:
    """The parts of this kind of model, after checking that `model.trainable` and `lora.parts` name only those."""
    valid, kind = (RECURRENT_PARTS, "a recurrent model") if recurrent else (BASELINE_PARTS, "a non-recurrent baseline")
    for key, names in (("model.trainable", config.model.trainable), ("lora.parts", config.lora and config.lora.parts)):
        wrong = [name for name in names or [] if name not in valid]
        if wrong:
            raise RecurfitError(f"{key}: {kind} has no part {wrong[0]!r}; its parts are {', '.join(valid)}.")
    return valid


def trained_in_full(config: TrainConfig, valid: tuple[str, ...]) -> set[str]:
    """The parts whose every weight trains: `model.trainable`, or when unset all of them (none beside LoRA)."""
    if config.model.trainable is not None:
        return set(config.model.trainable)
    return set() if config.lora is not None else set(valid)


def select_parts(model: nn.Module, config: TrainConfig) -> nn.Module:
    """Add the LoRA adapters `config.lora` asks for, then freeze every parameter outside `model.trainable`
    (in place; returns `model`). A one-line RecurfitError for a part this kind of model lacks, a tied matrix
    half trained, or nothing left to train."""
    valid = check_part_names(config, isinstance(model, RecurrentForCausalLM))
    trainable = trained_in_full(config, valid)
    owners = parameter_parts(model)  # before LoRA: its new matrices belong to no part
    if config.lora is not None:
        add_lora(model, config.lora, part_modules(model), config.seed)
    for name, parameter in model.named_parameters():
        if is_lora_parameter(name):
            continue
        parts = owners.get(id(parameter))
        if parts is None:
            raise RecurfitError(f"model.trainable: recurfit does not know which part {name} belongs to.")
        if len(parts & trainable) not in (0, len(parts)):
            raise RecurfitError(
                f"model.trainable: {' and '.join(sorted(parts))} share one matrix in this model (tied embeddings); "
                "list both or neither, or set model.untie_embeddings=true."
            )
        parameter.requires_grad_(bool(parts & trainable))
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise RecurfitError(
            f"model.trainable: {', '.join(sorted(trainable))} hold no parameters in this model (the add adapter has "
            "none); name a part that does."
        )
    return model


def trained_parts_line(model: nn.Module, config: TrainConfig) -> str | None:
    """The line a run prints when part of the model is frozen: what trains, and how many parameters."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trained == total:
        return None
    valid = RECURRENT_PARTS if isinstance(model, RecurrentForCausalLM) else BASELINE_PARTS
    what = sorted(trained_in_full(config, valid), key=valid.index)
    if config.lora is not None:
        lora = config.lora
        what.append(
            f"LoRA rank {lora.rank} on {', '.join(lora.targets)} of {', '.join(lora.parts or ('every layer',))}"
        )
    return f"Training {'; '.join(what)}: {trained:,} of {total:,} parameters; the rest is frozen."


def check_carry(earlier: dict, config: TrainConfig) -> None:
    """model.carry_state continues the optimizer state of a run that trained the same parts, without LoRA (whose
    matrices were merged into the final model and start afresh here). model.continue_schedule may change the
    trained parts: what trains in both runs keeps its state, what is new here starts afresh, and the state of what
    no longer trains is dropped."""
    trainable = earlier.get("model", {}).get("trainable")
    lora = earlier.get("lora") is not None or config.lora is not None
    if config.model.continue_schedule and lora:
        raise RecurfitError(
            "model.continue_schedule carries the optimizer state, and LoRA's (merged into that run's final model) "
            "cannot be continued: train both runs without lora, or drop model.continue_schedule."
        )
    if not config.model.continue_schedule and (lora or trainable != config.model.trainable):
        raise RecurfitError(
            f"model.carry_state carries optimizer state for the same trained parts (that run: model.trainable "
            f"{trainable}, here {config.model.trainable}) and no LoRA; drop model.carry_state to start its "
            "optimizer afresh, or set model.continue_schedule to continue that run as one."
        )
