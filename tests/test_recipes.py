"""Every recipe is a valid training config, with every override its header suggests."""

import re
from pathlib import Path

import pytest

from recurfit.train import load_config

RECIPES = sorted(Path(__file__).parent.parent.joinpath("recipes").rglob("*.yaml"))
KEY = re.compile(r"^(out|steps|model|data|depth|optimizer|batch|eval)(\.[\w]+)*=")


def suggested_overrides(path: Path) -> list[list[str]]:
    """The runs a recipe's header suggests, as override lists: `recurfit train RECIPE k=v …` lines,
    `k=v k2=v2` lines, and `label: k=a | b | c` lines (one run per alternative)."""
    runs = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = re.split(r"\s{2,}[#(]", line.lstrip("# ").split("# ")[0])[0].strip()  # drop trailing remarks
        text = text.split(":", 1)[1].strip() if re.match(r"^[a-z ]+:\s", text) else text
        if text.startswith("recurfit train"):
            runs.append([token for token in text.split()[3:] if "=" in token])
        elif "|" in text and KEY.match(text):
            key, first = text.split("|")[0].split("=", 1)
            runs += [[f"{key}={value.split()[0]}"] for value in [first, *text.split("|")[1:]]]
        elif KEY.match(text):
            runs.append(text.split())
    return runs


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_recipe_validates_with_its_suggested_overrides(path):
    config = load_config(path)
    assert config.out.startswith("runs/") and config.steps >= 1
    for overrides in suggested_overrides(path):
        load_config(path, overrides)


def test_recipes_cover_the_papers_experiments():
    names = {p.stem for p in RECIPES}
    assert {"llama-242-init", "tinyllama-484-fineweb", "llama-layers", "tinyllama-484-two-phase",
            "tinyllama-484-single-phase", "tinyllama-484-math", "olmo-464-math", "llama-464-math"} <= names
