"""--device, --dtype and --threads: one resolution (recurfit.model.loading.resolve_placement) behind every command.
No GPU here: the resolution is tested with CUDA faked, and the precision end to end on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli

import recurfit.generation
from recurfit.cli import build_parser
from recurfit.defaults import DTYPES as DTYPE_NAMES
from recurfit.model.loading import DTYPES

COMMANDS = [
    ["generate", "--prompt", "x"],
    ["chat"],
    ["eval", "loss", "--data", "d"],
    ["eval", "tasks"],
    ["lens", "--prompt", "x"],
    ["retrofit", "--out", "o"],
    ["inspect"],
    ["demo"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_model_command_takes_device_dtype_and_threads(command):
    args = build_parser().parse_args([*command, "--device", "cpu", "--dtype", "bfloat16", "--threads", "2"])
    assert (args.device, args.dtype, args.threads) == ("cpu", "bfloat16", 2)
    assert build_parser().parse_args(command).dtype == "auto"
    assert set(DTYPE_NAMES) == {"auto", *DTYPES}


def test_inspect_load_and_generate_run_in_bfloat16_on_the_cpu(workspace, tmp_path, capsys, monkeypatch):
    code, text = run_cli(capsys, "inspect", workspace / "parent", "--load", "--dtype", "bfloat16")
    assert code == 0 and "Loaded on cpu bfloat16" in text, text
    code, fp32 = run_cli(capsys, "inspect", workspace / "parent", "--load")
    assert "Loaded on cpu float32" in fp32
    seen = []
    original = recurfit.generation.generate_text
    monkeypatch.setattr(
        recurfit.generation,
        "generate_text",
        lambda model, *a, **k: seen.append(model.dtype) or original(model, *a, **k),
    )
    code, text = run_cli(
        capsys, "generate", workspace / "parent", "--prompt", "the cat", "--max-new-tokens", "2", "--dtype", "bfloat16"
    )
    assert code == 0 and seen == [torch.bfloat16], text
