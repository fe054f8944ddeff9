"""Tests of `recurfit/__init__.py`: the package's public names and its registration with the Auto classes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import recurrent, token_batch

REPO = Path(__file__).resolve().parents[1]

LOAD_IN_A_FRESH_PROCESS = """
import sys
import recurfit
assert "torch" not in sys.modules, "import recurfit alone imported torch"
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
torch.manual_seed(0)  # the random initial state
with torch.no_grad():
    logits = model(torch.load(sys.argv[2], weights_only=True), num_steps=3).logits
torch.save(logits, sys.argv[3])
print(type(model).__name__)
"""


def test_import_recurfit_then_auto_class_loads_a_saved_model_in_a_fresh_process(tmp_path):
    model = recurrent()
    model.save_pretrained(tmp_path / "model")
    ids = token_batch()
    torch.save(ids, tmp_path / "ids.pt")
    torch.manual_seed(0)
    with torch.no_grad():
        expected = model(ids, num_steps=3).logits
    done = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, tmp_path / "model", tmp_path / "ids.pt", tmp_path / "out.pt"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "RecurrentForCausalLM"
    torch.testing.assert_close(torch.load(tmp_path / "out.pt", weights_only=True), expected, rtol=0, atol=1e-6)


def test_transformers_imported_before_recurfit_registers_at_once(tmp_path):
    recurrent().save_pretrained(tmp_path / "model")
    code = (
        "import sys\nfrom transformers import AutoModelForCausalLM\nimport recurfit\n"
        "print(type(AutoModelForCausalLM.from_pretrained(sys.argv[1])).__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, tmp_path / "model"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "RecurrentForCausalLM", done.stderr
