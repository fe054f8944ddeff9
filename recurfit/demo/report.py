"""The demo's report (OUT/report.md): the retrofit, training, each evaluation, samples, where the time went,
and the commands that reproduce it."""

from __future__ import annotations

import math

from ..train.config import OptimizerConfig
from .settings import QUESTION, DemoSettings


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


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
        f"## Time: {duration(sum(report['stages'].values()))} on {report['machine']}",
        "",
        "| stage | wall time |",
        "|---|---|",
        *(f"| {title} | {duration(seconds)} |" for title, seconds in report["stages"].items()),
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
