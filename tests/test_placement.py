"""--device, --dtype and --threads: one resolution (recurfit.model.loading.resolve_placement) behind every command.
No GPU here: the resolution is tested with CUDA faked, and the precision end to end on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from safetensors import safe_open

import recurfit.generation
from recurfit.cli import build_parser
from recurfit.defaults import DTYPES as DTYPE_NAMES
from recurfit.errors import RecurfitError
from recurfit.model.loading import DTYPES, resolve_placement

COMMANDS = [
    ["generate", "--prompt", "x"],
    ["chat"],
    ["eval", "loss", "--data", "d"],
    ["eval", "tasks"],
    ["retrofit", "--out", "o"],
    ["inspect"],
    ["demo"],
]


def test_auto_is_the_gpu_in_bfloat16_when_there_is_one_else_the_cpu_in_float32(monkeypatch):
    assert (resolve_placement().device, resolve_placement().dtype) == (torch.device("cpu"), torch.float32)
    assert resolve_placement("cpu", "bfloat16").dtype == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = resolve_placement()
    assert (gpu.device, gpu.dtype, str(gpu)) == (torch.device("cuda"), torch.bfloat16, "cuda bfloat16")
    assert resolve_placement("cuda:1", "float16").dtype == torch.float16
    assert resolve_placement("cpu").dtype == torch.float32


def test_a_device_that_is_not_there_is_one_line_naming_the_fix():
    with pytest.raises(RecurfitError, match="no CUDA GPU here.*--device cpu"):
        resolve_placement("cuda")
    with pytest.raises(RecurfitError, match="Unknown device 'gpu'"):
        resolve_placement("gpu")


def test_threads_set_torch_threads():
    before = torch.get_num_threads()
    try:
        resolve_placement("cpu", threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_model_command_takes_device_dtype_and_threads(command):
    args = build_parser().parse_args([*command, "--device", "cpu", "--dtype", "bfloat16", "--threads", "2"])
    assert (args.device, args.dtype, args.threads) == ("cpu", "bfloat16", 2)
    assert build_parser().parse_args(command).dtype == "auto"
    assert set(DTYPE_NAMES) == {"auto", *DTYPES}


def test_retrofit_saves_in_the_dtype_asked_for_and_refuses_a_missing_gpu(workspace, tmp_path, capsys):
    out = tmp_path / "bf16"
    code, text = run_cli(
        capsys, "retrofit", "--model", workspace / "parent", "--shape", "1,2,1", "--dtype", "bfloat16", "--out", out
    )
    assert code == 0 and "✓ equal" in text, text
    with safe_open(out / "model.safetensors", "pt") as weights:
        names = weights.keys()  # safe_open is no dict: no `in`
        assert {weights.get_tensor(name).dtype for name in names} == {torch.bfloat16}
    code, text = run_cli(
        capsys, "retrofit", "--model", workspace / "parent", "--device", "cuda", "--out", tmp_path / "x"
    )
    assert code == 2 and "--device cpu" in text and not (tmp_path / "x").exists()


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
