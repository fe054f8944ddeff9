"""The paper, exactly: settings checked against the authors' released files (docs/reference/paper-settings.md)."""

import json
import math
from pathlib import Path

import pytest
from conftest import suggested_overrides
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import recurfit
from recurfit.model.loading import meta_model
from recurfit.train import load_config
from recurfit.train.counting import paper_run_flops

PAPER_RECIPES = sorted(Path(__file__).parent.parent.joinpath("recipes", "paper").glob("*.yaml"))


PARENTS = {  # the paper recipes' parents' shapes (their Hub configs), built on the meta device: no weights needed
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": dict(
        model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
    ),
    "meta-llama/Llama-3.2-1B": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
    ),
    "allenai/OLMo-2-0425-1B": dict(
        model_type="olmo2", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
    ),
}  # fmt: skip


SETTINGS = Path(__file__).parent.parent / "docs" / "reference" / "paper-settings.md"


RECIPES = Path(__file__).parent.parent / "recipes" / "paper"


PLOT_DATA = json.loads((Path(__file__).parent / "fixtures" / "paper_plot_flops.json").read_text())["files"]


PLOT_TOKENS_PER_STEP = 2**20  # the authors' get_flops counts every run at 2^20 tokens per step


# A run a recipe continues (model.init_from) that no recipe writes: docs/reference/paper-settings.md, two-phase arms.
UNWRITTEN_RUNS = {"runs/tinyllama-two-phase-1-static": ("tinyllama-484-two-phase-1.yaml", ["model.shape=null"])}


def plot_data_table() -> list[tuple[str, str, str | None, list[str]]]:
    """(plot data file, run label, recipe or None for the untrained parent, overrides) from the mapping table of
    docs/reference/paper-settings.md ("Which recipe produced each plotted run")."""
    text = SETTINGS.read_text().split("| plot data file |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in text.splitlines()[2:]:
        file, label, recipe, overrides = (cell.strip() for cell in line.strip("|").split(" | "))
        recipe = recipe.strip("`") if recipe.startswith("`") else None
        rows.append((file.strip("`"), label.strip("`").replace("\\n", "\n"), recipe, overrides.strip("`").split()))
    return [(f, label, recipe, [] if overrides == ["—"] else overrides) for f, label, recipe, overrides in rows]


def recipe_config(recipe: str, overrides: list[str]):
    return load_config(RECIPES / recipe, overrides)


def continued_run(init_from: str):
    """The config of the run `init_from` names: the recipe whose `out` it is."""
    if init_from in UNWRITTEN_RUNS:
        return recipe_config(*UNWRITTEN_RUNS[init_from])
    (config,) = [c for c in map(load_config, RECIPES.glob("*.yaml")) if c.out == init_from]
    return config


def recipe_counts(config) -> dict:
    """Parameter counts of the model a recipe trains, its parent built from the Hub config on the meta device."""
    if config.model.init_from is not None:
        return recipe_counts(continued_run(config.model.init_from))
    settings = dict(PARENTS[config.model.path])
    model = meta_model(CONFIG_MAPPING[settings.pop("model_type")](**settings))
    if config.model.shape is not None:
        model = recurfit.retrofit(model, shape=tuple(config.model.shape), adapter=config.model.adapter)
    return recurfit.count_parameters(model)


def plot_flops(config, checkpoint: int) -> float:
    """The FLOPs the paper's plots give `config`'s run at `checkpoint`, every setting from the loaded config."""
    return paper_run_flops(config, recipe_counts(config), checkpoint, PLOT_TOKENS_PER_STEP)


def suggested_configs(name: str):
    path = RECIPES / name
    return [load_config(path, overrides) for overrides in [[], *suggested_overrides(path)]]


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.stem)
def test_every_paper_recipe_starts_the_adapter_and_draws_depths_as_the_authors_did(path):
    config = load_config(path)
    if config.model.init_from is None:
        assert config.model.adapter_init == "torch-default"
    assert config.depth.draw == "micro_batch"


def test_the_mapping_table_names_every_run_of_every_plot_data_file():
    mapped = {(file, label) for file, label, _, _ in plot_data_table()}
    assert mapped == {(file, label) for file, runs in PLOT_DATA.items() for label in runs}


@pytest.mark.parametrize("row", plot_data_table(), ids=lambda row: f"{row[0]}:{row[1][:30]}")
def test_the_recipes_reproduce_the_flops_of_the_authors_plot_data(row):
    file, label, recipe, overrides = row
    expected = PLOT_DATA[file][label]
    if recipe is None:  # the untrained parent: its one row is checkpoint 0
        assert expected == [[0, 0.0]]
        return
    config = recipe_config(recipe, overrides)
    for checkpoint, flops in expected:
        assert plot_flops(config, checkpoint) == pytest.approx(flops, rel=1e-6), f"{label} at {checkpoint}"


def test_the_fine_web_recipe_counts_its_ramp_as_the_authors_counted_those_runs():
    # Without the ceil rounding the recipe's own row is 1.2e-3 off at step 1,000: far outside 6 figures.
    config = recipe_config("tinyllama-484-fineweb.yaml", [])
    (flops,) = [f for checkpoint, f in PLOT_DATA["loop_whole_model"]["4,8,4"] if checkpoint == 1000]
    assert config.depth.paper_ramp_rounding == "ceil"
    floor = recipe_config("tinyllama-484-fineweb.yaml", ["depth.paper_ramp_rounding=floor"])
    assert plot_flops(floor, 1000) / flops - 1 == pytest.approx(1.23e-3, abs=0.01e-3)


def test_the_scheduling_recipe_runs_the_curriculum_lengths_the_authors_ran():
    # paper_plots/model_size_cache.json: n_schedule_only_max_32_warmup_{0,0625,125,25}, k_schedule_only_…
    configs = suggested_configs("llama-242-schedule.yaml")
    mean_arms = {
        0.0 if c.depth.curriculum == "constant" else c.depth.curriculum_fraction
        for c in configs
        if c.depth.backprop_curriculum == "constant"
    }
    backprop_arms = {c.depth.backprop_curriculum_fraction for c in configs if c.depth.backprop_curriculum == "linear"}
    assert mean_arms == {0.0, 0.0625, 0.125, 0.25}
    assert backprop_arms == {0.0625, 0.125, 0.25}


def test_the_random_init_run_scales_embeddings_for_its_own_shape():
    # Fig. 2's "Random" is plot.py's "Geiping et al. emb_scale" run: √h of Llama-3.2-1B; Huginn's √5280 is the ablation.
    random_runs = [c for c in suggested_configs("llama-242-init.yaml") if c.model.init == "random"]
    assert random_runs[0].out == "runs/llama-242-random"
    assert random_runs[0].model.embedding_scale == pytest.approx(math.sqrt(2048))
    assert [c.model.embedding_scale for c in random_runs[1:]] == [pytest.approx(math.sqrt(5280))]
