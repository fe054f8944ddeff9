"""A pytest plugin that writes, for every collected test, whether it runs under each --device/--dtype choice.

Run it before and after `arrange_tests.py`; the two files must be equal (every test runs on the same devices
and dtypes as before the move):

    PYTHONPATH=scripts/dev PLACEMENT_OUT=/tmp/before.txt .venv/bin/python -m pytest -p placement_probe --co -q
"""

from __future__ import annotations

import os
import sys

import torch

CHOICES = (("cpu", torch.bfloat16, "DTYPE_MODULES"), ("cuda", torch.float32, "DEVICE_MODULES"),
           ("cuda", torch.bfloat16, "DEVICE_MODULES"))  # fmt: skip


def pytest_collection_finish(session):
    conftest = sys.modules["conftest"]
    placement = conftest.PLACEMENT
    rows = []
    for item in session.items:
        runs = []
        for device, dtype, modules in CHOICES:
            placement.device, placement.dtype = torch.device(device), dtype
            runs.append("run" if conftest.skip_reason(item, getattr(conftest, modules)) is None else "skip")
        placement.device, placement.dtype = torch.device("cpu"), torch.float32
        rows.append(f"{item.name} {' '.join(runs)}")
    with open(os.environ.get("PLACEMENT_OUT", "placement.txt"), "w") as file:
        file.write("cpu-bf16 cuda-fp32 cuda-bf16\n" + "\n".join(sorted(rows)) + "\n")
