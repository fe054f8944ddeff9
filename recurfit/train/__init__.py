"""Continued pretraining of retrofitted (and baseline) models: config, optimisers, checkpoints, the loop."""

from .config import TrainConfig, load_config
from .loop import Trainer, TrainResult, already_finished, train

__all__ = ["TrainConfig", "TrainResult", "Trainer", "already_finished", "load_config", "train"]
