"""Write each paper recipe's memory header (its predicted peak on an 80 GB GPU, recurfit/train/memory.py) and,
where its micro-batch would not fit, the largest one that does (the same global batch):

    .venv/bin/python scripts/recipe_memory.py          # rewrites recipes/paper/*.yaml in place

tests/test_recipes.py checks that every header agrees with the planner.
"""

from __future__ import annotations

import re
from pathlib import Path

from recurfit.train import load_config
from recurfit.train.memory import PAPER_GPU_MEMORY, PAPER_WORLD, recipe_header, recipe_plan
from recurfit.train.memory_fit import fits, fitting_micro

RECIPES = sorted((Path(__file__).parent.parent / "recipes" / "paper").glob("*.yaml"))
HEADER = "# Memory ("


def update(path: Path) -> str:
    """Rewrite `path`'s micro-batch (when it does not fit) and memory header; returns the header."""
    plan = recipe_plan(path)
    if not fits(plan, PAPER_GPU_MEMORY):
        micro = fitting_micro(lambda m: recipe_plan(path, m), load_config(path), PAPER_WORLD, PAPER_GPU_MEMORY)
        text = re.sub(r"(batch: \{micro: )\d+", rf"\g<1>{micro}", path.read_text(), count=1)
        path.write_text(text)
        plan = recipe_plan(path)
    lines = [line for line in path.read_text().splitlines() if not line.startswith(HEADER)]
    end = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    lines.insert(end, recipe_header(plan))
    path.write_text("\n".join(lines) + "\n")
    return lines[end]


if __name__ == "__main__":
    for recipe in RECIPES:
        print(f"{recipe.name}: {update(recipe)}")
