"""A training run evaluated at every snapshot: the paper's curves of accuracy (or loss) against training FLOPs.

`recurfit eval tasks RUN` (or `eval loss RUN`) finds the run's models, `snapshots/step-*` and `final/` (each with
the `training.json` the trainer writes), and evaluates each recurrent snapshot at one test recurrence, the run's
mean training recurrence as the paper's curves use it, and the final model at every requested recurrence:

    OUT/evaluation.json     the run, what is measured and how (a later call must ask for the same)
    OUT/step-001000/        results.json and table.md of one model, its step, tokens and FLOPs in `details`
    ...
    OUT/step-026000/        the final model (details["final"]: true), over all of --recurrence

Each model's folder is written whole when its evaluation ends, so an interrupted evaluation of fifty snapshots
continues where it stopped: a model whose folder exists is not evaluated again.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from rich.console import Console

from ..errors import RecurfitError
from ..io.files import check_output, staged_directory

if TYPE_CHECKING:
    from .results import Sweep  # imports torch: not needed to tell a run folder from a model (`is_run`)

FORMAT = "recurfit-run-evaluation/1"
SETTINGS, TRAINING = "evaluation.json", "training.json"
SNAPSHOT = re.compile(r"^step-(\d{6,})$")


@dataclass
class Snapshot:
    """One model of a run: a snapshot folder or `final/`, and where training stood when it was saved."""

    path: Path
    training: dict  # step, tokens, flops, flops_paper, mean_recurrence, recurrent (Trainer.training_record)
    final: bool = False

    @property
    def step(self) -> int:
        return self.training["step"]

    @property
    def folder_name(self) -> str:
        return f"step-{self.step:06d}"


def is_run(path: str | Path | None) -> bool:
    """A training run's folder (its config.yaml beside snapshots/ or final/), rather than a model folder."""
    if path is None:
        return False
    path = Path(path)
    return (path / "config.yaml").is_file() and ((path / "snapshots").is_dir() or (path / "final").is_dir())


def is_run_evaluation(path: str | Path) -> bool:
    """A folder `evaluate_run` wrote (rather than one model's results)."""
    return (Path(path) / SETTINGS).is_file()


def run_config(run: Path) -> dict:
    return yaml.safe_load((Path(run) / "config.yaml").read_text()) or {}


def find_snapshots(run: Path) -> list[Snapshot]:
    """The run's models in step order: every snapshot, then the final model (if the run finished)."""
    run = Path(run)
    found = []
    folders = sorted(p for p in (run / "snapshots").glob("step-*") if p.is_dir() and SNAPSHOT.match(p.name))
    for folder in folders:
        found.append(Snapshot(folder, _training_record(folder)))
    final = run / "final"
    if final.is_dir():
        found.append(Snapshot(final, _training_record(final), final=True))
    if not found:
        raise RecurfitError(
            f"{run} has no snapshots and no final model yet: train with `snapshots.every=N` (and let it run), or "
            "evaluate a model folder instead."
        )
    return found


def _training_record(folder: Path) -> dict:
    try:
        return json.loads((folder / TRAINING).read_text())
    except (OSError, ValueError):
        raise RecurfitError(
            f"{folder} has no readable {TRAINING} (the step, tokens and FLOPs it was saved at): it was written by an "
            "older recurfit; evaluate it as a model folder instead."
        ) from None


def select(snapshots: list[Snapshot], steps: Sequence[int] | None) -> list[Snapshot]:
    """The snapshots at `steps` (None: all); a step without a snapshot is an error listing those there are."""
    if steps is None:
        return snapshots
    by_step = {snapshot.step: snapshot for snapshot in snapshots}
    missing = [step for step in steps if step not in by_step]
    if missing:
        raise RecurfitError(
            f"--steps: no snapshot at step {', '.join(map(str, missing))}; the run has {sorted(by_step)}."
        )
    return [by_step[step] for step in sorted(set(steps))]


def test_recurrences(
    snapshot: Snapshot, recurrences: Sequence[int], snapshot_recurrence: int | None
) -> list[int] | None:
    """What a model is evaluated at: None for a fixed-depth model; the final one at every r of `recurrences` and
    the snapshots' r; a snapshot at `snapshot_recurrence`, by default the run's mean training recurrence (the
    paper: "the test recurrence equal to the mean training recurrence")."""
    if not snapshot.training.get("recurrent", True):
        return None
    along = snapshot_recurrence or snapshot.training["mean_recurrence"]
    return sorted({*recurrences, along}) if snapshot.final else [along]


# The evaluation of one model: (the model, recurrences or None, name) -> the sweep and extra JSON files to save.
Evaluate = Callable[[Snapshot, "Sequence[int] | None", str], "tuple[Sweep, dict]"]


def evaluate_run(
    run: str | Path,
    out: str | Path,
    evaluate: Evaluate,
    settings: dict,
    *,
    recurrences: Sequence[int],
    snapshot_recurrence: int | None = None,
    steps: Sequence[int] | None = None,
    force: bool = False,
    console: Console | None = None,
) -> list[Path]:
    """Evaluate each chosen model of `run` not yet evaluated in `out`; the folders of all chosen models.

    `settings` (the kind, tasks, data, limit, seed, recurrences, …) is recorded in OUT/evaluation.json: continuing an
    evaluation with other settings would mix incomparable numbers, so it is refused."""
    run, out = Path(run), Path(out)
    console = console or Console(stderr=True)
    chosen = select(find_snapshots(run), steps)
    settings = {**settings, "recurrence": sorted(recurrences), "snapshot_recurrence": snapshot_recurrence}
    recorded = {"format": FORMAT, "run": str(run), "settings": settings, "config": run_config(run)}
    _claim(out, recorded, force)
    todo = [s for s in chosen if not (out / s.folder_name / "results.json").is_file()]
    done = len(chosen) - len(todo)
    console.print(
        f"[bold]{run}[/]: {len(chosen)} models to evaluate"
        + (f", {done} already in {out}" if done else "")
        + f"; snapshots at r = {snapshot_recurrence or 'the mean training recurrence'}."
    )
    started = time.monotonic()
    for number, snapshot in enumerate(todo, 1):
        depths = test_recurrences(snapshot, recurrences, snapshot_recurrence)
        where = "fixed depth" if depths is None else f"r = {', '.join(map(str, depths))}"
        console.print(
            f"[bold]model {done + number}/{len(chosen)}[/]: step {snapshot.step:,}"
            f"{' (final)' if snapshot.final else ''}, {where}{_eta(started, number - 1, len(todo))}"
        )
        sweep, extra = evaluate(snapshot, depths, f"{run.name} step {snapshot.step}")
        sweep.details.update(
            {"run": run.name, "final": snapshot.final, **{k: snapshot.training.get(k) for k in TRAINING_FIELDS}}
        )
        with staged_directory(out / snapshot.folder_name) as staging:
            sweep.save(staging / "results.json")
            (staging / "table.md").write_text(sweep.markdown())
            for name, content in extra.items():
                (staging / name).write_text(json.dumps(content, indent=2, default=str) + "\n")
    return [out / s.folder_name for s in chosen]


# What each model's results record of its training (`details`): the x axes of the curves ("earlier": the runs
# it continued from, model.init_from, whose FLOPs the curves count too).
TRAINING_FIELDS = ("step", "tokens", "flops", "flops_paper", "flops_teacher", "earlier", "mean_recurrence", "recurrent")


def _claim(out: Path, recorded: dict, force: bool) -> None:
    """Start `out` (recording what is measured), or continue it if it measures the same; refuse anything else."""
    settings_file = out / SETTINGS
    if settings_file.is_file() and not force:
        earlier = json.loads(settings_file.read_text())
        keys = ("run", "settings")
        if any(earlier.get(key) != recorded[key] for key in keys):
            changed = sorted(
                k
                for k in {*earlier["settings"], *recorded["settings"]}
                if earlier["settings"].get(k) != recorded["settings"].get(k)
            ) or ["the run"]
            raise RecurfitError(
                f"{out} holds an evaluation of {earlier.get('run')} with other settings ({', '.join(changed)} "
                "differ); continue it with the same options, or choose another --out (--force starts it over)."
            )
        return
    check_output(out, force)
    with staged_directory(out, replace=force) as staging:
        (staging / SETTINGS).write_text(json.dumps(recorded, indent=2) + "\n")


def _eta(started: float, finished: int, total: int) -> str:
    if not finished:
        return ""
    remaining = (time.monotonic() - started) / finished * (total - finished)
    return f"  (eta {int(remaining // 60)}:{int(remaining % 60):02d})"


# ---------------------------------------------------------------- reading an evaluation back


@dataclass
class RunEvaluation:
    """An evaluated run as `recurfit plot` reads it: the run's config and one sweep per model, in step order."""

    folder: Path
    run: str
    config: dict
    settings: dict
    sweeps: list[Sweep]

    @classmethod
    def load(cls, folder: str | Path) -> RunEvaluation:
        from .results import Sweep

        folder = Path(folder)
        try:
            recorded = json.loads((folder / SETTINGS).read_text())
        except (OSError, ValueError):
            raise RecurfitError(f"{folder} is not an evaluation of a run (no readable {SETTINGS}).") from None
        sweeps = [Sweep.load(path) for path in sorted(folder.glob("step-*/results.json"))]
        if not sweeps:
            raise RecurfitError(f"{folder} holds no evaluated model yet: run `recurfit eval` on its run first.")
        run = Path(recorded["run"]).name
        return cls(folder, run, recorded.get("config", {}), recorded.get("settings", {}), sweeps)

    @property
    def kind(self) -> str:
        return self.sweeps[0].kind

    @property
    def final(self) -> Sweep:
        """The last model evaluated (the final one once the run finished and it was evaluated)."""
        return self.sweeps[-1]

    @property
    def recurrent(self) -> bool:
        return bool(self.final.details.get("recurrent", True)) and self.final.rows[0].steps is not None

    def curve_row(self, sweep: Sweep):
        """The row a curve over training takes from a model's sweep: its snapshot recurrence (the only row of a
        snapshot; of the final model, the row at the snapshots' r), or a fixed-depth model's one row."""
        if not self.recurrent:
            return sweep.rows[0]
        along = self.settings.get("snapshot_recurrence") or sweep.details.get("mean_recurrence")
        return next((row for row in sweep.rows if row.steps == along), sweep.rows[-1])
