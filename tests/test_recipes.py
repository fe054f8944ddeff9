"""Every recipe is a valid training config, with every override its header suggests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO, suggested_overrides

from recurfit.train import load_config

ALL_RECIPES = sorted(Path(__file__).parent.parent.joinpath("recipes").rglob("*.yaml"))
DEPTH_RECIPES = [path for path in ALL_RECIPES if path.parent.name == "depth-task"]  # `recurfit demo --depth-task`'s
RECIPES = [path for path in ALL_RECIPES if path not in DEPTH_RECIPES]


SETTINGS = Path(__file__).parent.parent / "docs" / "reference" / "paper-settings.md"


SECTION = re.compile(r"^#{2,3} .*?`(recipes/paper/[\w.-]+\.yaml)`|^### \*arm\* .*?overrides `([^`]+)`")


REQUIRED = {
    "parent",
    "shape",
    "steps",
    "global batch",
    "optimiser",
    "warmup",
    "decay",
    "mean recurrence",
    "backprop depth",
    "curriculum",
    "data",
    "eval tasks",
}


def settings_sections() -> list[tuple[str, list[str], list[list[str]]]]:
    """(recipe, overrides, table rows) for each section of the settings page; an arm inherits its recipe."""
    sections, recipe, inside = [], None, False
    for line in SETTINGS.read_text().splitlines():
        match = SECTION.match(line)
        if match and match.group(1):
            recipe, inside = match.group(1), True
            sections.append((recipe, [], []))
        elif match:
            sections.append((recipe, match.group(2).split(), []))
            inside = True
        elif line.startswith("#"):  # a heading of no recipe (the FLOPs section): its tables are not settings
            inside = False
        elif inside and line.startswith("| ") and not line.startswith("| setting"):
            sections[-1][2].append([cell.strip() for cell in line.strip("|").split(" | ")])
    return sections


def config_value(config: dict, key: str):
    for part in key.split("."):
        config = config[int(part)] if isinstance(config, list) else config[part]
    return config


def same(expected, actual) -> bool:
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)) and not isinstance(expected, bool):
        return abs(expected - actual) <= 1e-12 * max(1.0, abs(expected))
    if isinstance(expected, list) and isinstance(actual, list):
        return len(expected) == len(actual) and all(same(e, a) for e, a in zip(expected, actual))
    return expected == actual


PAPER_RECIPES = sorted((Path(__file__).parent.parent / "recipes" / "paper").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_recipe_validates_with_its_suggested_overrides(path):
    config = load_config(path)
    assert config.out.startswith("runs/") and config.steps >= 1
    for overrides in suggested_overrides(path):
        load_config(path, overrides)


def test_recipes_cover_the_papers_experiments():
    names = {p.stem for p in RECIPES}
    assert {
        "llama-242-init",
        "llama-242-cooldown",
        "llama-242-schedule",
        "tinyllama-484-fineweb",
        "llama-layers",
        "tinyllama-shortgpt",
        "tinyllama-787-math",
        "tinyllama-484-two-phase-1",
        "tinyllama-484-two-phase-2",
        "tinyllama-484-single-phase",
        "tinyllama-484-math",
        "olmo-464-math",
        "llama-464-math",
    } <= names


def test_every_paper_recipe_has_a_settings_section_and_every_section_a_recipe():
    documented = {recipe for recipe, _, _ in settings_sections()}
    on_disk = {str(p.relative_to(p.parents[2])) for p in RECIPES if p.parent.name == "paper"}
    assert documented == on_disk


@pytest.mark.parametrize(
    "recipe, overrides, rows", settings_sections(), ids=lambda v: str(v)[:60] if isinstance(v, str) else None
)
def test_the_settings_table_matches_the_recipe(recipe, overrides, rows):
    root = Path(__file__).parent.parent
    config = load_config(root / recipe, overrides).to_dict()
    checked = 0
    for setting, value, source, key in rows:
        assert source, f"{recipe}: the row {setting!r} names no source"
        if key == "—":
            continue
        literal = re.match(r"`([^`]+)`", value)
        assert literal and key.startswith("`"), f"{recipe}: row {setting!r} needs a `value` and a `key`"
        expected = yaml.safe_load(literal.group(1))
        actual = config_value(config, key.strip("`"))
        assert same(expected, actual), (
            f"{recipe} {' '.join(overrides)}: {setting} is {actual!r} in the recipe, {expected!r} in the table"
        )
        checked += 1
    assert checked >= 1


def test_main_sections_cover_every_kind_of_setting():
    for recipe, overrides, rows in settings_sections():
        if overrides or recipe.endswith(
            (
                "olmo-464-math.yaml",
                "llama-464-math.yaml",
                "cooldown.yaml",
                "787-math.yaml",
                "two-phase-1.yaml",
                "two-phase-2.yaml",
                "llama-layers.yaml",
                "shortgpt.yaml",
            )
        ):
            continue  # these sections list what differs from the experiment they extend
        names = {row[0] for row in rows}
        missing = {name for name in REQUIRED if not any(name in n for n in names)}
        missing -= {"eval tasks"} if "schedule" in recipe or "cooldown" in recipe else set()
        assert not missing, f"{recipe}: the settings table lacks {sorted(missing)}"


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.stem)
def test_each_paper_recipe_states_its_planned_peak_and_fits_an_80gb_gpu(path):
    """The header agrees with the planner (scripts/recipe_memory.py writes it), and the recipe's micro-batch fits."""
    from recurfit.train.memory import PAPER_GPU_MEMORY, recipe_header, recipe_plan
    from recurfit.train.memory_fit import fits

    plan = recipe_plan(path)
    assert recipe_header(plan) in path.read_text().splitlines()
    assert fits(plan, PAPER_GPU_MEMORY)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-14b"])
def test_each_large_parent_recipe_states_its_planned_peak_on_8_gpus_and_fits(name):
    """The header agrees with the FSDP2 plan at rows of 4,096 tokens, and the recipe's micro-batch fits."""
    from recurfit.train.memory import PAPER_GPU_MEMORY, recipe_header, recipe_plan
    from recurfit.train.memory_fit import fits

    path = REPO / "recipes" / f"{name}.yaml"
    plan = recipe_plan(path, seq_len=4096)
    assert plan.strategy == "fsdp" and plan.world == 8
    assert recipe_header(plan) in path.read_text().splitlines()
    assert fits(plan, PAPER_GPU_MEMORY)


def test_the_cpu_recipe_trains_from_its_first_step():
    import torch

    from recurfit.train import load_config
    from recurfit.train.optim import build_schedulers

    config = load_config(REPO / "recipes" / "smollm2-cpu.yaml")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.optimizer.lr)
    (schedule,) = build_schedulers([optimizer], config.optimizer, config.steps)
    first = schedule.get_last_lr()[0]
    assert first >= 0.1 * config.optimizer.lr > 0


@pytest.mark.parametrize("path", DEPTH_RECIPES, ids=lambda p: p.stem)
def test_each_depth_task_recipe_loads_and_its_header_gives_its_command_and_time(path):
    from recurfit.train.depth_task import load_depth_recipe

    load_depth_recipe(path)
    header = path.read_text().split("\ntrain:")[0]
    assert f"recurfit demo --depth-task --depth-recipe recipes/depth-task/{path.name}" in header
    assert "Expected time" in header
