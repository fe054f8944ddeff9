"""Saving a run: resumable checkpoints (and resuming from them, or carrying an earlier run's state), loadable
snapshots over training, and the final model with its card.

`Saving` is the part of the `Trainer` (loop.py) that does this; it uses the trainer's model, optimizers,
schedulers, stream, counters, processes and folder.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import RecurfitError
from ..io.files import staged_directory
from ..model.card import CARD, write_model_card
from ..model.loading import load_config, meta_model, save_tokenizer
from ..progress import size_text
from .checkpoint import (
    Checkpoint,
    carry_optimizer_states,
    gather_state,
    newest_readable,
    restore,
    save_checkpoint,
)
from .counting import Counters
from .lora import merged
from .metrics import validation_columns
from .optim import advance
from .parts import check_carry
from .run_folder import TRAINING_RECORD, RunFolder, changed_settings, check_continuation


class Saving:
    """Checkpoints, snapshots and the final model of a `Trainer`."""

    @contextmanager
    def _timed(self, what: str):
        """Log how long saving `what` (checkpoint, snapshot, final) took, all processes waiting included."""
        started = time.perf_counter()
        yield
        self._write(
            {"kind": "save", "step": self.counters.step, "what": what, "seconds": time.perf_counter() - started}
        )

    def checkpoint(self) -> None:
        with self._timed("checkpoint"):
            self._write_checkpoint()

    def _write_checkpoint(self) -> None:
        trainer = {"counters": vars(self.counters), "stream": self.stream.state_dict(), "config": self.config.to_dict()}
        root, keep = self.out / "checkpoints", self.config.checkpoint.keep
        save_checkpoint(
            root, self.counters.step, self.model, self.optimizers, self.schedulers, trainer, keep, self.processes
        )

    def _resume(self) -> None:
        """Continue from the newest readable checkpoint; with none yet, start from step 0 in the same folder."""
        checkpoint = self._newest_checkpoint(self.folder.checkpoints)
        if checkpoint is None:
            self._say(f"--resume: {self.out} holds no checkpoint yet; starting from step 0.")
            return
        changed = changed_settings(checkpoint.trainer["config"], self.config.to_dict())
        if changed:
            key = changed[0]
            raise RecurfitError(
                f"--resume: {key} differs from the run's ({', '.join(changed)} changed since {checkpoint.folder}); "
                f"resume with the run's own settings, `recurfit train {self.out / 'config.yaml'} --resume`, "
                "or start a new run (--force, or another out=)."
            )
        trainer = restore(checkpoint, self.model, self.optimizers, self.schedulers)
        self.counters = Counters(**trainer["counters"])
        self.stream.load_state_dict(trainer["stream"])
        self._say(f"Resuming {self.out} from step {self.counters.step} ({checkpoint.folder}).")

    def _newest_checkpoint(self, root: Path) -> Checkpoint | None:
        """`newest_readable`, verified once: the processes share the hashing of each checkpoint's files (a 1B
        model's are ~12 GB: hashed on every process the wait would multiply, on the main process alone the others
        would wait for it) and choose the same one."""
        return newest_readable(root, warn=self._say, processes=self.processes)

    def _carry_state(self) -> None:
        """model.carry_state: the optimizer state and data position of the run this one continues; with
        model.continue_schedule also its step count, so that the schedules and depth draws go on from there."""
        continuing = self.config.model.continue_schedule
        setting = "model.continue_schedule" if continuing else "model.carry_state"
        source = RunFolder(Path(self.config.model.init_from))
        checkpoint = self._newest_checkpoint(source.checkpoints)
        if checkpoint is None:
            raise RecurfitError(f"{setting}: {source.path} has no checkpoint to carry the state from.")
        check_carry(checkpoint.trainer["config"], self.config)
        if continuing:
            check_continuation(source.path, checkpoint.trainer["config"], checkpoint.step, self.config.to_dict())
        carry_optimizer_states(checkpoint, self.model, self.optimizers, shared_only=continuing)
        try:
            self.stream.load_state_dict(checkpoint.trainer["stream"])
        except RecurfitError:
            raise RecurfitError(
                f"{setting} continues the data stream of {source.path}, which read other data: give the "
                f"same data.phases sources and seed, or drop {setting}."
            ) from None
        if continuing:
            self.counters = Counters(**{**checkpoint.trainer["counters"], "bad_in_row": 0})
            self.start_step = self.counters.step
            advance(self.schedulers, self.start_step)

    def training_record(self) -> dict:
        """Where training stands: what a snapshot's and the final model's `training.json` hold, so an evaluation
        over training can place each model on the paper's axes (tokens, both FLOPs measures)."""
        counters = self.counters
        return {
            "run": self.out.name,
            "step": counters.step,
            "steps": self.config.steps,
            "tokens": counters.tokens,
            "flops": counters.flops,
            "flops_paper": counters.flops_paper,
            "flops_teacher": counters.flops_teacher,  # distillation's teacher forwards (0 without), not in either
            "mean_recurrence": self.config.depth.mean_recurrence if self.recurrent else None,
            "recurrent": self.recurrent,
            "earlier": self.earlier,  # the runs this one continues (model.init_from): not in the counters above
        }

    def _save_model(
        self, target: Path, card_validation: dict | None = None, card: bool = False, dtype: str = "float32"
    ) -> None:
        """The model as a `from_pretrained` folder, with its tokenizer and `training.json`, written atomically
        (collective under FSDP: every rank gathers, the main one writes); its floating-point weights in `dtype`."""
        model = merged(self.model)  # LoRA adapters merged: the folder loads as a plain recurfit model
        model_state, _ = gather_state(model, [])
        if self.processes.is_main:
            with staged_directory(target, replace=True) as staging:
                save_weights(model, staging, model_state, dtype)
                if self.tokenizer is not None:
                    save_tokenizer(self.tokenizer, staging)
                record = self.training_record()
                (staging / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
                if card:
                    self._write_card(staging, model, card_validation)
        self.processes.barrier()

    def _write_card(self, folder: Path, model, validation: dict | None) -> None:
        """The model card of the model saved in `folder`: the recipe, the tokens and the `validation` record."""
        record = self.training_record()
        training = {"config": self.config.to_dict(), **record, "steps": record["step"]}
        cells = (validation["step"], *validation_columns(validation)) if validation else None
        write_model_card(folder, model, self.out.name, training, cells)

    def write_card(self, folder: Path, validation: dict) -> None:
        """Replace the card of the model saved in `folder` by one with `validation` (the final validation, run
        after the export): written aside, then moved over the old card (main process)."""
        if self.processes.is_main:
            model = meta_model(load_config(str(folder)))  # what the card reads: the config and parameter counts
            with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".card-") as aside:
                self._write_card(Path(aside), model, validation)
                os.replace(Path(aside) / CARD, folder / CARD)
        self.processes.barrier()

    def export(self, validation: dict | None = None) -> Path:
        """The final model as a `from_pretrained` folder (with the tokenizer when the model had one) and its model
        card: the recipe, the tokens and the last `validation` record."""
        final = self.out / "final"
        with self._timed("final"):
            self._save_model(final, validation, card=True)
        return final

    def snapshot(self) -> None:
        """A loadable model of this step under OUT/snapshots (weights only: the resumable state is a checkpoint's),
        in `snapshots.dtype`."""
        with self._timed("snapshot"):
            target = self.folder.snapshots / f"step-{self.counters.step:06d}"
            self._save_model(target, dtype=self.config.snapshots.dtype)

    def _announce_snapshots(self) -> None:
        """What the snapshots will take on disk, said before the first one is written."""
        every = self.config.snapshots.every
        if not every:
            return
        # At the start and every `every` steps before the end, which is final/.
        start, end = self.start_step, self.config.end
        count = 1 + (end - 1) // every - start // every if end > start else 0
        floating = getattr(torch, self.config.snapshots.dtype).itemsize
        size = sum(
            t.numel() * (floating if t.is_floating_point() else t.element_size())
            for t in {p.data_ptr(): p for p in self.model.state_dict().values()}.values()
        )
        self._say(
            f"Snapshots: every {every} steps, {count} × {size_text(size)} = {size_text(count * size)} "
            f"in {self.folder.snapshots}."
        )


def save_weights(model, folder: Path, state: dict, dtype: str) -> None:
    """`model.save_pretrained(folder)` with `state`'s floating-point tensors in `dtype`, and config.json saying so
    (transformers writes the model's own dtype there)."""
    if dtype != "float32":
        state = {name: t.to(getattr(torch, dtype)) if t.is_floating_point() else t for name, t in state.items()}
    model.save_pretrained(folder, state_dict=state)
    settings = json.loads((folder / "config.json").read_text())
    if settings.get("dtype", dtype) != dtype:
        settings["dtype"] = dtype
        (folder / "config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
