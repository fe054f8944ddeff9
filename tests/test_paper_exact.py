"""The paper, exactly: settings checked against the authors' released files (docs/paper-settings.md)."""

from pathlib import Path

import pytest
import torch
from conftest import tiny_parent
from test_paper_runs import small_run

import recurfit
from recurfit.train import load_config
from recurfit.train.model import build_model

# ---------------------------------------------------------------- the adapter at the start of training


def test_torch_default_adapter_is_nn_linears_own_draw_from_the_seed():
    # The authors' conversions never write the adapter, so it keeps nn.Linear's default Kaiming-uniform draw.
    parent = tiny_parent("llama")
    hidden = parent.config.hidden_size
    model = recurfit.retrofit(parent, shape=(1, 2, 1), adapter_init="torch-default", seed=7)
    torch.manual_seed(7)
    reference = torch.nn.Linear(2 * hidden, hidden, bias=False)
    assert torch.equal(model.model.adapter.weight, reference.weight)
    other = recurfit.retrofit(tiny_parent("llama"), shape=(1, 2, 1), adapter_init="torch-default", seed=8)
    assert not torch.equal(other.model.adapter.weight, reference.weight)


def test_a_training_config_starts_its_adapter_as_the_run_seed_draws(tmp_path, workspace):
    config = small_run(workspace, tmp_path / "run", seed=5)
    config["model"]["adapter_init"] = "torch-default"
    loaded = load_config(None, [], base=config)
    model = build_model(loaded.model, loaded.depth, loaded.seed)
    hidden = model.config.hidden_size
    torch.manual_seed(5)
    assert torch.equal(model.model.adapter.weight, torch.nn.Linear(2 * hidden, hidden, bias=False).weight)
    assert load_config(None, [], base=small_run(workspace, tmp_path / "default")).model.adapter_init == "identity"


PAPER_RECIPES = sorted(Path(__file__).parent.parent.joinpath("recipes", "paper").glob("*.yaml"))


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.stem)
def test_every_paper_recipe_that_retrofits_starts_the_adapter_as_the_authors_did(path):
    model = load_config(path).model
    if model.init_from is None:
        assert model.adapter_init == "torch-default"
