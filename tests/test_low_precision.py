"""Tests of tests/low_precision.py: which tests CI runs again under other CPUs' oneDNN kernels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import low_precision
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _autocast_forward(x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return x @ x


def _helper_of_a_helper(x):
    return _autocast_forward(x) + 1


def _float32_only(x):
    # A comment naming bf16 or autocast is not a computation.
    """Nor is a docstring naming torch.bfloat16."""
    return x @ x


def _closure_over_a_helper():
    helper = _helper_of_a_helper
    return lambda x: helper(x)


def test_a_low_precision_computation_is_found_through_helpers_and_closures():
    assert low_precision.names_low_precision(_autocast_forward)
    assert low_precision.names_low_precision(_helper_of_a_helper)
    assert low_precision.names_low_precision(_closure_over_a_helper())
    assert not low_precision.names_low_precision(_float32_only)


@pytest.mark.not_under_isa_caps("lists the selection; computes nothing")
def test_the_selection_holds_the_bf16_validation_muon_and_fsdp2_tests():
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", low_precision.MARKER, "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    selected = {line.split("[")[0] for line in listed.splitlines() if "::" in line}
    assert {
        "tests/test_train_loop.py::test_validation_in_fp32_as_the_authors_measured",
        "tests/test_train_optim.py::test_batched_muon_in_bfloat16_equals_torch_muon_bit_for_bit",
        "tests/test_train_distributed.py::test_fsdp2_in_bf16_computes_in_the_precisions_of_ddp_with_autocast",
        "tests/test_train_distributed.py::test_fsdp2_with_gathered_muon_matches_one_process",
        "tests/test_model_modeling.py::test_bf16_weights_keep_the_state_within_one_rounding_of_float32",
    } <= selected
    assert not any("test_data_" in name or "test_docs" in name for name in selected)  # no bf16 there
    assert not any("test_cpu_smoke" in name for name in selected)  # left out, with their reasons
