"""One progress-bar style for every long job: description, bar, rate and ETA (rich).

On a terminal (or in Jupyter) the bar redraws in place. Anywhere else (output sent to a file: Slurm, nohup, CI)
a redrawn bar would print nothing until the end, so the same state is printed as plain lines instead, e.g.

    training: 12/32 (38%)  loss 3.2117  r̄ 2  1,234 tok/s  elapsed 0:01:02  eta 0:01:43

one every RECURFIT_PROGRESS_EVERY items (default: 5 % of the total) or RECURFIT_PROGRESS_SECONDS seconds
(default 30), whichever comes first, and one when the job ends. Jobs that run on many processes show the bar on
the main one only (they pass `disable` elsewhere).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .errors import RecurfitError

SECONDS_VARIABLE, EVERY_VARIABLE = "RECURFIT_PROGRESS_SECONDS", "RECURFIT_PROGRESS_EVERY"
DEFAULT_SECONDS = 30.0
DEFAULT_LINES_PER_JOB = 20  # without RECURFIT_PROGRESS_EVERY: a line every 5 % of the total


def progress_bar(*extra_columns, disable: bool = False) -> Progress:
    """A `Progress` to use as a context manager; `extra_columns` show job-specific fields (loss, tokens/s).
    Text fields given to `add_task`/`update` appear in the plain lines too."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        *extra_columns,
    )
    console = Console(stderr=True)  # progress goes to stderr: a command's results alone go to stdout
    if disable or console.is_terminal or console.is_jupyter:
        return Progress(*columns, console=console, disable=disable, transient=False)
    return PlainLines(
        *columns, console=console, every=_setting(EVERY_VARIABLE, int), seconds=_setting(SECONDS_VARIABLE)
    )


def _setting(variable: str, kind=float):
    """A non-negative number from the environment, or None when unset."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = -1
    if value < 0:
        raise RecurfitError(f"{variable}={text!r}: expected a number >= 0; unset it for the default.")
    return value


class PlainLines(Progress):
    """A `Progress` that never redraws: it prints a plain line per task at a steady interval instead."""

    def __init__(self, *columns, console: Console, every: int | None, seconds: float | None):
        super().__init__(*columns, console=console, disable=True)  # disabled: no live display, tasks still counted
        self.every, self.seconds = every, DEFAULT_SECONDS if seconds is None else seconds
        self.last_line: dict[TaskID, tuple[float, float]] = {}  # task → (time, completed) at its last line

    def add_task(self, description: str, *args, **kwargs) -> TaskID:
        task_id = super().add_task(description, *args, **kwargs)
        self.last_line[task_id] = (time.monotonic(), self._tasks[task_id].completed)
        return task_id

    def update(self, task_id: TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._maybe_print(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._maybe_print(task_id)

    def stop(self) -> None:
        """The job ends: a last line for every task that moved since its last one."""
        for task_id, (_, completed) in self.last_line.items():
            if self._tasks[task_id].completed != completed:
                self._print(task_id)
        # Not Progress.stop: its live display never started, and it would end a file with a blank line.

    def _maybe_print(self, task_id: TaskID) -> None:
        task = self._tasks[task_id]
        printed_at, printed_completed = self.last_line[task_id]
        every = self.every or (max(int(task.total) // DEFAULT_LINES_PER_JOB, 1) if task.total else 0)
        due = (
            (every and task.completed - printed_completed >= every)
            or time.monotonic() - printed_at >= self.seconds
            or (task.total is not None and task.completed >= task.total)
        )
        if due and task.completed != printed_completed:
            self._print(task_id)

    def _print(self, task_id: TaskID) -> None:
        task = self._tasks[task_id]
        self.last_line[task_id] = (time.monotonic(), task.completed)
        self.console.print(plain_line(task), markup=False, highlight=False, soft_wrap=True)
        self.console.file.flush()


def plain_line(task: Task) -> str:
    """What the bar shows, as text: done of total, the task's text fields (loss, tokens/s), elapsed and ETA."""
    done = f"{task.completed:,.0f}"
    if task.total:
        done += f"/{task.total:,.0f} ({task.completed / task.total:.0%})"
    parts = [f"{task.description}: {done}"]
    parts += [str(value) for value in task.fields.values() if isinstance(value, str) and value]
    parts.append(f"elapsed {_clock(task.finished_time if task.finished else task.elapsed)}")
    if task.total and not task.finished and task.completed:
        parts.append(f"eta {_clock(_remaining(task))}")
    return "  ".join(parts)


def _remaining(task: Task) -> float:
    """rich's estimate (the rate over the last 30 s), or after a single update the mean rate so far."""
    if task.time_remaining is not None:
        return task.time_remaining
    return task.elapsed / task.completed * (task.total - task.completed)


def _clock(seconds: float | None) -> str:
    return str(timedelta(seconds=round(seconds or 0)))


def size_text(size: float) -> str:
    """A size in bytes as people read it, in powers of 1000: '512 B', '4.4 kB', '2.0 MB', '1.3 GB', '2.5 TB'."""
    units = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))
    return next((f"{size / scale:.1f} {unit}" for scale, unit in units if size >= scale), f"{size:.0f} B")
