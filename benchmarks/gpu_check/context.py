"""What a step that runs as a function of the check (`--step NAME`, in a process of its own) knows: Context,
with its sizes, where its results go, the measured peaks and its deadline."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from .common import append, full_sizes, has_peaks, output, peaks, read_results
from .smoke import smoke_sizes

# ---------------------------------------------------------------- the steps (each runs in its own process)


class Context:
    """What a step knows: its sizes, where results go, the measured peaks, and its deadline."""

    def __init__(self, out: Path, work: Path, smoke: bool, deadline: float, part: int = 1):
        import torch

        self.out, self.work, self.smoke, self.deadline = out, work, smoke, deadline
        self.results_file = output(out, "results.jsonl", part)
        self.sizes = smoke_sizes() if smoke else full_sizes()
        self.device = torch.device(self.sizes.device)
        self.ok = True

    def record(self, step: str, text: str, ok: bool = True, **figures) -> None:
        """One result line, written at once (a step killed later keeps it)."""
        self.ok &= ok
        append(self.results_file, step=step, ok=ok, text=text, **figures)
        print(text, flush=True)

    def attempt(self, step: str, label: str, measure, *args, **kwargs) -> None:
        """`measure(*args, **kwargs)`, which records its own lines; an error is recorded as its result (the whole
        traceback goes to the log), and the step goes on to its next measurement."""
        try:
            measure(*args, **kwargs)
        except Exception as error:
            message = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
            traceback.print_exc()
            self.record(step, f"{label}: failed, {message}", ok=False, key=label, error=message)

    def results(self, step: str) -> list[dict]:
        """The result lines an earlier step wrote."""
        return [r for r in read_results(self.results_file) if r["step"] == step and "status" not in r]

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def peaks(self) -> dict:
        """The device step's measurements; measured here (smaller) if it did not run."""
        if has_peaks(self.work):
            return peaks(self.work)
        from device_peaks import measure

        # At most a quarter of the device step's sizes (a quick check's); the smoke's own are smaller still, as a
        # CPU without bf16 units takes minutes over a 2048³ bf16 product.
        quick = dict(size=2048, copy_gib=0.25, repeats=3)
        return measure(self.device, **{name: min(value, quick[name]) for name, value in self.sizes.peaks.items()})

    def synchronize(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
