"""What a training run leaves in its folder, read without the trainer: the records of `log.jsonl`, the validation
losses of its eval records, and its config as dotted keys. Training writes these; evaluation, figures and
scripts read them, so they live here, below both."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import RecurfitError

# An eval record's keys: "STORE/loss@R" at test recurrence R, "STORE/loss" for a fixed-depth model.
EVAL_KEY = re.compile(r"^(?P<data>.+)/loss(?:@(?P<r>\d+))?$")


def read_log(path: str | Path) -> list[dict]:
    """The records of a run's log.jsonl (a run folder or the file itself). A last line cut short (a crash or a
    full disk mid-write, or a run still writing it) is left out; a damaged line before it is an error."""
    path = Path(path)
    path = path / "log.jsonl" if path.is_dir() else path
    lines = path.read_text(errors="replace").split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            if number == len(lines):  # no newline after it: the torn last line
                break
            raise RecurfitError(
                f"{path}:{number} is not a log record; delete that line (or the run folder) and run again."
            )
        records.append(record)
    return records


def validation_losses(record: dict | None) -> dict[str, dict[int | None, float]]:
    """store -> test recurrence (None for a fixed-depth model) -> loss, from a training log's eval record."""
    losses: dict = {}
    for key, value in (record or {}).items():
        match = EVAL_KEY.match(key)
        if match:
            losses.setdefault(match["data"], {})[int(match["r"]) if match["r"] else None] = value
    return losses


def flatten_settings(config: dict, prefix: str = "") -> dict:
    """{"depth.mean_recurrence": 32, …}: a nested config as dotted keys."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten_settings(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat
