"""The demo's settings: one object for the Python API and the command line, torch-free so that `recurfit --help`
stays fast. Its training values default to the demo's recipe (recipe.yaml, also at recipes/demo.yaml), read the
first time a DemoSettings is made; everything else defaults here."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from ..defaults import LOSS_RECURRENCES
from ..errors import RecurfitError

QUESTION = (
    "Question: A baker makes 12 loaves of bread each hour for 5 hours and sells 41 of them. How many loaves "
    "are left?\nAnswer: Let's think step by step."
)
RECIPE = "recipe.yaml"  # beside this module, packaged with it
# The held-out word problems' splits, as `recurfit eval tasks` names them (recurfit/evaluate/tasks/word_problems_*)
MATH_TASKS = {"easy": "word_problems", "hard": "word_problems_hard"}
# What `recurfit demo --depth-task --out OUT` adds to a demo's folder: OUT/depth-task (replaced only with --force)
DEPTH_TASK_FOLDER = "depth-task"
# How long `recurfit demo --depth-task` takes, measured in docs/results/depth-task.md
DEPTH_TASK_TIME = "about 20 minutes on 2 CPU cores with AVX-512"


@cache
def _recipe() -> dict:
    from importlib import resources  # here, not at the top: `recurfit --help` imports this module

    import yaml

    return yaml.safe_load(resources.files(__package__).joinpath(RECIPE).read_text())


def recipe() -> dict:
    """The demo's training recipe as a config mapping (a copy: callers fill in their settings)."""
    return copy.deepcopy(_recipe())


def _from_recipe(*keys: str, convert=None):
    """A field whose default is the recipe's value at `keys`."""

    def default():
        value = _recipe()
        for key in keys:
            value = value[key]
        return convert(value) if convert else value

    return field(default_factory=default)


@dataclass
class DemoSettings:
    out: Path = Path("runs/demo")
    model: str | None = None  # parent folder or Hub id; None: the embedded SmolLM2-135M-Instruct
    shape: tuple[int, int, int] | None = None  # None: chosen from the parent's layer count (`demo_shape`)
    steps: int = _from_recipe("steps")
    heal_steps: int | None = None  # of `steps`, on prose only (then prose and math); None: a quarter of them
    batch: int = _from_recipe("batch", "global")  # sequences per optimizer step
    seq_len: int = 256
    mean_recurrence: int = _from_recipe("depth", "mean_recurrence")
    backprop_depth: int = _from_recipe("depth", "backprop_depth")
    muon_lr: float = _from_recipe("optimizer", "muon_lr")
    lr: float = _from_recipe("optimizer", "lr")
    math_problems: int = 4000
    math_eval: int = 16  # held-out word problems scored per split (easy, hard), the first N
    math_recurrences: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    math_new_tokens: int | None = None  # None: each split's own limit (64 and 96 tokens, room for a worked answer)
    # Problems decoded together: each split's 16 in one batch. Decoding on a CPU reads every weight once per token
    # for the whole batch, so one batch of 16 is much faster than two of 8 (stage 6, docs/results/cpu.md).
    eval_batch: int = 16
    # to r = 16, not LOSS_RECURRENCES' 32: the sweep's cost grows with its largest r, and every demo run so far was
    # flat from r = 4 (the train mean) on
    loss_recurrences: list[int] = field(default_factory=lambda: [r for r in LOSS_RECURRENCES if r <= 16])
    loss_rows: int = 16  # validation sequences per store
    # GSM8K test problems (the first N): 0 for every model at this scale, kept so that larger runs are measured alike
    gsm8k: int = 8
    gsm8k_recurrences: list[int] = field(default_factory=lambda: [1, 8])  # the ends: at this scale it is 0 or noise
    max_new_tokens: int = 128
    force: bool = False
    device: str | None = None  # where the trained models are evaluated (None: cuda if available, else cpu)
    dtype: str = "auto"  # their precision there (auto: bfloat16 on a GPU, float32 on a CPU)

    def __post_init__(self):
        if self.heal_steps is None:
            self.heal_steps = quarter(self.steps)


def demo_shape(layers: int) -> tuple[int, int, int]:
    """The demo's shape for a parent of `layers` layers: a fifth of them (rounded down) for the prelude and for the
    coda, twice that for the core. At least a fifth of the layers is dropped, so a recurrence always costs less
    than the parent: (6, 12, 6) for SmolLM2-135M's 30, (4, 8, 4) for Qwen2.5-0.5B's 24 (all 24 under (6, 12, 6))
    and TinyLlama's 22 (the paper's headline shape), (3, 6, 3) for Llama-3.2-1B's 16."""
    unit = layers // 5
    if unit == 0:
        raise RecurfitError(
            f"The parent has {layers} layers, too few for the demo's default shape (at least 5); pass --shape P,R,C."
        )
    return unit, 2 * unit, unit


def with_shape(settings: DemoSettings) -> DemoSettings:
    """The settings with their shape chosen from the parent's layer count (its config alone) when none is given."""
    if settings.shape is not None:
        return settings
    from ..model.loading import load_config  # here: it imports transformers

    layers = load_config(settings.model).get_text_config().num_hidden_layers
    return dataclasses.replace(settings, shape=demo_shape(layers))


def quarter(steps: int) -> int:
    """A quarter of the steps, at least one: how long the demo heals on prose."""
    return max(steps // 4, 1)


def training_config(settings: DemoSettings, data: dict[str, Path], out: Path, shape) -> dict:
    """The recipe with the settings filled in: a training config for `out` (`shape` None: the parent itself)."""
    config = recipe()
    heal_tokens = settings.heal_steps * settings.batch * settings.seq_len
    config["out"] = str(out)
    config["model"].update(path=settings.model, shape=list(shape) if shape else None)
    config["data"]["phases"] = [
        {"sources": [str(data["prose"])], "tokens": heal_tokens},
        {"sources": [str(data["prose"]), str(data["math"])]},
    ]
    config["data"]["validation"] = [str(data["prose"]), str(data["math"])]
    config["depth"].update(mean_recurrence=settings.mean_recurrence, backprop_depth=settings.backprop_depth)
    config["optimizer"].update(muon_lr=settings.muon_lr, lr=settings.lr)
    config["batch"] = {"micro": min(config["batch"]["micro"], settings.batch), "global": settings.batch}
    config["steps"] = settings.steps
    # after the healing and at the end: the two validations the report reads (each costs about two training steps)
    config["eval"].update(
        at=[settings.heal_steps] if settings.heal_steps else [], steps=[1, settings.mean_recurrence],
        rows=settings.loss_rows,
    )  # fmt: skip
    return config
