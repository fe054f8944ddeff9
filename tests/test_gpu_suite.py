"""The GPU suite's CPU path: every step of benchmarks/gpu_suite.py at tiny sizes, with the packages the device
machine lacks hidden, so that the suite runs the first time a GPU session calls it."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def table(summary: str) -> list[str]:
    """The summary's status table: its lines before the first step's section."""
    return summary.split("\n## ")[0].splitlines()


@pytest.mark.timeout(2400)  # ~30 min measured on 2 cores under a load average of 15-27
@pytest.mark.not_under_isa_caps(
    "its bf16 step runs model tests under --dtype bfloat16, whose bound (conftest's BF16_LOGIT_TOLERANCE) is derived "
    "from bf16's rounding; the whole smoke is several times the caps' runs together"
)
def test_cpu_smoke_runs_every_step_of_every_part(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--cpu-smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    summaries = {part: (out / f"summary-part{part}.md").read_text() for part in "123"}
    assert done.returncode == 0, done.stdout + "\n".join(summaries.values())
    cells = [line.split("|")[1:3] for text in summaries.values() for line in table(text) if line[:2] == "| "]
    steps = {name.strip(): status.strip() for name, status in cells if name.strip() not in ("step", "---")}
    assert set(steps) >= {"install", "environment", "peaks", "tests-fp32", "tests-bf16", "train-step-eager"}
    assert set(steps) >= {"decode-batch-1", "decode-batch-32", "profile", "fsdp-gathers", "train-torchrun"}
    assert set(steps) >= {"resume-ddp", "resume-fsdp", "memory-probe", "autocast-grad", "tests-healing", "recompiles"}
    assert set(steps.values()) == {"ok"}, steps
    one, two, three = summaries["1"], summaries["2"], summaries["3"]
    # what each step must print for docs/results/gpu.md's table
    assert "recurfit dependencies missing here: datasets, gguf, lm_eval" in one  # hidden as on the device
    assert "TFLOP/s" in one and "passed" in one and "saved for backward" in one and "tokens/s" in one
    assert "ms/token" in two and "speculative" in two and "host synchronisations" in two
    assert "FSDP2 over a one-process gloo group" in two and "all-gathers: " in two
    assert "Trained 3 steps" in two
    with tarfile.open(out / "artifacts-part2.tar.gz") as archive:
        assert {"profile-trace.json.gz", "run/log.jsonl", "peaks.json"} <= set(archive.getnames())
    for strategy in ("ddp", "fsdp"):  # a real kill and resume, exact on the CPU
        assert f"{strategy}: killed, resumed from step-000008; losses of steps 1-16 within 0.00e+00" in three
    assert "recompiles: 0 in 6 training steps" in three and "planned peak" in three
    for part in "123":  # one part per device call, which returns at most 8 files
        assert len(list(out.glob(f"*-part{part}.*"))) <= 8
