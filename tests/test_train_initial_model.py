"""Tests of `recurfit/train/initial_model.py`."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    config_for,
    small_run,
    tiny_parent,
)
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from recurfit.defaults import depth_for_effort
from recurfit.errors import RecurfitError
from recurfit.surgery.layer_scores import (
    measure,
)
from recurfit.surgery.selection import LayerSelection
from recurfit.train import Trainer, train
from recurfit.train.config import load_config
from recurfit.train.initial_model import build_model, calibration_rows, check_plan


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_training_config_with_select_angular(tmp_path, workspace):
    config = small_run(workspace, tmp_path / "run")
    config["model"] = {"path": str(workspace / "parent"), "select": "angular"}
    with pytest.raises(RecurfitError, match=r"model\.select=angular scores layers on text"):
        load_config(None, [], base=config)
    config["model"]["calibration"] = str(workspace / "prose")
    loaded = load_config(None, [], base=config)
    check_plan(loaded)  # --dry-run: the shape is known only from the weights, and nothing fails without them
    model = build_model(loaded.model, loaded.depth, 0)  # no shape: the knees choose it
    rows = calibration_rows(loaded.model)
    parent = AutoModelForCausalLM.from_pretrained(workspace / "parent")
    assert model.config.source_layers == LayerSelection.angular(None, measure(parent, rows).angular).as_dict()
    config["model"]["core"] = [2, 3]
    with pytest.raises(RecurfitError, match="model.select=angular chooses the layers"):
        load_config(None, [], base=config)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_training_config_starts_its_adapter_as_the_run_seed_draws(tmp_path, workspace):
    config = small_run(workspace, tmp_path / "run", seed=5)
    config["model"]["adapter_init"] = "torch-default"
    loaded = load_config(None, [], base=config)
    model = build_model(loaded.model, loaded.depth, loaded.seed)
    hidden = model.config.hidden_size
    torch.manual_seed(5)
    assert torch.equal(model.model.adapter.weight, torch.nn.Linear(2 * hidden, hidden, bias=False).weight)
    assert load_config(None, [], base=small_run(workspace, tmp_path / "default")).model.adapter_init == "identity"


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_chained_run_starts_from_the_previous_runs_final_weights(tmp_path, workspace):
    first = load_config(None, [], base=small_run(workspace, tmp_path / "phase1"))
    train(first)
    second = load_config(
        None,
        ["model.path=null", "model.shape=null", f"model.init_from={tmp_path / 'phase1'}"],
        base=small_run(workspace, tmp_path / "phase2"),
    )
    trainer = Trainer(second)

    saved = load_file(str(tmp_path / "phase1" / "final" / "model.safetensors"))
    state = trainer.model.state_dict()
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[key], state[key]) for key in saved)
    result = trainer.run()
    assert result.counters.step == 3 and (tmp_path / "phase2" / "final" / "config.json").is_file()
    # The second phase runs its own schedule from its step 0.
    assert trainer.schedulers[0].last_epoch == 3


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_the_final_config_holds_the_served_depth_for_effort_of_the_runs_mean_recurrence(tmp_path, workspace):
    """A run's final config.json maps reasoning_effort to depths for vLLM (recurfit.serving.depth): r̄ // 2, r̄ and
    2 r̄, as the server's defaults; a chained run at another r̄ writes its own table, not its parent run's."""
    train(load_config(None, [], base=small_run(workspace, tmp_path / "phase1")))  # r̄ = 4
    chained = ["model.path=null", "model.shape=null", f"model.init_from={tmp_path / 'phase1'}"]
    train(load_config(None, [*chained, "depth.mean_recurrence=6"], base=small_run(workspace, tmp_path / "phase2")))
    tables = [json.loads((tmp_path / run / "final" / "config.json").read_text()) for run in ("phase1", "phase2")]
    assert [(t["mean_recurrence"], t["depth_for_effort"]) for t in tables] == [
        (4, {"low": 2, "medium": 4, "high": 8}),
        (6, {"low": 3, "medium": 6, "high": 12}),
    ]
    assert tables[1]["depth_for_effort"] == depth_for_effort(6)  # the one rule the server also uses
    assert AutoConfig.from_pretrained(tmp_path / "phase2" / "final").depth_for_effort == depth_for_effort(6)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_chained_run_whose_parent_run_is_missing_fails_before_any_compute(tmp_path, workspace):
    config = load_config(
        None,
        ["model.path=null", "model.shape=null", f"model.init_from={tmp_path / 'never-ran'}"],
        base=small_run(workspace, tmp_path / "phase2"),
    )
    with pytest.raises(RecurfitError, match=r"model.init_from: .*never-ran holds no finished run"):
        Trainer(config)
    assert not (tmp_path / "phase2").exists()


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_the_untied_non_recurrent_baseline_trains_two_matrices(tmp_path, workspace):
    parent = tiny_parent("llama", tie_word_embeddings=True)
    parent.save_pretrained(tmp_path / "tied")
    config = small_run(workspace, tmp_path / "run")
    config["model"] = {"path": str(tmp_path / "tied"), "untie_embeddings": True}
    loaded = load_config(None, [], base=config)
    model = build_model(loaded.model, loaded.depth, 0)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_shortgpt_baseline_from_a_config(tmp_path, workspace):
    config = small_run(workspace, tmp_path / "run")
    config["model"] = {
        "path": str(workspace / "parent"),
        "prune_to": 4,
        "select": "shortgpt",
        "calibration": str(workspace / "prose"),
    }
    loaded = load_config(None, [], base=config)
    model = build_model(loaded.model, loaded.depth, 0)
    assert model.config.num_hidden_layers == 4 and not hasattr(model.config, "num_core_layers")
    retrofit_config = small_run(workspace, tmp_path / "run2")
    retrofit_config["model"].update(select="shortgpt", calibration=str(workspace / "prose"))
    loaded = load_config(None, [], base=retrofit_config)
    assert build_model(loaded.model, loaded.depth, 0).config.shape == (2, 2, 2)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_a_baseline_of_an_unsupported_family_is_refused(tmp_path, workspace):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(
        tmp_path / "gpt2"
    )
    config = config_for(workspace, tmp_path / "run", "model.shape=null", f"model.path={tmp_path / 'gpt2'}")
    with pytest.raises(RecurfitError, match="model.path is a gpt2 model"):
        train(config)
    assert not (tmp_path / "run").exists()


def test_explicit_layer_choices_build_that_retrofit_and_clash_with_shape(workspace):
    from recurfit.train.config import DepthConfig, ModelConfig
    from recurfit.train.initial_model import build_model

    layers = {"prelude": [0], "core": [3, 4], "coda": [5]}
    model = build_model(ModelConfig(path=str(workspace / "parent"), **layers), DepthConfig(mean_recurrence=4), seed=0)
    assert model.config.source_layers == layers and model.config.shape == (1, 2, 1)
    base = {"out": "runs/x", "data": {"phases": [{"sources": [str(workspace / "prose")]}]}}
    with pytest.raises(RecurfitError, match="not both"):
        load_config(None, ["model.shape=[1,2,1]", "model.core=[3,4]", "model.prelude=[0]", "model.coda=[5]"], base=base)
    with pytest.raises(RecurfitError, match="go together"):
        load_config(None, ["model.core=[3,4]"], base=base)
