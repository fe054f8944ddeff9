"""The rules of a run folder (`out`): what a stop leaves in it, and what `train`, `--resume` and `--force` do.

    nothing there                 train: start                 --resume: start
    stopped before a checkpoint   train: refused (say which)   --resume: start again from step 0, same folder
    stopped at a checkpoint       train: refused               --resume: continue from the newest readable one
    finished (`final/` exists)    train: refused               --resume: say so and change nothing
    any of these                  --force: start over; the old run is deleted once the new one is set up

The folder is owned by one process at a time (`recurfit.io.lock`), so nothing here races another job.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import RecurfitError
from ..io.runs import flatten_settings
from .checkpoint import TRAINER, checkpoint_folders

# In a snapshot and in `final/`: the step, tokens and FLOPs of training so far (Trainer.training_record).
TRAINING_RECORD = "training.json"
# What a run writes into `out`; --force deletes these and nothing else (out= may be a folder with other files).
RUN_FILES = ("log.jsonl", "checkpoints", "snapshots", "final", "tensorboard", "wandb", "config.yaml")
# Settings that may differ when a run is resumed: where and how it runs, not what it computes.
RESUMABLE_CHANGES = (
    "out",
    "precision",
    "compile",
    "distributed",
    "distributed_timeout",
    "fsdp_shard_size",
    "batch.micro",
    "checkpoint",
    "snapshots",
    "log",
    "eval",
    "data.validation",
    "model.gradient_checkpointing",
    "max_bad_steps",
    "optimizer.muon_dtype",  # a precision choice, like `precision`
)


def earlier_training(init_from: str | None, continued: bool = False) -> dict | None:
    """What the runs this one continues (`model.init_from`, and theirs) cost: their tokens and FLOPs summed, and
    their names, first run first; recorded in `training.json` so that curves over training FLOPs count them.
    None when the run starts from a parent, or from a final model saved before `training.json` existed.

    `continued` (model.continue_schedule): this run's counters go on from that run's, so they already hold its
    tokens and FLOPs; only what came before that run (its own `earlier`) is counted here, beside the names."""
    record = Path(init_from) / "final" / TRAINING_RECORD if init_from else None
    if record is None or not record.is_file():
        return None
    final = json.loads(record.read_text())
    before = final.get("earlier") or {}
    earlier = {"runs": [*before.get("runs", []), final["run"]]}
    for key in ("tokens", "flops", "flops_paper", "flops_teacher"):
        earlier[key] = before.get(key, 0) + (0 if continued else final.get(key, 0))
    if continued:  # the run whose counters (with those of any run it continued) go on in this run's
        earlier["continued"] = final["run"]
    return earlier


# What makes two runs one (model.continue_schedule): the rows read (seed, data, batch), the LR schedule (its length,
# shape and peak LRs; the optimizer, whose moments carry over) and the depth curriculum and draws.
SCHEDULE_SETTINGS = (
    "seed",
    "steps",
    "batch.global",
    "data.phases",
    "optimizer.name",
    "optimizer.lr",
    "optimizer.muon_lr",
    "optimizer.warmup",
    "optimizer.decay",
    "optimizer.decay_shape",
    "optimizer.min_lr_ratio",
    "depth.mean_recurrence",
    "depth.backprop_depth",
    "depth.curriculum",
    "depth.curriculum_fraction",
    "depth.backprop_curriculum",
    "depth.backprop_curriculum_fraction",
    "depth.paper_ramp_rounding",
    "depth.fixed",
    "depth.draw",
)


def check_continuation(source: Path, earlier: dict, stopped_at: int, now: dict) -> None:
    """model.continue_schedule: `now` (a config dict) may continue the run in `source`, whose config was `earlier`
    and whose newest checkpoint is at step `stopped_at`: the same schedule, with steps left after that step.
    A one-line RecurfitError otherwise."""
    final = source / "final" / TRAINING_RECORD
    finished_at = json.loads(final.read_text()).get("step") if final.is_file() else None
    if finished_at is not None and finished_at != stopped_at:
        raise RecurfitError(
            f"model.continue_schedule: {source}'s newest checkpoint is at step {stopped_at}, its final model at step "
            f"{finished_at}; continue a run whose last checkpoint is its final step (train it again)."
        )
    before, after = flatten_settings(earlier), flatten_settings(now)
    for key in SCHEDULE_SETTINGS:
        shared = before.keys() & after.keys()  # a setting newer than that run is not compared
        values = [(k, before[k], after[k]) for k in shared if k == key or k.startswith(key + ".")]
        for name, old, new in sorted(values, key=lambda value: value[0]):
            if old != new:
                why = " (steps is the length of the whole schedule, both runs together)" if key == "steps" else ""
                raise RecurfitError(
                    f"model.continue_schedule continues {source} as one run: give the same {name} ({old} there, "
                    f"{new} here){why}, or drop model.continue_schedule to start a schedule of its own."
                )
    end = now.get("stop_at") or now["steps"]
    if end <= stopped_at:
        raise RecurfitError(
            f"model.continue_schedule: {source} already ran to step {stopped_at} of its {earlier['steps']}-step "
            f"schedule, so this run (to step {end}) has nothing left to train; train that run with stop_at below "
            "steps, or drop model.continue_schedule to start a schedule of its own."
        )


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.snapshots = self.path / "snapshots"

    @property
    def finished(self) -> bool:
        return (self.path / "final").is_dir()

    @property
    def started(self) -> bool:
        return self.finished or bool(checkpoint_folders(self.checkpoints)) or (self.path / "log.jsonl").exists()

    def last_step(self) -> int | None:
        """The step of the newest checkpoint, as its trainer.json says (None: no checkpoint)."""
        folders = checkpoint_folders(self.checkpoints)
        try:
            return json.loads((folders[-1] / TRAINER).read_text())["counters"]["step"] if folders else None
        except (OSError, ValueError, KeyError, TypeError):
            return int(folders[-1].name.removeprefix("step-"))

    def resume_hint(self) -> str:
        """After a stop: the newest checkpoint, and the command that continues the run from it."""
        step = self.last_step()
        where = (
            f"its last checkpoint is {checkpoint_folders(self.checkpoints)[-1]} (step {step})"
            if step is not None
            else "it has no checkpoint yet, so --resume starts again from step 0"
        )
        return f"{where}; continue with `recurfit train {self.path / 'config.yaml'} --resume`."

    @staticmethod
    def check_flags(resume: bool, force: bool) -> None:
        if resume and force:
            raise RecurfitError("--resume continues the run in out and --force starts it over: give one of them.")

    def check_start(self, resume: bool, force: bool) -> None:
        """Refuse a fresh start over an earlier run (saying what it holds and the two ways on)."""
        self.check_flags(resume, force)
        if resume or force or not self.started:
            return
        if self.finished:
            held = "a finished run; pass --force to train it again from the start"
        else:
            step = self.last_step()
            where = f"stopped at step {step}" if step is not None else "stopped before its first checkpoint"
            held = f"a run {where}; pass --resume to continue it, or --force to start over"
        raise RecurfitError(f"{self.path} already holds {held} (or set out= elsewhere).")

    def remove_leftovers(self) -> None:
        """Staging folders and files of a process that died (the caller owns the folder, so they are stale)."""
        for folder in (self.path, self.checkpoints, self.snapshots):
            for pattern in (".*.partial-*", ".*.old-*"):
                for leftover in folder.glob(pattern):
                    shutil.rmtree(leftover, ignore_errors=True)
        (self.path / "log.jsonl.partial").unlink(missing_ok=True)  # the log's rewrite on resume

    def clear(self) -> None:
        """--force: delete the earlier run's files."""
        for name in RUN_FILES:
            path = self.path / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


def changed_settings(started_with: dict, now: dict) -> list[str]:
    """Keys (dotted) whose value differs from the one the run was started with, except RESUMABLE_CHANGES."""
    before, after = flatten_settings(started_with), flatten_settings(now)
    changed = [key for key in after if key in before and before[key] != after[key]]
    return [
        key
        for key in changed + _switched_sections(before, after)
        if not any(key == allowed or key.startswith(allowed + ".") for allowed in RESUMABLE_CHANGES)
    ]


def _switched_sections(before: dict, after: dict) -> list[str]:
    """Optional sections (`distill`, `depth.supervise`) switched on or off: null on one side, settings on the
    other. (Other keys on one side only are settings newer than the run, and are not compared.)"""
    found = []
    for one, other in ((after, before), (before, after)):
        for key in one.keys() - other.keys():
            parts = key.split(".")
            sections = (".".join(parts[:i]) for i in range(1, len(parts)))
            found += [section for section in sections if section in other and other[section] is None]
    return list(dict.fromkeys(found))
