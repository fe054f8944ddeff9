"""`recurfit demo`, stage by stage: each stage is an ordinary recurfit command's Python API, timed."""

from __future__ import annotations

import json
import platform
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console

from ..data import prepare
from ..data.word_problems import read_solution
from ..errors import RecurfitError
from ..evaluate.figures import plot_flops, plot_recurrence, plot_training
from ..evaluate.loss import load_examples, loss_sweep
from ..evaluate.suite import task_sweep
from ..generation import GenerationSettings, generate_text, prompt_ids
from ..io.runs import read_log
from ..model.accounting import inference_flops_per_token
from ..model.loading import load_model, load_tokenizer, resolve_placement
from ..surgery.parity import check_parity
from ..surgery.retrofit import retrofit
from ..train import load_config, train
from ..train.optim import newton_schulz_dtype
from .report import duration, render_report
from .settings import MATH_TASKS, QUESTION, DemoSettings, training_config, with_shape


def run_demo(settings: DemoSettings, console: Console) -> Path:
    settings = with_shape(settings)
    out = settings.out
    if out.exists():
        if not settings.force:
            raise RecurfitError(f"{out} already exists; pass --force to start the demo over, or choose --out.")
        shutil.rmtree(out)
    stages = Stages(console)
    report: dict = {"settings": settings, "stages": stages.seconds, "cpu": stages.cpu_seconds, "machine": machine()}
    console.print(f"Running on {report['machine']}.", highlight=False)

    with stages.timed("1. Retrofit and parity check"):
        parent, tokenizer = load_model(settings.model, dtype=torch.float32), load_tokenizer(settings.model)
        report["parity"] = _retrofit_check(parent, tokenizer, settings.shape, console)
        report["parent_layers"] = parent.config.num_hidden_layers
    with stages.timed("2. Data"):
        data = _prepare_data(settings, tokenizer, out)
    for name, shape, title in (
        ("recurrent", settings.shape, "3. Train the retrofit"),
        ("parent", None, "4. Train the parent on the same tokens"),
    ):
        with stages.timed(title):
            train(load_config(None, base=training_config(settings, data, out / name, shape)))

    placement = resolve_placement(settings.device, settings.dtype)
    model, trained_parent = (
        load_model(str(out / name / "final"), placement.dtype, placement.device) for name in ("recurrent", "parent")
    )
    with stages.timed("5. Loss against test recurrence"):
        report["loss"] = {
            name: loss_sweep(
                model,
                load_examples(str(folder), limit=settings.loss_rows),
                recurrences=settings.loss_recurrences,
                name="retrofit",
                baseline=trained_parent,
                baseline_name="same tokens",
            )
            for name, folder in data.items()
        }
    with stages.timed("6. Math accuracy on held-out word problems"):
        report["math"], report["math_problems"] = _math_accuracy(model, trained_parent, tokenizer, settings, out)
    with stages.timed("7. GSM8K"):
        report["gsm8k"], _ = _against_parent(
            model, trained_parent, tokenizer, ["gsm8k_cot"], settings.gsm8k_recurrences, settings.gsm8k,
            settings.max_new_tokens, settings.eval_batch,
        )  # fmt: skip
    with stages.timed("8. Samples and figures"):
        _samples_and_figures(report, model, tokenizer, out)
    path = out / "report.md"
    path.write_text(render_report(report))
    console.rule(f"[bold]Report: {path}")
    return path


def _prepare_data(settings: DemoSettings, tokenizer, out: Path) -> dict[str, Path]:
    data = {name: out / "data" / name for name in ("prose", "math")}
    # 1% of the ~3,700 prose passages are held out; of a few math problems, enough for validation rows
    held_out = {"prose": 0.01, "math": max(0.01, 8 / settings.math_problems)}
    for name, source in (("prose", "embedded:prose"), ("math", f"embedded:math:{settings.math_problems}")):
        prepare(
            tokenizer,
            [source],
            settings.seq_len,
            data[name],
            tokenizer_name=settings.model or "embedded",
            val_fraction=held_out[name],
        )

    return data


def _math_accuracy(model, parent, tokenizer, settings: DemoSettings, out: Path):
    """Greedy exact-match accuracy on the held-out word problems (`recurfit eval tasks`' sweep) at each r and for
    the parent; the results file and every problem's answer (OUT/word_problems.json, .jsonl) beside the report."""
    sweep, raw = _against_parent(
        model, parent, tokenizer, list(MATH_TASKS.values()), settings.math_recurrences, settings.math_eval,
        settings.math_new_tokens, settings.eval_batch, log_samples=True,
    )  # fmt: skip
    sweep.save(out / "word_problems.json")
    problems = per_problem(raw["samples"])
    with open(out / "word_problems.jsonl", "w") as lines:
        lines.writelines(json.dumps(problem) + "\n" for problem in problems)
    return sweep, problems


def _against_parent(model, parent, tokenizer, tasks, recurrences, limit, max_new_tokens, batch_size, log_samples=False):
    """`recurfit eval tasks`' sweep of the retrofit at each r, against the parent trained on the same tokens."""
    return task_sweep(
        model,
        tokenizer,
        tasks=tasks,
        recurrences=recurrences,
        name="retrofit",
        baseline=parent,
        baseline_name="same tokens",
        limit=limit,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        log_samples=log_samples,
    )


def per_problem(samples: dict) -> list[dict]:
    """One record per model (r=… or parent), split and problem from lm-eval's logged samples: the answer, the
    number read from it (flexible-extract: its last number, the headline), whether it is the right one, and how
    the answer is worked (`read_solution`: the answer it states, its arithmetic steps and how many are true)."""
    splits = {task: split for split, task in MATH_TASKS.items()}
    return [
        {
            "model": model,
            "split": splits[task.removesuffix("_offline")],
            "problem": sample["doc_id"],
            "question": sample["doc"]["question"],
            "target": sample["target"],
            "answer": sample["resps"][0][0],
            "extracted": sample["filtered_resps"][0],
            "correct": bool(sample["exact_match"]),
            **read_solution(sample["resps"][0][0])._asdict(),
        }
        for model, tasks in samples.items()
        for task, logged in tasks.items()
        for sample in logged
        if sample["filter"] == "flexible-extract"
    ]


def _samples_and_figures(report: dict, model, tokenizer, out: Path) -> None:
    settings = report["settings"]
    report["samples"] = _samples(model, tokenizer, [1, settings.mean_recurrence * 2], settings.max_new_tokens)
    logs = {name: read_log(out / name) for name in ("recurrent", "parent")}
    report["flops"] = {name: [r for r in log if r["kind"] == "train"][-1] for name, log in logs.items()}
    # the validation records by step: after the healing and at the end
    report["validation"] = {name: {r["step"]: r for r in log if r["kind"] == "eval"} for name, log in logs.items()}
    report["inference_flops"] = {r: inference_flops_per_token(model, r) for r in (1, settings.mean_recurrence)}

    figures = out / "figures"
    figures.mkdir()
    plot_training([out / "recurrent", out / "parent"], figures / "training.png")
    for name, sweep in report["loss"].items():
        plot_recurrence([sweep], figures / f"loss_{name}.png")
    plot_recurrence([report["math"]], figures / "math_recurrence.png")
    plot_flops([report["math"]], figures / "math_flops.png")
    plot_recurrence([report["gsm8k"]], figures / "gsm8k.png")


class Stages:
    """Times each stage of the demo, says so as each ends, and keeps the seconds for the report."""

    def __init__(self, console: Console):
        self.console, self.seconds, self.cpu_seconds = console, {}, {}

    @contextmanager
    def timed(self, title: str):
        """Wall time, and the process's CPU time over all its threads: on cores other jobs share, the CPU time
        divided by the cores it used is about what the stage takes on idle ones."""
        self.console.rule(f"[bold]{title}")
        start, cpu = time.perf_counter(), time.process_time()
        yield
        self.seconds[title] = time.perf_counter() - start
        self.cpu_seconds[title] = time.process_time() - cpu
        self.console.print(f"{title}: {duration(self.seconds[title])}", highlight=False)


def machine() -> str:
    """What the timings depend on: the processor, torch's CPU capability (AVX2 CPUs emulate bf16), threads."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (GPU); torch {torch.__version__}"
    muon = newton_schulz_dtype("auto", torch.device("cpu"))
    return (
        f"{_cpu_name()}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} "
        f"threads, Muon's Newton–Schulz in {str(muon).removeprefix('torch.')}; torch {torch.__version__}"
    )


def _cpu_name() -> str:
    try:  # Linux names the model; platform.processor() often says only "x86_64"
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _retrofit_check(parent, tokenizer, shape, console: Console) -> dict:
    """What `recurfit retrofit` checks: the fresh retrofit equals its parent minus the dropped layers."""
    model = retrofit(parent, shape)
    check = check_parity(parent, model, tokenizer, steps=(1, 8))
    layers = model.config.source_layers
    console.print(f"Shape {shape}: prelude {layers['prelude']}, core {layers['core']}, coda {layers['coda']}.")
    console.print(check.describe(), highlight=False)
    return {"layers": layers, "diffs": check.diffs}


def _samples(model, tokenizer, depths: list[int], max_new_tokens: int) -> dict[int, str]:
    ids = prompt_ids(tokenizer, QUESTION)  # raw text, as `recurfit generate` and a server's completion read it
    return {
        r: generate_text(model, tokenizer, ids, GenerationSettings(recurrence=r, max_new_tokens=max_new_tokens)).text
        for r in depths
    }
