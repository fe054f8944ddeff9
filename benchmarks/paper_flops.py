"""A paper recipe's training FLOPs three ways, from the config alone (meta-device models, no weights):

    python benchmarks/paper_flops.py recipes/paper/tinyllama-484-math.yaml [key=value ...]

- paper:  the paper's accounting (`accounting.paper_training_flops`), as the FLOPs axes of its figures;
- drawn:  what the run's `flops` log field adds up: every step's drawn (n, k), with the adapter and final norm;
- mean:   recurfit's earlier `flops_paper`: each step's mean depth, with the adapter and final norm.
Only the three parents of the paper recipes are known (their Hub configs, written out in
recurfit/train/memory.py).
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import recurfit
from recurfit.model.accounting import training_flops_per_token
from recurfit.train import load_config
from recurfit.train.counting import paper_run_flops
from recurfit.train.memory import PLANNED_PARENTS as PARENTS
from recurfit.train.step_plan import depth_schedule


def main(recipe: str, *overrides: str) -> None:
    config = load_config(recipe, list(overrides))
    settings = dict(PARENTS[config.model.path])
    with torch.device("meta"):
        parent = AutoModelForCausalLM.from_config(CONFIG_MAPPING[settings.pop("model_type")](**settings))
    model = recurfit.retrofit(parent, shape=tuple(config.model.shape)) if config.model.shape else parent
    counts = recurfit.count_parameters(model)
    tokens = config.batch.global_ * 1024  # the recipes' --seq-len 1024
    schedule = depth_schedule(config)
    paper = paper_run_flops(config, counts, config.steps, tokens)
    drawn = mean = 0
    for step in range(config.steps):
        drawn += tokens * training_flops_per_token(counts, schedule.at(step))
        mean += tokens * training_flops_per_token(counts, schedule.mean_depth(step))
    print(f"{recipe} {' '.join(overrides)}: {config.steps} steps of {tokens:,} tokens")
    for name, value in (("paper", paper), ("drawn", drawn), ("mean", mean)):
        print(f"  {name:6s} {value:.4e}  ({value / paper:.3f} × paper)")


if __name__ == "__main__":
    main(*sys.argv[1:])
