"""Checkpoints that are whole or absent, and resume from the latest.

    OUT/checkpoints/step-000120/
        model.safetensors   full (unsharded) weights, keyed like the model's state dict
        optimizer.pt        optimiser and LR-schedule states, keyed by parameter name (torch.load weights_only)
        trainer.json        step, data-stream position, counters, and the config the run was started with

A checkpoint is written into a hidden staging folder and renamed into place, so a crash mid-write leaves only
the staging folder (ignored and cleaned up), never a `step-*` folder that loads wrong. The last `keep` are
kept. The state dicts go through `torch.distributed.checkpoint.state_dict`, which gathers FSDP2 shards into
full tensors (and is a no-op for a plain or DDP model), so every checkpoint loads on any number of processes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import RecurfitError
from ..files import staged_directory

STEP_FOLDER = re.compile(r"^step-(\d{6,})$")
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def checkpoint_folders(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_FOLDER.match(p.name))]
    return [path for _, path in sorted(found)]


def gather_state(model, optimizers) -> tuple[dict, list[dict]]:
    """Full model and optimiser state dicts (collective under FSDP: call on every rank)."""
    model_state = get_model_state_dict(model, options=FULL)
    optimizer_states = [get_optimizer_state_dict(model, optimizer, options=FULL) for optimizer in optimizers]
    return model_state, optimizer_states


def write_checkpoint(root: Path, step: int, model_state: dict, optimizer_states: list[dict], schedulers, trainer: dict, keep: int) -> Path:
    """Write a checkpoint atomically (rank 0 only) and drop all but the newest `keep`."""
    target = root / f"step-{step:06d}"
    try:
        with staged_directory(target, replace=True) as staging:
            save_file(_unshared(model_state), staging / "model.safetensors")
            torch.save(
                {"optimizers": optimizer_states, "schedulers": [s.state_dict() for s in schedulers]},
                staging / "optimizer.pt",
            )
            (staging / "trainer.json").write_text(json.dumps(trainer, indent=2) + "\n")
    except OSError as problem:  # out of disk, permissions: the staging folder is gone, older checkpoints intact
        raise RecurfitError(
            f"Cannot write the checkpoint {target} ({problem.strerror or problem}); free space or set out= "
            "elsewhere, then --resume from the last complete checkpoint."
        ) from None
    for old in checkpoint_folders(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(".step-*.partial-*"):  # staging folders of a run that was killed mid-write
        shutil.rmtree(leftover, ignore_errors=True)
    return target


def _unshared(state: dict) -> dict:
    """safetensors refuses tensors that share memory (tied embeddings): give the duplicates their own copy."""
    seen, result = set(), {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        key = (tensor.data_ptr(), tensor.shape)
        result[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return result


def load_checkpoint(folder: Path, model, optimizers, schedulers) -> dict:
    """Restore model, optimisers and schedules in place (on every rank); return the trainer state."""
    try:
        model_state = load_file(folder / "model.safetensors")
        saved = torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu")
        trainer = json.loads((folder / "trainer.json").read_text())
    except (OSError, ValueError, RuntimeError) as problem:
        raise RecurfitError(f"Cannot read the checkpoint {folder} ({problem}); delete it to resume from an older one.")
    if len(saved["optimizers"]) != len(optimizers):
        raise RecurfitError(f"{folder} was written with another optimizer; resume with the config the run started with.")
    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))
    for optimizer, state in zip(optimizers, saved["optimizers"]):
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    for scheduler, state in zip(schedulers, saved["schedulers"]):
        scheduler.load_state_dict(state)
    return trainer
