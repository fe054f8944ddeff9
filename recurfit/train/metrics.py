"""Where training numbers go: a JSONL log always, TensorBoard or wandb when asked (main process only).

Every line of `OUT/log.jsonl` is one record: `{"kind": "train" | "eval", "step": ..., ...}`. On resume the
records past the checkpoint's step are dropped, so the log reads as if the run had never stopped, and so is a
last line cut short by a crash or a full disk. A record that cannot be written stops the run with a message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import RecurfitError
from ..io.runs import read_log, validation_losses

# Dense bf16 peak FLOP/s for MFU, by a substring of the device name (vendor spec sheets).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "MI300": 1307e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device: torch.device) -> float | None:
    """The GPU's bf16 peak: `RECURFIT_PEAK_FLOPS` (FLOP/s, e.g. measured by benchmarks/device_peaks.py), else the
    spec sheet's for known GPUs; None on a CPU."""
    if device.type != "cuda":
        return None
    measured = os.environ.get("RECURFIT_PEAK_FLOPS")
    if measured:
        try:
            return float(measured)
        except ValueError:
            raise RecurfitError(f"RECURFIT_PEAK_FLOPS={measured!r} is no number; give FLOP/s, e.g. 7.9e14.") from None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


class MetricsLog:
    def __init__(
        self,
        out: Path,
        *,
        resume_step: int | None,
        tensorboard: bool = False,
        wandb: str | None = None,
        config: dict | None = None,
    ):
        self.path = out / "log.jsonl"
        try:
            if resume_step is not None:
                self._truncate_after(resume_step)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as problem:
            raise self._cannot_write(problem) from None
        self.tensorboard = self._tensorboard(out) if tensorboard else None
        self.wandb = self._wandb(wandb, out, config) if wandb else None

    def _truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = [record for record in read_log(self.path) if record["step"] <= step]
        staging = self.path.with_suffix(".jsonl.partial")
        staging.write_text("".join(json.dumps(record) + "\n" for record in kept))
        staging.replace(self.path)

    def _cannot_write(self, problem: OSError) -> RecurfitError:
        return RecurfitError(
            f"Cannot write {self.path} ({problem.strerror or problem}); free space, then continue with "
            "`recurfit train CONFIG --resume` (records after the last checkpoint are dropped)."
        )

    @staticmethod
    def _tensorboard(out: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RecurfitError("log.tensorboard needs tensorboard: pip install 'recurfit[tensorboard]'.") from None
        return SummaryWriter(out / "tensorboard")

    @staticmethod
    def _wandb(project: str, out: Path, config: dict | None):
        try:
            import wandb
        except ImportError:
            raise RecurfitError("log.wandb needs wandb: pip install 'recurfit[wandb]'.") from None
        return wandb.init(project=project, dir=str(out), config=config, resume="allow")

    def write(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()
        try:  # unbuffered: a failed write leaves at most one torn line, and nothing queued to fail again later
            while line:
                line = line[os.write(self.fd, line) :]
        except OSError as problem:
            raise self._cannot_write(problem) from None
        numbers = {f"{record['kind']}/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(numbers, step=record["step"])

    def close(self) -> None:
        os.close(self.fd)
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def validation_columns(record: dict | None) -> tuple[list[str], dict[str, list[str]]]:
    """The final validation as table cells: the column names (r=1, r=4, … or loss) and a row of losses per store."""
    losses = validation_losses(record)
    depths = sorted({r for row in losses.values() for r in row}, key=lambda r: r or 0)
    columns = [f"r={r}" if r is not None else "loss" for r in depths]
    return columns, {store: [f"{row[r]:.4f}" if r in row else "" for r in depths] for store, row in losses.items()}
