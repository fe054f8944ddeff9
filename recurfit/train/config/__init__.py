"""The training config: one YAML file, bound to the schema's dataclasses, plus `key.sub=value` overrides.

schema.py      the sections (`TrainConfig` and its `*Config`s): every key, its type, default and meaning
validation.py  the rules on values and between sections (`validate`: every problem in one error)
binder.py      YAML and overrides into dataclasses: unknown keys ("did you mean"), types, Literal choices
"""

from __future__ import annotations

from pathlib import Path

from .binder import apply_overrides, bind, read_yaml
from .schema import (
    BatchConfig,
    CheckpointConfig,
    DataConfig,
    DepthConfig,
    DistillConfig,
    EvalConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    PhaseConfig,
    SnapshotConfig,
    SourceWeight,
    SuperviseConfig,
    TrainConfig,
)
from .validation import unknown_parts, validate

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "DataConfig",
    "DepthConfig",
    "DistillConfig",
    "EvalConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PhaseConfig",
    "SnapshotConfig",
    "SourceWeight",
    "SuperviseConfig",
    "TrainConfig",
    "load_config",
    "unknown_parts",
    "validate",
]


def load_config(path: str | Path | None, overrides: list[str] = (), base: dict | None = None) -> TrainConfig:
    """Read a YAML config (or start from `base`), apply `a.b=value` overrides, validate."""
    return validate(bind(TrainConfig, apply_overrides(read_yaml(path, base), overrides)))
