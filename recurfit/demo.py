"""`recurfit demo`: the whole method on a real model, ending in a report (OUT/report.md).

1. Retrofit the parent (default: the embedded SmolLM2-135M) and check parity with its pruned self.
2. Prepare data: English prose (`embedded:prose`) and generated word problems (`embedded:math`), decontaminated.
3. Train the retrofit: heal on prose, then math; 1-sqrt curriculum, Muon, truncated backprop.
4. Train the parent on the same tokens in the same order (the paper's non-recurrent baseline).
5. Evaluate: validation loss at each test recurrence, GSM8K accuracy on a fixed slice of the test set.
6. Write OUT/report.md with the tables, figures, FLOPs and sample generations at two depths.

Every stage is an ordinary recurfit command's Python API; the report says which command reproduces it.
"""

from __future__ import annotations

import math
import platform
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from .data import prepare
from .defaults import LOSS_RECURRENCES
from .errors import RecurfitError
from .evaluate.loss import load_examples, loss_sweep
from .evaluate.plots import plot_recurrence, plot_training
from .evaluate.suite import task_sweep
from .generation import GenerationSettings, generate_text
from .model.accounting import inference_flops_per_token
from .model.loading import load_model, load_tokenizer, resolve_placement
from .surgery.parity import check_parity
from .surgery.retrofit import retrofit
from .train import load_config, train
from .train.config import OptimizerConfig
from .train.metrics import read_log
from .train.optim import newton_schulz_dtype

QUESTION = (
    "Question: A baker makes 12 loaves of bread each hour for 5 hours and sells 41 of them. How many loaves "
    "are left?\nAnswer: Let's think step by step."
)


@dataclass
class DemoSettings:
    out: Path = Path("runs/demo")
    model: str | None = None  # parent folder or Hub id; None: the embedded SmolLM2-135M-Instruct
    # (6,12,6) keeps 24 of SmolLM2's 30 layers: dropping 14 for (4,8,4) starts near loss 8.4 on prose, (6,12,6)
    # near 6.0, and keeping all 30 ((8,14,8)) makes every recurrence as costly as the parent.
    shape: tuple[int, int, int] = (6, 12, 6)
    steps: int = 32
    heal_steps: int = 8  # of `steps`, on prose only
    batch: int = 4  # sequences per optimizer step (2 per forward)
    seq_len: int = 256
    mean_recurrence: int = 4
    backprop_depth: int = 2
    # 5 × the paper's rates (Muon 1e-3, AdamW 5e-5), which suit thousands of steps: in 32 steps they end the
    # retrofit 0.83 nats lower on math than the paper's (docs/demo.md), as the healing study found (docs/healing.md).
    muon_lr: float = 5e-3
    lr: float = 2.5e-4
    math_problems: int = 4000
    loss_recurrences: list[int] = field(default_factory=lambda: list(LOSS_RECURRENCES))
    loss_rows: int = 16  # validation sequences per store
    gsm8k: int = 16  # GSM8K test problems (the first N)
    gsm8k_recurrences: list[int] = field(default_factory=lambda: [1, 4, 8])
    max_new_tokens: int = 128
    force: bool = False
    device: str | None = None  # where the trained models are evaluated (None: cuda if available, else cpu)
    dtype: str = "auto"  # their precision there (auto: bfloat16 on a GPU, float32 on a CPU)


def run_demo(settings: DemoSettings, console: Console) -> Path:
    out = settings.out
    if out.exists():
        if not settings.force:
            raise RecurfitError(f"{out} already exists; pass --force to start the demo over, or choose --out.")
        shutil.rmtree(out)
    stages = Stages(console)
    report: dict = {"settings": settings, "stages": stages.seconds, "machine": machine()}
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
            train(load_config(None, base=_train_config(settings, data, out / name, shape)))

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
    with stages.timed("6. GSM8K"):
        report["gsm8k"], _ = task_sweep(
            model,
            tokenizer,
            tasks=["gsm8k_cot"],
            recurrences=settings.gsm8k_recurrences,
            name="retrofit",
            baseline=trained_parent,
            baseline_name="same tokens",
            limit=settings.gsm8k,
            max_new_tokens=settings.max_new_tokens,
        )
    with stages.timed("7. Samples and figures"):
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


def _samples_and_figures(report: dict, model, tokenizer, out: Path) -> None:
    settings = report["settings"]
    report["samples"] = _samples(model, tokenizer, [1, settings.mean_recurrence * 2], settings.max_new_tokens)
    report["flops"] = {
        name: [r for r in read_log(out / name) if r["kind"] == "train"][-1] for name in ("recurrent", "parent")
    }
    report["inference_flops"] = {r: inference_flops_per_token(model, r) for r in (1, settings.mean_recurrence)}

    figures = out / "figures"
    figures.mkdir()
    plot_training([out / "recurrent", out / "parent"], figures / "training.png")
    for name, sweep in report["loss"].items():
        plot_recurrence([sweep], figures / f"loss_{name}.png")
    plot_recurrence([report["gsm8k"]], figures / "gsm8k.png")


class Stages:
    """Times each stage of the demo, says so as each ends, and keeps the seconds for the report."""

    def __init__(self, console: Console):
        self.console, self.seconds = console, {}

    @contextmanager
    def timed(self, title: str):
        self.console.rule(f"[bold]{title}")
        start = time.perf_counter()
        yield
        self.seconds[title] = time.perf_counter() - start
        self.console.print(f"{title}: {_duration(self.seconds[title])}", highlight=False)


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


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


def _retrofit_check(parent, tokenizer, shape, console: Console) -> dict:
    """What `recurfit retrofit` checks: the fresh retrofit equals its parent minus the dropped layers."""
    model = retrofit(parent, shape)
    check = check_parity(parent, model, tokenizer, steps=(1, 8))
    layers = model.config.source_layers
    console.print(f"Shape {shape}: prelude {layers['prelude']}, core {layers['core']}, coda {layers['coda']}.")
    console.print(check.describe(), highlight=False)
    return {"layers": layers, "diffs": check.diffs}


def _train_config(settings: DemoSettings, data: dict, out: Path, shape) -> dict:
    heal_tokens = settings.heal_steps * settings.batch * settings.seq_len
    return {
        "out": str(out),
        "model": {"path": settings.model, "shape": list(shape) if shape else None},
        "data": {
            "phases": [{"sources": [str(data["prose"])], "tokens": heal_tokens}, {"sources": [str(data["math"])]}],
            "validation": [str(data["prose"]), str(data["math"])],
        },
        "depth": {
            "mean_recurrence": settings.mean_recurrence,
            "backprop_depth": settings.backprop_depth,
            "curriculum": "1-sqrt",
            "curriculum_fraction": 0.75,
        },
        "optimizer": {
            "name": "muon",
            "muon_lr": settings.muon_lr,
            "lr": settings.lr,
            "warmup": 0.1,
            "decay": 0.2,
            "decay_shape": "linear",
            "min_lr_ratio": 0.0,
        },
        "batch": {"micro": min(2, settings.batch), "global": settings.batch},
        "steps": settings.steps,
        "checkpoint": {"every": 0, "keep": 1},
        "eval": {"every": max(settings.steps // 4, 1), "steps": [1, settings.mean_recurrence], "rows": 4},
    }


def _samples(model, tokenizer, depths: list[int], max_new_tokens: int) -> dict[int, str]:
    ids = tokenizer(QUESTION, return_tensors="pt").input_ids
    return {
        r: generate_text(model, tokenizer, ids, GenerationSettings(recurrence=r, max_new_tokens=max_new_tokens)).text
        for r in depths
    }


def render_report(report: dict) -> str:
    """report.md: the retrofit, training, each evaluation, samples, where the time went, and how to reproduce."""
    parent = report["settings"].model or "the embedded SmolLM2-135M-Instruct"
    header = ["# recurfit demo", "", f"Parent: {parent} ({report['parent_layers']} layers).", ""]
    sections = (_retrofit_section, _training_section, _evaluation_sections, _samples_section, _time_section)
    return "\n".join(header + [line for section in sections for line in section(report)])


def _retrofit_section(report: dict) -> list[str]:
    P, R, C = report["settings"].shape
    layers = report["parity"]["layers"]
    dropped = report["parent_layers"] - P - R - C
    return [
        "## 1. Retrofit",
        "",
        f"Shape ({P}, {R}, {C}) by the paper's rule: prelude = parent layers {layers['prelude']}, core = "
        f"{layers['core']}, coda = {layers['coda']}; {dropped} layers dropped. Why this shape: every dropped layer "
        "must be healed by training, and every core layer is paid for at each recurrence; this shape keeps most of "
        "the parent while a recurrence stays cheap.",
        "",
        "Parity of the fresh retrofit with the parent minus its dropped layers (max |Δlogit|, left-padded batch): "
        + ", ".join(f"r={r}: {d:.1e}" for r, d in report["parity"]["diffs"].items())
        + ".",
        "",
    ]


def _rates(settings: DemoSettings) -> str:
    """The learning rates, and how they relate to the paper's (which suit runs of thousands of steps)."""
    paper = OptimizerConfig()
    rates = f"Muon at {_rate(settings.muon_lr)} (AdamW at {_rate(settings.lr)} for embeddings and norms)"
    if (settings.muon_lr, settings.lr) == (paper.muon_lr, paper.lr):
        return f"{rates}: the paper's rates"
    ratio = settings.muon_lr / paper.muon_lr
    relation = f"{ratio:g} times the paper's" if math.isclose(settings.lr, ratio * paper.lr) else "not the paper's"
    return (
        f"{rates}: {relation} (Muon {_rate(paper.muon_lr)}, AdamW {_rate(paper.lr)}), which are set for runs of "
        "thousands of steps; in a run of tens of steps, larger steps heal far more of the retrofit (docs/healing.md, "
        "docs/demo.md)"
    )


def _rate(value: float) -> str:
    """A learning rate as people write them: 5e-3, 2.5e-4."""
    mantissa, exponent = f"{value:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def _training_section(report: dict) -> list[str]:
    settings, flops = report["settings"], report["flops"]

    def row(name: str, run: dict, inference: str = "") -> str:
        return (
            f"| {name} | {run.get('loss', float('nan')):.3f} | {run.get('flops', 0):.3e} | "
            f"{run.get('flops_paper', 0):.3e} | {inference} |"
        )

    inference = " / ".join(f"{v / 1e9:.2f} (r={r})" for r, v in report["inference_flops"].items())
    return [
        "## 2-4. Training",
        "",
        f"{settings.steps} optimizer steps of {settings.batch} × {settings.seq_len} tokens: {settings.heal_steps} "
        f"steps of healing on English prose, then generated word problems (recurfit's own templates, "
        f"decontaminated against every evaluation set). Retrofit: mean recurrence ramped to "
        f"{settings.mean_recurrence} (1-sqrt curriculum over 75% of the steps), truncated backprop through "
        f"{settings.backprop_depth} steps, {_rates(settings)}. The parent trains on the same tokens in the same "
        "order, at the same rates.",
        "",
        "| model | final training loss | training FLOPs (drawn depths) | FLOPs (paper's rule) "
        "| inference GFLOPs/token |",
        "|---|---|---|---|---|",
        row("retrofit", flops["recurrent"], inference),
        row("parent", flops["parent"]),
        "",
        "![training loss against steps and FLOPs](figures/training.png)",
        "",
    ]


def _evaluation_sections(report: dict) -> list[str]:
    lines = ["## 5. Validation loss against test recurrence", ""]
    for name, sweep in report["loss"].items():
        lines += [
            f"**{name}** ({sweep.details['data']}):",
            "",
            sweep.markdown(),
            f"![{name}](figures/loss_{name}.png)",
            "",
        ]
    return lines + [
        f"## GSM8K (the first {report['settings'].gsm8k} test problems, 1-shot chain of thought, flexible-extract)",
        "",
        report["gsm8k"].markdown(),
        "![GSM8K against test recurrence](figures/gsm8k.png)",
        "",
    ]


def _samples_section(report: dict) -> list[str]:
    lines = ["## Sample generations (greedy)", "", "```", QUESTION, "```", ""]
    for r, text in report["samples"].items():
        lines += [f"**r = {r}**:", "", "```", text.strip(), "```", ""]
    return lines


def _time_section(report: dict) -> list[str]:
    settings = report["settings"]
    out = settings.out
    return [
        f"## Time: {_duration(sum(report['stages'].values()))} on {report['machine']}",
        "",
        "| stage | wall time |",
        "|---|---|",
        *(f"| {title} | {_duration(seconds)} |" for title, seconds in report["stages"].items()),
        "",
        "## Reproduce",
        "",
        "```bash",
        f"recurfit demo --steps {settings.steps} --muon-lr {_rate(settings.muon_lr)} --lr {_rate(settings.lr)} "
        f"--out {out}",
        f"recurfit eval loss {out}/recurrent/final --data {out}/data/math --baseline {out}/parent/final "
        f"--recurrence {','.join(map(str, settings.loss_recurrences))}",
        f"recurfit eval tasks {out}/recurrent/final --tasks gsm8k_cot --limit {settings.gsm8k} --baseline "
        f"{out}/parent/final",
        "```",
        "",
    ]
