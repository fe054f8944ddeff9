"""The depth-task act: does more test-time recurrence answer deeper questions?

A retrofit and its parent train on the same k-hop lookups (`recurfit.data.depth_task`, trained by
`recurfit.train.depth_task`); each is scored on held-out chains per hop count, the retrofit at several r. The
retrofit of the embedded SmolLM2-135M-Instruct keeps layers 0-1 as its prelude, 16-19 as its core and 28-29 as its
coda (`LOOKUP_LAYERS`): the core holds the parent's induction heads (layers 17 and 18), which attend from a query to
the statement that binds it, so that each recurrence can take one hop. Its adapter adds the state to the prelude's
output (A([s; e]) = s + e), so that the state reaches the core from the first step. Both choices, and the recipe,
are measured in docs/results/depth-task.md.

Writes OUT/depth_task.json (a results file, as `recurfit eval` writes), depth_task.md (the table and what it
shows) and depth_task.png (accuracy against r, a panel per hop count, the parent and guessing as lines).
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.progress import TextColumn

from ..data.depth_task import VALUES, examples
from ..evaluate.figures import plot_recurrence
from ..evaluate.results import Row, Sweep
from ..io.files import check_output, staged_directory
from ..model.loading import load_model, load_tokenizer
from ..progress import progress_bar
from ..surgery.retrofit import retrofit
from ..train.depth_task import DepthRecipe, DepthScoring, accuracy, prepare, train
from .settings import DEPTH_TASK_FOLDER

LOOKUP_LAYERS = {"prelude": [0, 1], "core": [16, 17, 18, 19], "coda": [28, 29]}  # of the embedded model


def run_depth_act(
    out: Path,
    console,
    *,
    force: bool = False,
    recipe: DepthRecipe | None = None,
    scoring: DepthScoring | None = None,
    parent=None,
    tokenizer=None,
    layers: dict = LOOKUP_LAYERS,
    device=None,
) -> Sweep:
    """Train the retrofit and the parent (the embedded model unless given) on the same examples, score both, and
    write the act's files into OUT/depth-task (replaced only with `force`). `recipe` and `scoring`: their defaults
    if None; `device`: where the embedded model loads (a given parent stays where it is)."""
    recipe, scoring = recipe or DepthRecipe(), scoring or DepthScoring()
    hops = scoring.hops
    folder = Path(out) / DEPTH_TASK_FOLDER
    check_output(folder, force)  # before the training; the folder is replaced once the new results are written
    parent = parent if parent is not None else load_model(None, dtype=torch.float32, device=device)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(None)
    model = retrofit(parent, adapter="add", **layers)
    heads = {}
    for name, trained, recurrent in (("retrofit", model, True), ("parent", parent, False)):
        heads[name] = prepare(trained, tokenizer)
        _train(name, trained, heads[name], tokenizer, recipe, recurrent)
    scored = {"count": scoring.examples, "chains": scoring.chains, "seed": recipe.seed}
    at_depth = {r: (model, heads["retrofit"]) for r in scoring.recurrences} | {None: (parent, heads["parent"])}
    rows = _score(at_depth, tokenizer, hops, scored)
    sweep = Sweep(
        kind="tasks",
        model="retrofit",
        metrics=[_metric(h) for h in hops],
        rows=rows[:-1],
        parent=rows[-1],
        chance=Row("guessing a digit of the program", {_metric(h): guessing(h, **scored) for h in hops}),
        details={
            "documents": {_metric(h): scoring.examples * scoring.chains for h in hops},
            "trained hops": recipe.hops,
            "recipe": vars(recipe),
            "layers": layers,
        },
    )
    with staged_directory(folder, replace=force) as staging:
        sweep.save(staging / "depth_task.json")
        plot_recurrence([sweep], staging / "depth_task.png")
        (staging / "depth_task.md").write_text(render(sweep))
    console.print(f"Wrote {folder / 'depth_task.md'}.", highlight=False)
    return sweep


def _train(name: str, model, head, tokenizer, recipe: DepthRecipe, recurrent: bool) -> None:
    with progress_bar(TextColumn("{task.fields[loss]}")) as bar:
        task = bar.add_task(f"depth task: training the {name}", total=recipe.steps, loss="")

        def step(_, loss):
            bar.update(task, advance=1, loss=f"loss {loss:.3f}")

        train(model, head, tokenizer, recipe, recurrent, on_step=step)


def _score(models: dict, tokenizer, hops, scored: dict) -> list[Row]:
    """A row per entry of `models` (r, or None for the parent: its model and head), each hop count a metric."""
    rows = []
    with progress_bar() as bar:
        task = bar.add_task("depth task: scoring", total=len(hops) * len(models))
        for r, (model, head) in models.items():
            scores = {}
            for h in hops:
                scores[_metric(h)] = accuracy(model, head, tokenizer, h, r, **scored)
                bar.advance(task)
            rows.append(Row.measured(model, r, scores, label=f"r={r}" if r else "parent, same examples"))
    return rows


def _metric(hops: int) -> str:
    return f"{hops} hop{'s' if hops > 1 else ''}"


def guessing(hops: int, count: int, chains: int, seed: int) -> float:
    """The accuracy of answering each query with a digit of its program drawn at random, on the examples scored:
    the score of a model that learned what an answer looks like and nothing of the lookup."""
    test = examples("test", count, [hops], chains, seed=seed)
    shares = [1 / len(set(e.text.split(".")[0]) & set(VALUES)) for e in test for _ in e.answers]
    return sum(shares) / len(shares)


def render(sweep: Sweep) -> str:
    """The act's page: what was trained, the table and what it shows."""
    trained = sweep.details["trained hops"]
    lines = [
        "# Depth task: k-hop lookups against test-time recurrence",
        "",
        f"Held-out chains, {sweep.details['documents'][sweep.metrics[0]]} answers per hop count; trained on 1 to "
        f"{trained} hops. Teacher-forced accuracy; a query of more hops than r is, by the training's design, "
        "answered with the variable it points to after r hops.",
        "",
        sweep.markdown(),
        "![accuracy against r per hop count](depth_task.png)",
        "",
        *summary(sweep, trained),
    ]
    return "\n".join(lines) + "\n"


def summary(sweep: Sweep, trained: int) -> list[str]:
    """One plain sentence per hop count above one: how the retrofit's accuracy moves with r, against the parent
    and guessing."""
    sentences = []
    for metric in sweep.metrics[1:]:
        by_r = {row.steps: row.metrics[metric] for row in sweep.rows}
        best = max(by_r, key=by_r.get)
        parent, chance = sweep.parent.metrics[metric], sweep.chance.metrics[metric]
        hops = int(metric.split()[0])
        where = "trained on" if hops <= trained else "beyond training"
        trend = " → ".join(f"{100 * by_r[r]:.0f} %" for r in by_r)
        verdict = (
            "above the parent and guessing"
            if by_r[best] > max(parent, chance)
            else "not above the parent"
            if by_r[best] > chance
            else "not above guessing"
        )
        sentences.append(
            f"- **{metric}** ({where}): {trend} at r = {', '.join(map(str, by_r))}; best {100 * by_r[best]:.0f} % "
            f"at r = {best}, {verdict} (the parent {100 * parent:.0f} %, guessing {100 * chance:.0f} %)."
        )
    return sentences
