"""One progress-bar style for every long job: description, bar, rate and ETA (rich)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def progress_bar(*extra_columns, disable: bool = False) -> Progress:
    """A `Progress` to use as a context manager; `extra_columns` show job-specific fields (loss, tokens/s)."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        *extra_columns,
        disable=disable,
        transient=False,
    )
