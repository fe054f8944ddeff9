"""Where training numbers go: a JSONL log always, TensorBoard or wandb when asked (main process only).

Every line of `OUT/log.jsonl` is one record: `{"kind": "train" | "eval", "step": ..., ...}`. On resume the
records past the checkpoint's step are dropped, so the log reads as if the run had never stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import RecurfitError

# Dense bf16 peak FLOP/s for MFU, by a substring of the device name (vendor spec sheets).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "MI300": 1307e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


class MetricsLog:
    def __init__(self, out: Path, *, resume_step: int | None, tensorboard: bool = False, wandb: str | None = None, config: dict | None = None):
        self.path = out / "log.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        self.file = open(self.path, "a")
        self.tensorboard = self._tensorboard(out) if tensorboard else None
        self.wandb = self._wandb(wandb, out, config) if wandb else None

    def _truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        staging = self.path.with_suffix(".jsonl.partial")
        staging.write_text("".join(line + "\n" for line in kept))
        staging.replace(self.path)

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
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        numbers = {f"{record['kind']}/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(numbers, step=record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_log(path: str | Path) -> list[dict]:
    """The records of a run's log.jsonl (a run folder or the file itself)."""
    path = Path(path)
    path = path / "log.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
