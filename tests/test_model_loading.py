"""Tests of `recurfit/model/loading.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    char_tokenizer,
    small_run,
)

import recurfit
import recurfit.model.loading
from recurfit.errors import RecurfitError
from recurfit.model.loading import load_config as load_model_config
from recurfit.model.loading import load_model, load_tokenizer, resolve_placement
from recurfit.train import load_config, train


def test_model_revision_reaches_from_pretrained_and_the_model_card(tmp_path, workspace, monkeypatch):
    seen = []
    real = recurfit.model.loading.load_model

    def recording(name, *args, revision=None, **kwargs):
        seen.append(revision)
        return real(name, *args, revision=revision, **kwargs)

    monkeypatch.setattr("recurfit.train.initial_model.load_model", recording)
    config = small_run(workspace, tmp_path / "run", steps=2)
    config["model"]["revision"] = "stage1-step1907359-tokens4001B"
    train(load_config(None, [], base=config))
    assert seen == ["stage1-step1907359-tokens4001B"]
    assert "revision: stage1-step1907359-tokens4001B" in (tmp_path / "run" / "final" / "README.md").read_text()
    with pytest.raises(RecurfitError, match="drop model.path and model.revision"):
        load_config(None, ["model.path=null", "model.shape=null", "model.init_from=runs/x"], base=config)


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


def test_the_loaders_refuse_in_one_line_without_asking(folders, monkeypatch):
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "n")
    for load, folder, named in (
        (load_model_config, "raven", "config.json"),
        (load_model, "raven", "config.json"),
        (load_tokenizer, "raven-own-tokenizer", "tokenizer_config.json"),
        (load_tokenizer, "recurrent", "tokenizer_config.json"),
    ):
        with pytest.raises(RecurfitError, match=f"/{named} ") as refused:
            load(str(folders / folder))
        assert "\n" not in str(refused.value)
    assert load_tokenizer(str(folders / "raven"))("cat").input_ids == char_tokenizer()("cat").input_ids
    assert not asked and not (folders / "marker").exists()
