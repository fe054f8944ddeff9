"""What a sweep over test recurrence produces: one row per r, the parent, random chance; JSON and a table.

`recurfit eval loss` and `recurfit eval tasks` both write `results.json` in this form, which `recurfit plot`
reads back; `table.md` is the same numbers in the paper's layout (rows: test recurrence, columns: metrics).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import RecurfitError
from ..model.accounting import count_parameters, effective_parameters, inference_flops_per_token

FORMAT = "recurfit-sweep/1"


@dataclass
class Row:
    """One model at one depth. `steps` is None for a fixed-depth model and for the chance row."""

    label: str
    metrics: dict[str, float]
    steps: int | None = None
    effective_parameters: int | None = None
    flops_per_token: int | None = None

    @classmethod
    def measured(cls, model, steps: int | None, metrics: dict[str, float], label: str | None = None) -> Row:
        """A row with the model's compute at `steps` recurrences (ignored by a fixed-depth model)."""
        counts = count_parameters(model)
        r = steps or 1
        return cls(
            label=label or (f"r={steps}" if steps is not None else "model"),
            metrics=metrics,
            steps=steps,
            effective_parameters=effective_parameters(counts, r),
            flops_per_token=inference_flops_per_token(counts, r),
        )


@dataclass
class Sweep:
    """`rows`: the model under test at each r (one row if it is not recurrent); `metrics`: the column order;
    `details["headline"]` (task sweeps): the columns that hold the paper's metric of each task."""

    kind: str  # "loss" or "tasks"
    model: str
    metrics: list[str]
    rows: list[Row]
    parent: Row | None = None
    chance: Row | None = None
    details: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"format": FORMAT, **asdict(self)}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Sweep:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as problem:
            raise RecurfitError(f"Cannot read {path} as a results file: {problem}.") from None
        if data.pop("format", None) != FORMAT:
            raise RecurfitError(f"{path} is not a recurfit results file (written by `recurfit eval loss|tasks`).")
        for key in ("parent", "chance"):
            data[key] = Row(**data[key]) if data.get(key) else None
        data["rows"] = [Row(**row) for row in data["rows"]]
        return cls(**data)

    def markdown(self) -> str:
        """The paper's layout: a row per test recurrence, then the parent and random chance."""
        header = ["test recurrence", "eff. params", "FLOPs/token", *self.metrics]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in [*self.rows, self.parent, self.chance]:
            if row is not None:
                cells = [row.label, _millions(row.effective_parameters), _giga(row.flops_per_token)]
                cells += [table_cell(row.metrics.get(name)) for name in self.metrics]
                lines.append("| " + " | ".join(cells) + " |")
        if self.details.get("headline"):
            headline = ", ".join(self.details["headline"])
            lines += ["", f"Each task's first column is the metric the paper reports: {headline}."]
        return "\n".join(lines) + "\n"


def _millions(value: int | None) -> str:
    return "" if value is None else f"{value / 1e6:.1f} M"


def _giga(value: int | None) -> str:
    return "" if value is None else f"{value / 1e9:.2f} G"


def table_cell(value: float | None) -> str:
    """A metric as a table shows it: 4 decimals below 10, 2 above; – for none (or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
