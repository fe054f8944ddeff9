"""Continued pretraining of retrofitted (and baseline) models: config, optimisers, checkpoints, the loop."""

from .config import TrainConfig, load_config
from .loop import Trainer, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "Trainer", "load_config", "train"]
