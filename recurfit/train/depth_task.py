"""Training and scoring on the depth task (`recurfit.data.depth_task`): k-hop dereferencing, where each recurrence
can resolve one hop.

A retrofit trains on every variable of each chain and is read out after every recurrence that takes gradient;
after recurrence i each answer is trained towards the variable its query points to after i hops (its value once i
reaches its hop count): the trace of a lookup that takes one hop per recurrence. A parent (no recurrence) trains
on the answers alone. Scoring is teacher-forced: the argmax at each answer position, on held-out chains.

Made cheap enough for a CPU: the head is cut to the task's tokens (`TaskHead`: logits over 39 rows instead of
the vocabulary, at the answer positions only) and the embeddings are frozen.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..data.depth_task import NAMES, VALUES, DepthExample, bindings, examples
from ..errors import RecurfitError
from .config.binder import bind, read_yaml

TOKENS = NAMES + VALUES + "=,."  # the task's whole alphabet, one token each


@dataclass(frozen=True)
class DepthRecipe:
    """How a model is trained on the task. The defaults are the recipe measured in docs/results/depth-task.md."""

    steps: int = 150
    batch: int = 8  # examples per step
    # AdamW, after a linear warmup of `warmup` steps: a rate at which both models learn (at 1e-3 the parent learns
    # nothing in 150 steps, at 1e-4 the retrofit not three hops)
    lr: float = 3e-4
    warmup: int = 10
    hops: int = 4  # training answers are 1 to `hops` hops deep
    deepest: bool = True  # every training chain `hops` deep (answers of each hop count equally many), not 1 to `hops`
    chains: int = 3  # per example
    max_r: int = 6  # each step's recurrence drawn uniformly from 1 to max_r
    backprop: int = 6  # the last `backprop` of them take gradient (and are read out): all of them, here
    seed: int = 0

    def __post_init__(self):
        _check_positive(self, "steps", "batch", "lr", "warmup", "hops", "chains", "max_r", "backprop")
        _check_names(self.chains, self.hops)


@dataclass(frozen=True)
class DepthScoring:
    """What a trained model is scored on: held-out examples of `chains` chains per hop count, at each r."""

    hops: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    recurrences: tuple[int, ...] = (1, 2, 4, 8, 16)
    examples: int = 48  # per hop count
    chains: int = 3

    def __post_init__(self):
        _check_positive(self, "examples", "chains")
        for name in ("hops", "recurrences"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise RecurfitError(f"score.{name} must be a list of positive integers; got {values!r}.")
        _check_names(self.chains, max(self.hops))


def _check_positive(settings, *names: str) -> None:
    for name in names:
        if getattr(settings, name) <= 0:
            raise RecurfitError(f"{name} must be positive; got {getattr(settings, name)!r}.")


def _check_names(chains: int, hops: int) -> None:
    """A program's chains need distinct names: up to `hops` + 1 each (the task's one distractor), from 26 letters."""
    if chains * (hops + 1) > len(NAMES):
        raise RecurfitError(
            f"{chains} chains of {hops} hops need up to {chains * (hops + 1)} variable names and the task has "
            f"{len(NAMES)}: use fewer chains or hops."
        )


@dataclass(frozen=True)
class DepthRecipeFile:
    """A recipe file's sections (`recurfit demo --depth-task --depth-recipe FILE`); what it leaves out keeps its
    default."""

    train: DepthRecipe = dataclasses.field(default_factory=DepthRecipe)
    score: DepthScoring = dataclasses.field(default_factory=DepthScoring)


def load_depth_recipe(path) -> DepthRecipeFile:
    """A recipe file: YAML with an optional `train` section of `DepthRecipe`'s fields and an optional `score`
    section of `DepthScoring`'s."""
    try:
        return bind(DepthRecipeFile, read_yaml(path))
    except RecurfitError as error:
        raise RecurfitError(f"The depth-task recipe {path}: {error}") from None


class TaskHead(nn.Module):
    """The rows of a language model's head for the task's tokens: logits over those alone."""

    def __init__(self, lm_head: nn.Linear, tokenizer):
        super().__init__()
        ids = tokenizer.convert_tokens_to_ids(list(TOKENS))
        self.register_buffer("vocab_ids", torch.tensor(ids))
        self.weight = nn.Parameter(lm_head.weight.detach()[self.vocab_ids].clone())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.T


@dataclass
class Batch:
    """Right-padded programs and, per answer, its place, the row of its answer in the `TaskHead`, its hop count
    and its pointers: the row of the variable its query points to after 1, 2, ... hops (then its value)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: torch.Tensor  # the example of each answer
    positions: torch.Tensor  # the position whose logits predict it
    answers: torch.Tensor
    hops: torch.Tensor
    pointers: torch.Tensor  # answers × pointer steps

    def to(self, device) -> Batch:
        return Batch(*(getattr(self, name).to(device) for name in self.__dataclass_fields__))


def encode(batch: list[DepthExample], tokenizer, pointer_steps: int = 16) -> Batch:
    """The examples as tensors (every character is one token: checked)."""
    ids = [tokenizer(example.text).input_ids for example in batch]
    if any(len(row) != len(example.text) for row, example in zip(ids, batch)):
        raise ValueError("The depth task needs a tokenizer with one token per character of its alphabet.")
    width = max(map(len, ids))
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    row_of = {token: i for i, token in enumerate(TOKENS)}
    rows, positions, answers, hops, pointers = [], [], [], [], []
    for i, example in enumerate(batch):
        binds = bindings(example)
        for index, answer, depth in example.answers:
            rows.append(i)
            positions.append(index - 1)
            answers.append(row_of[answer])
            hops.append(depth)
            name, trace = example.text[index - 2], []
            for _ in range(pointer_steps):
                name = binds.get(name, name)  # a value binds nothing: the trace stays there
                trace.append(row_of[name])
            pointers.append(trace)
    return Batch(input_ids, mask, *map(torch.tensor, (rows, positions, answers, hops, pointers)))


def _answer_logits(model, head: TaskHead, batch: Batch, **kwargs) -> list[torch.Tensor]:
    """The head at the answer positions: after each of `readout_steps` (a retrofit) and at the end."""
    out = model.model(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **kwargs)
    readings = [*(getattr(out, "readout_hidden_states", None) or ()), out.last_hidden_state]
    return [head(hidden[batch.rows, batch.positions]).float() for hidden in readings]


def train_step_loss(model, head: TaskHead, batch: Batch, r: int | None, backprop: int) -> torch.Tensor:
    """The mean cross-entropy of one step: with `r` (a retrofit), the trace after each recurrence that takes
    gradient; without (a parent), the answers."""
    if r is None:
        (logits,) = _answer_logits(model, head, batch)
        return F.cross_entropy(logits, batch.answers)
    k = min(r, backprop)
    steps = range(r - k + 1, r + 1)
    readings = _answer_logits(model, head, batch, num_steps=(r - k, k), readout_steps=list(steps)[:-1])
    return sum(F.cross_entropy(logits, batch.pointers[:, i - 1]) for i, logits in zip(steps, readings)) / k


def prepare(model, tokenizer) -> TaskHead:
    """Cut `model`'s head to the task's tokens (the full head leaves the model and its optimizer) and freeze the
    embeddings; the cut head is returned."""
    head = TaskHead(model.lm_head, tokenizer).to(model.lm_head.weight.device)
    model.lm_head = head
    model.get_input_embeddings().weight.requires_grad_(False)
    return head


def train(model, head: TaskHead, tokenizer, recipe: DepthRecipe, recurrent: bool, on_step=None) -> list[float]:
    """Train `model` on `recipe.steps × recipe.batch` training examples (the same ones for every model at the same
    recipe); the losses per step. `on_step(step, loss)` is called after each step (progress). Seeded (the examples,
    each step's r and s_0's noise): the same model and recipe give the same losses."""
    torch.manual_seed(recipe.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / recipe.warmup))
    hops = [recipe.hops] if recipe.deepest else range(1, recipe.hops + 1)
    stream = examples("train", recipe.steps * recipe.batch, hops, recipe.chains, seed=recipe.seed, queries="all")
    rng, device, losses = random.Random(recipe.seed), head.weight.device, []
    for step in range(recipe.steps):
        batch = encode([next(stream) for _ in range(recipe.batch)], tokenizer, recipe.max_r).to(device)
        r = rng.randint(1, recipe.max_r) if recurrent else None
        loss = train_step_loss(model, head, batch, r, recipe.backprop)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if on_step:
            on_step(step, losses[-1])
    model.eval()
    return losses


@torch.no_grad()
def accuracy(model, head: TaskHead, tokenizer, hops: int, r: int | None, count=48, chains=3, seed=0, batch=48):
    """Teacher-forced accuracy on `count` held-out examples of `chains` chains queried at `hops` hops, at `r`
    recurrences (None: a parent). Seeded (s_0's noise): the same model scores the same."""
    torch.manual_seed(seed)
    test = list(examples("test", count, [hops], chains, seed=seed))
    right = 0
    for start in range(0, count, batch):
        encoded = encode(test[start : start + batch], tokenizer, pointer_steps=1).to(head.weight.device)
        (logits,) = _answer_logits(model, head, encoded, **({"num_steps": r} if r else {}))
        right += (logits.argmax(-1) == encoded.answers).sum().item()
    return right / (count * chains)
