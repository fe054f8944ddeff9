"""The model a training config describes: a saved model, a parent retrofitted or pruned on the fly, a random
init of a shape, or the final model of an earlier run (a chained phase)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..data import TokenStore
from ..defaults import depth_for_effort
from ..errors import RecurfitError
from ..model.compat import enable_activation_checkpointing
from ..model.families import family_of, supported_families
from ..model.init import scaled_init_
from ..model.loading import load_config, load_model, meta_model
from ..model.modeling import RecurrentForCausalLM
from ..surgery.pruning import prune_layers, untie_embeddings
from ..surgery.retrofit import retrofit
from .config import DepthConfig, ModelConfig, TrainConfig
from .parts import check_part_names, select_parts


def build_model(config: ModelConfig, depth: DepthConfig, seed: int) -> nn.Module:
    """fp32 master weights on the CPU; the trainer moves them. Recurrent unless `path` is a plain parent with
    no `shape` (the non-recurrent baseline, continued-trained in the same engine)."""
    check_sources(config)
    model = load_model(config.source, dtype=torch.float32, revision=config.revision)
    calibration = calibration_rows(config) if config.select != "paper" else None
    model = _restructure(model, config, depth, config.select, calibration, seed)
    if isinstance(model, RecurrentForCausalLM):
        model.config.mean_recurrence = depth.mean_recurrence
        model.config.depth_for_effort = depth_for_effort(depth.mean_recurrence)  # saved: the served defaults
        model.config.backprop_depth = depth.backprop_depth
        if config.state_init_std is not None:
            model.config.state_init_std = config.state_init_std
        if config.embedding_scale is not None:
            model.config.embedding_scale = config.embedding_scale
    else:
        try:  # a baseline is trained, and its FLOPs counted, by the layout of the families recurfit retrofits
            family_of(model.config)
        except ValueError:
            raise RecurfitError(
                f"model.path is a {model.config.model_type} model, which recurfit cannot train: it trains the "
                f"families it can retrofit ({supported_families()})."
            ) from None
        if config.embedding_scale is not None:
            raise RecurfitError(
                "model.embedding_scale applies to recurrent models; drop it for a non-recurrent baseline."
            )
    if config.untie_embeddings:
        untie_embeddings(model)
    if config.init == "random":
        scaled_init_(model, torch.Generator().manual_seed(seed))
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model.train()


def initial_model(config: TrainConfig, processes) -> tuple[nn.Module, nn.Module | None]:
    """(the model to train, the main process's built model to load it from, or None), its frozen parts frozen.

    One process builds it (`build_model`) and places it on its device. Under torchrun only the main process
    builds it, on the CPU; every other process makes the same structure from the main process's model config on
    the meta device (no weights, no host memory), which `distributed.fill_from_main` fills once it is sharded
    (FSDP2: each process receives its own shards) or placed (DDP). Under FSDP2 the main process trains such a
    structure too, filled from the model it built."""
    built = select_parts(build_model(config.model, config.depth, config.seed), config) if processes.is_main else None
    if not processes.grouped:
        return built.to(processes.device), None
    model_config = processes.broadcast(built.config if built is not None else None)
    if built is not None and config.distributed == "ddp":
        return built.to(processes.device), None  # DDP broadcasts it to the others when it wraps it
    structure = meta_model(model_config)
    if config.model.gradient_checkpointing:
        enable_activation_checkpointing(structure)
    return select_parts(structure.train(), config), built


def _restructure(
    model: nn.Module, config: ModelConfig, depth: DepthConfig, select: str, calibration, seed: int
) -> nn.Module:
    """The pruning and retrofit `config` asks for (the model as it is when it asks for neither); `seed` draws a
    `torch-default` adapter."""
    if config.prune_to is not None:
        if isinstance(model, RecurrentForCausalLM):
            raise RecurfitError(
                "model.prune_to prunes a parent model, but model.path is recurrent; drop model.prune_to."
            )
        model = _surgery(prune_layers, model, config.prune_to, calibration)
    layers = {"prelude": config.prelude, "core": config.core, "coda": config.coda} if config.core is not None else {}
    # select=angular without a shape retrofits too: the angular distance's knees choose the shape
    if config.shape is not None or layers or (select == "angular" and config.prune_to is None):
        if isinstance(model, RecurrentForCausalLM):
            raise RecurfitError(
                "model.shape (or model.select=angular) retrofits a parent model, but model.path is already "
                "recurrent; drop them."
            )
        model = _surgery(
            retrofit,
            model,
            tuple(config.shape) if config.shape else None,
            **layers,
            select=select,
            calibration=calibration,
            adapter=config.adapter,
            adapter_init=config.adapter_init,
            seed=seed,
            mean_recurrence=depth.mean_recurrence,
            backprop_depth=depth.backprop_depth,
        )
    return model


def check_plan(config: TrainConfig) -> nn.Module | None:
    """What --dry-run checks without loading weights or data: every token store opens, and the parent (its config
    alone, on the meta device) holds the pruning and shape asked for. Returns the model the run trains, on the
    meta device with its frozen parts frozen (for the memory plan); None when only weights can tell: a chained
    run whose earlier run has no final model yet, or a shape the angular distance chooses."""
    for phase in config.data.phases:
        for source in phase.sources:
            TokenStore(source.path, "train")
    for path in config.data.validation:
        TokenStore(path, "val")
    if config.model.init_from is not None:  # a chained run: its model is the earlier run's, perhaps not trained yet
        final = Path(config.model.source)
        return planned_parts(meta_model(load_config(str(final))), config) if (final / "config.json").is_file() else None
    check_sources(config.model)
    model = meta_model(load_config(config.model.source))
    # ShortGPT and the angular distance pick layers from weights; any selection fits the same shapes, and the
    # shape the angular distance's knees choose is known only from the weights (it is a retrofit all the same)
    if config.model.select == "angular" and config.model.shape is None:
        check_part_names(config, True)
        return None
    return planned_model(config, model)


def planned_model(config: TrainConfig, parent: nn.Module) -> nn.Module:
    """`parent` (on the meta device, or with weights of any values) made into the model the run trains, without
    calibration data: pruned and retrofitted as the config asks, its parts frozen as the run freezes them."""
    return planned_parts(_restructure(parent, config.model, config.depth, "paper", None, config.seed), config)


def planned_parts(model: nn.Module, config: TrainConfig) -> nn.Module:
    """`model` (meta device) with its parts frozen as the run freezes them, untied if the run unties it."""
    if config.model.untie_embeddings:
        untie_embeddings(model)
    return select_parts(model, config)


def teacher_parameters(config: TrainConfig) -> int:
    """The distillation teacher's parameter count, from its config alone (0 without distillation)."""
    if config.distill is None:
        return 0
    source, _ = config.distill.source(config.model)
    return sum(p.numel() for p in meta_model(load_config(source)).parameters())


def check_sources(config: ModelConfig) -> None:
    """Fail before any compute when a chained run or a calibration store is not there."""
    if config.init_from is not None and not (Path(config.source) / "config.json").is_file():
        raise RecurfitError(
            f"model.init_from: {config.init_from} holds no finished run ({config.source} is missing); "
            "train that run first, or point model.init_from at a run folder that has a `final` model."
        )
    if config.calibration is not None and not Path(config.calibration).is_dir():
        raise RecurfitError(
            f"model.calibration: no token store at {config.calibration}; prepare it with `recurfit data prepare`."
        )


def calibration_rows(config: ModelConfig) -> torch.Tensor:
    """The first `calibration_rows` validation rows of the calibration store, as token ids."""
    store = TokenStore(config.calibration, "val")
    rows = store[: config.calibration_rows]
    if len(rows) == 0:
        raise RecurfitError(f"model.calibration: {config.calibration} has no validation rows to score layers on.")
    return torch.from_numpy(rows.astype("int64"))


def _surgery(operation, *args, **kwargs):
    try:
        return operation(*args, **kwargs)
    except ValueError as problem:  # surgery's messages name the problem; say where it came from
        raise RecurfitError(f"model: {problem}") from None


def is_recurrent(model: nn.Module) -> bool:
    return isinstance(model, RecurrentForCausalLM)
