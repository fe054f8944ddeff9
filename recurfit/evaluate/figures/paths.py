"""`recurfit plot PATH…`: which figures a mix of results files, training runs and run evaluations gets."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ...errors import RecurfitError
from ...io.figures import FORMATS
from ..over_training import RunEvaluation, is_run_evaluation
from ..results import Sweep
from .runs import plot_runs
from .sweeps import plot_flops, plot_recurrence
from .training import plot_training


def plot_paths(paths: Sequence[str | Path], out: Path, paper_tokens_per_step: int | None = None) -> list[Path]:
    """Figures for a mix of results files (or folders holding `results.json`) and training runs: every file written.
    `paper_tokens_per_step` draws the training-FLOPs axes as the paper's figures count them (`paper_axis_flops`)."""
    sweeps, runs, evaluations = [], [], []
    for raw in paths:
        path = Path(raw)
        if is_run_evaluation(path):
            evaluations.append(RunEvaluation.load(path))
        elif (path / "log.jsonl").is_file() or path.name == "log.jsonl":
            runs.append(path if path.is_dir() else path.parent)
        elif (path / "results.json").is_file() or path.suffix == ".json":
            sweeps.append(Sweep.load(path / "results.json" if path.is_dir() else path))
        else:
            raise RecurfitError(
                f"{path} is neither a training run (a folder with log.jsonl), a results file (results.json from "
                "`recurfit eval loss|tasks MODEL`) nor an evaluation of a run (`recurfit eval loss|tasks RUN`)."
            )
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in ("loss", "tasks"):
        group = [s for s in sweeps if s.kind == kind]
        if group:
            written.append(plot_recurrence(group, out / f"{kind}_recurrence.png"))
            written.append(plot_flops(group, out / f"{kind}_flops.png"))
    if runs:
        written.append(plot_training(runs, out / "training.png", paper_tokens_per_step))
    drawn = plot_runs(evaluations, out, paper_tokens_per_step) if evaluations else []
    written += [path for path in drawn if path.suffix == ".png"]
    tables = [path for path in drawn if path.suffix == ".md"]
    return [png.with_suffix(suffix) for png in written for suffix in FORMATS] + tables
