"""Tests of `recurfit/train/config/`."""

from __future__ import annotations

import pytest
import yaml
from conftest import (
    DISTILL,
    config_for,
    small_run,
    tiny_config,
    tiny_parent,
)

from recurfit.errors import RecurfitError
from recurfit.train import Trainer, load_config


def test_bad_distillation_settings_are_one_line(tmp_path, workspace):
    out = tmp_path / "run"
    with pytest.raises(RecurfitError, match=r"distill.alpha must be in \[0, 1\].*got 1.5"):
        config_for(workspace, out, "distill.alpha=1.5")
    with pytest.raises(RecurfitError, match="distill.temperature must be > 0, got 0.0"):
        config_for(workspace, out, "distill.temperature=0")
    with pytest.raises(RecurfitError, match="set distill.teacher to the parent"):
        config_for(workspace, out, *DISTILL, "model.path=null", "model.shape=null", f"model.init_from={tmp_path}")
    with pytest.raises(RecurfitError, match="depth.supervise.last must be >= 1"):
        config_for(workspace, out, "depth.supervise.last=0")
    tiny_parent("llama", vocab_size=120, place=False).save_pretrained(tmp_path / "other")
    with pytest.raises(RecurfitError, match="distill.teacher .*other has a 120-token vocabulary and the model 97"):
        Trainer(config_for(workspace, out, f"distill.teacher={tmp_path / 'other'}"))
    with pytest.raises(RecurfitError, match="depth.supervise .* not recurrent"):
        Trainer(config_for(workspace, out, "model.shape=null", "depth.supervise.last=2"))


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_bad_schedules_are_rejected_at_validation_naming_the_key():
    base = {"out": "runs/x", "data": {"phases": [{"sources": ["data/nowhere"]}]}, "steps": 100}
    cases = {
        "optimizer.warmup=0.3 optimizer.decay=0.8": (
            r"optimizer.warmup \(0.3\) \+ optimizer.decay \(0.8\) are more than the whole run"
        ),
        "optimizer.warmup=60 optimizer.decay=41": r"optimizer.warmup \(60 steps\) \+ optimizer.decay \(41 steps\)",
        "optimizer.decay_shape=exponential": r"optimizer.decay_shape must be one of \['cosine', 'linear', '1-sqrt'\]",
        "optimizer.min_lr_ratio=1.5": r"optimizer.min_lr_ratio must be in \[0, 1\]",
        "optimizer.min_lr_ratio=-0.1": r"optimizer.min_lr_ratio must be in \[0, 1\]",
        "optimizer.warmup=2.5": r"optimizer.warmup must be a fraction",
        "optimizer.decay=-0.2": r"optimizer.decay must be a fraction",
        "optimizer.eps=0": r"optimizer.eps must be > 0",
    }
    for overrides, message in cases.items():
        with pytest.raises(RecurfitError, match=message):
            load_config(None, overrides.split(), base=base)
    # Rounding two fractions up cannot make a very short run invalid: the decay gives way.
    assert load_config(None, ["steps=1"], base=base).optimizer.schedule_steps(1) == (1, 0)
    config = load_config(None, ["optimizer.warmup=0.2", "optimizer.decay=0.8", "optimizer.muon_fused=true"], base=base)
    assert config.optimizer.schedule_steps(100) == (20, 80) and config.optimizer.muon_fused


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.init_from=runs/a"], "model.init_from continues a run's final model; drop model.path"),
        (["model.path=null", "model.init_from=runs/a"], "drop model.shape/prelude/core/coda"),
        (["model.shape=null", "model.prune_to=3"], "set model.select=shortgpt"),
        (["model.shape=null", "model.prune_to=3", "model.select=shortgpt"], "set model.calibration"),
        (["model.prune_to=3", "model.select=shortgpt", "model.calibration=x"], "model.prune_to makes a non-recurrent"),
        (["model.embedding_scale=-1"], "model.embedding_scale must be > 0"),
    ],
)
def test_contradictory_model_settings_name_the_key(tmp_path, workspace, overrides, message):
    with pytest.raises(RecurfitError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(None, overrides, base=small_run(workspace, tmp_path / "run"))


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_config_values_out_of_range_and_bad_overrides_are_one_line(tmp_path, workspace):
    base = tiny_config(workspace, tmp_path / "run")
    for override, message in (
        ("max_bad_steps=0", "max_bad_steps must be >= 1, got 0"),
        ("checkpoint.every=-1", "checkpoint.every must be >= 0, got -1"),
        ("eval.rows=0", "eval.rows must be >= 1"),
        ("log.every=0", "log.every must be >= 1"),
        ("optimizer.lr=0", "optimizer.lr must be > 0"),
        ("optimizer.betas=[0.9]", "optimizer.betas must be two"),
        ("steps=[1,", r"Override 'steps=\[1,': '\[1,' is not a YAML value"),
        ("data.phases=[{sources: []}]", r"data.phases\[0\] has no sources"),
    ):
        with pytest.raises(RecurfitError, match=message):
            load_config(None, [override], base=base)
    layers = ["model.shape=null", "model.prelude=[3]", "model.core=[1,2]", "model.coda=[5]"]
    with pytest.raises(RecurfitError, match=r"must run in parent order"):
        load_config(None, layers, base=base)


def test_config_errors_name_the_key_and_the_fix(tmp_path, workspace):
    base = tiny_config(workspace, tmp_path / "run")
    with pytest.raises(RecurfitError, match="did you mean 'optimizer.muon_lr'"):
        load_config(None, ["optimizer.muonlr=0.1"], base=base)
    with pytest.raises(RecurfitError, match=r"depth.curriculum must be one of \['constant', 'linear', '1-sqrt'\]"):
        load_config(None, ["depth.curriculum=cosine"], base=base)
    with pytest.raises(RecurfitError, match="must be a multiple of batch.micro"):
        load_config(None, ["batch.global=7"], base=base)
    with pytest.raises(RecurfitError, match="steps must be int"):
        load_config(None, ["steps=many"], base=base)
    with pytest.raises(RecurfitError, match="needs 'out'"):
        load_config(None, [], base={k: v for k, v in base.items() if k != "out"})
    with pytest.raises(RecurfitError, match="fsdp_units=layer shards with FSDP2: set distributed=fsdp as well"):
        load_config(None, ["fsdp_units=layer"], base=base)
    with pytest.raises(RecurfitError, match=r"fsdp_units must be one of \['recurrence', 'layer'\]"):
        load_config(None, ["distributed=fsdp", "fsdp_units=block"], base=base)
    config = load_config(None, ["optimizer.lr=1e-3", "batch.global=16", "depth.fixed=true"], base=base)
    assert config.optimizer.lr == 1e-3 and config.batch.global_ == 16 and config.depth.fixed is True
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(base))
    assert load_config(tmp_path / "c.yaml").to_dict()["batch"] == {"micro": 2, "global": 8}


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_overrides_reach_list_items(workspace, tmp_path):
    base = tiny_config(workspace, tmp_path / "run")
    config = load_config(None, ["data.phases.0.tokens=512", "data.phases.1.sources.0.weight=3"], base=base)
    assert config.data.phases[0].tokens == 512 and config.data.phases[1].sources[0].weight == 3.0
    with pytest.raises(RecurfitError, match="'2' is not an item of a list of 2 .items count from 0"):
        load_config(None, ["data.phases.2.tokens=5"], base=base)
