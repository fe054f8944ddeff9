"""`recurfit demo --dry-run` on a tiny parent: the shape, the memory plan and the time, and no training."""

import copy

import torch
from conftest import run_cli

from recurfit.demo import dry_run
from recurfit.demo.dry_run import StepTiming, demo_config, time_step
from recurfit.demo.settings import DemoSettings
from recurfit.model.loading import load_model
from recurfit.train.initial_model import planned_model
from recurfit.train.memory import gb, plan_memory
from recurfit.train.optim import trains_in_bf16


def test_a_dry_run_prints_the_shape_the_plan_and_the_time_and_trains_nothing(workspace, tmp_path, capsys, monkeypatch):
    parent = str(workspace / "parent")  # 6 layers: (1, 2, 1)
    timed = []

    def fixed_timing(config, model, seq_len):  # a step: 2 micro-batches of 1.5 s and a 1 s update
        timed.append(config.model.shape)
        return StepTiming(1.5, config.batch.global_ // config.batch.micro, 1.0, (2, 2))

    monkeypatch.setattr(dry_run, "time_step", fixed_timing)
    out = tmp_path / "demo"
    code, text = run_cli(capsys, "demo", "--model", parent, "--steps", "8", "--dry-run", "--out", out)
    assert code == 0, text
    assert not out.exists()
    assert (
        "Shape (1, 2, 1), chosen for the parent's layer count: prelude = parent layers [0], core = [3, 4], "
        "coda = [5]; 4 of the parent's 6 layers kept" in text
    )
    assert timed == [[1, 2, 1], None]  # the retrofit, then the parent trained on the same tokens
    settings = DemoSettings(model=parent, shape=(1, 2, 1), steps=8)
    peaks = {}
    for name, shape in (("retrofit", (1, 2, 1)), ("parent", None)):
        config = demo_config(settings, shape)
        peaks[name] = plan_memory(config, planned_model(config, load_model(parent)), 256, device="cpu").peak
    precision = "bf16 autocast" if trains_in_bf16("auto", "cpu") else "fp32"  # the demo's precision on this CPU
    assert f"Memory plan per device: micro-batch 2 × 256 tokens, k = 2 with gradient, {precision}" in text
    assert f"Retrofit: peak {gb(peaks['retrofit'])}" in text and f"Parent: peak {gb(peaks['parent'])}" in text
    assert f"Memory: the larger plan, {gb(max(peaks.values()))}" in text
    assert "so a step of 2 micro-batches about 4.0 s and 8 steps about 32 s" in text
    assert "Training time on this machine: about 1 min 04 s for both" in text
    assert "Not run: --dry-run." in text


def test_a_given_shape_is_the_one_planned(workspace, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dry_run, "time_step", lambda config, model, seq_len: StepTiming(0.1, 2, 0.1, (2, 2)))
    argv = ["demo", "--model", workspace / "parent", "--shape", "2,2,2", "--dry-run", "--out", tmp_path / "demo"]
    code, text = run_cli(capsys, *argv)
    assert code == 0 and "Shape (2, 2, 2), given: prelude = parent layers [0, 1], core = [2, 3], coda = [4, 5]" in text


def test_a_step_is_timed_as_training_runs_it_with_gradients_and_an_update(workspace):
    torch.set_num_threads(1)
    settings = DemoSettings(model=str(workspace / "parent"), shape=(1, 2, 1), seq_len=16)
    config = demo_config(settings, settings.shape)
    model = planned_model(config, load_model(settings.model))
    before = copy.deepcopy(model.state_dict())
    timing = time_step(config, model, settings.seq_len)
    assert timing.depth == (2, 2) and timing.micro_batches == 2  # the recipe's mean 4, k = 2; a batch of 4 by 2
    assert timing.forward_backward > 0 and timing.optimizer > 0
    assert timing.step == 2 * timing.forward_backward + timing.optimizer
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert all(not torch.equal(model.state_dict()[name], before[name]) for name in trained if "core" in name)
