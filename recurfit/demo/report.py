"""The demo's report (OUT/report.md): a conclusion in plain words, then the retrofit, training (prose loss after
healing and at the end), each evaluation, samples, where the time went, and the commands that reproduce it."""

from __future__ import annotations

import math

from ..train.config import OptimizerConfig
from .settings import DEPTH_TASK_FOLDER, DEPTH_TASK_TIME, MATH_TASKS, QUESTION, DemoSettings


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


def render_report(report: dict) -> str:
    """report.md: the retrofit, training, each evaluation, samples, where the time went, and how to reproduce."""
    parent = report["settings"].model or "the embedded SmolLM2-135M-Instruct"
    header = ["# recurfit demo", "", f"Parent: {parent} ({report['parent_layers']} layers).", ""]
    sections = (
        _conclusion_section,
        _retrofit_section,
        _training_section,
        _loss_section,
        _math_section,
        _gsm8k_section,
        _samples_section,
        _time_section,
    )
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
        "thousands of steps; in a run of tens of steps, larger steps heal far more of the retrofit "
        "(docs/results/healing.md)"
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
        f"steps of healing on English prose, then an even mix of prose and generated word problems (recurfit's own "
        f"templates, decontaminated against every evaluation set): the paper's two-phase training, which heals the "
        f"retrofit before the new task and keeps prose in the mix so that English is not traded for math. Retrofit: "
        f"mean recurrence ramped to "
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
        *_healing_table(report),
    ]


def _healing_table(report: dict) -> list[str]:
    """Validation loss at the healing's end and at the end of training, per store and model: forgetting shows."""
    settings = report["settings"]
    healed, end = settings.heal_steps, settings.steps
    lines = [
        f"Validation loss after healing (step {healed}) and at the end (step {end}), on the validation rows the "
        f"loss sweep below reads; the retrofit at r = {settings.mean_recurrence}:",
        "",
        "| store | model | after healing | at the end | change |",
        "|---|---|---|---|---|",
    ]
    for store in ("prose", "math"):
        for name, label in (("recurrent", "retrofit"), ("parent", "parent (same tokens)")):
            before, after = (validation_loss(report, name, store, step) for step in (healed, end))
            lines.append(f"| {store} | {label} | {before:.3f} | {after:.3f} | {after - before:+.3f} |")
    return [*lines, ""]


def validation_loss(report: dict, run: str, store: str, step: int) -> float:
    """A store's validation loss at `step` from a run's log: the retrofit at its mean recurrence, the parent as is."""
    suffix = f"@{report['settings'].mean_recurrence}" if run == "recurrent" else ""
    return report["validation"][run][step][f"{store}/loss{suffix}"]


def _conclusion_section(report: dict) -> list[str]:
    settings = report["settings"]
    return [
        "## Conclusion",
        "",
        f"- **English.** {_english(report)}",
        *(f"- **Math, {split} split.** {_math_trend(report, split)}" for split in MATH_TASKS),
        f"- **Math, the worked answers.** {_worked_trend(report)}",
        f"- **Compute.** {_compute(report)}",
        f"- **What this run cannot show.** {_gsm8k_meaning(report)}",
        *([f"- **Depth on a task made for it.** {where}"] if (where := depth_task_pointer(settings)) else []),
        f"- **Scaling it up.** {_scaling(settings)}",
        "",
    ]


def _english(report: dict) -> str:
    settings = report["settings"]
    healed, end = settings.heal_steps, settings.steps
    before, after = (validation_loss(report, "recurrent", "prose", step) for step in (healed, end))
    parent = [validation_loss(report, "parent", "prose", step) for step in (healed, end)]
    verdict = (
        "kept: the retrofit's prose loss is no worse at the end than after healing"
        if after <= before
        else "partly forgotten: the retrofit's prose loss rises after healing"
    )
    gap = after - parent[1]
    standing = (
        f"the parent, which lost no layers, ends {gap:.3f} nats ahead"
        if gap > 0
        else f"the retrofit ends {-gap:.3f} nats ahead of the parent"
    )
    return (
        f"English is {verdict} ({before:.3f} after {_steps(healed)} of healing, {after:.3f} after {_steps(end)}, at "
        f"r = {settings.mean_recurrence}; the parent trained on the same tokens: {parent[0]:.3f}, then "
        f"{parent[1]:.3f}): {standing}."
    )


def _steps(count: int) -> str:
    return f"{count} step" + ("" if count == 1 else "s")


def _math_trend(report: dict, split: str) -> str:
    """The accuracy at each r against r = 1, judged against the binomial noise of that many problems."""
    sweep, scored = report["math"], report["settings"].math_eval
    accuracy = {row.steps: _accuracy(row, split) for row in sweep.rows}
    counts = " / ".join(str(round(value * scored)) for value in accuracy.values())
    depths = " / ".join(map(str, accuracy))
    first, *deeper = accuracy
    best = max(deeper, key=accuracy.get) if deeper else first
    gain = accuracy[best] - accuracy[first]
    noise = math.sqrt(sum(p * (1 - p) for p in (accuracy[best], accuracy[first])) / scored)
    if gain <= 0:
        verdict = "More recurrence does not answer more of them here"
    elif gain > 2 * noise:
        verdict = (
            f"More recurrence answers more: r = {best} gets {gain * scored:.0f} more right than r = 1, more than "
            "twice the standard error of the difference"
        )
    else:
        verdict = (
            f"r = {best} gets {gain * scored:.0f} more right than r = 1, within twice the standard error of the "
            "difference: a hint, not a result"
        )
    parent = round(_accuracy(sweep.parent, split) * scored)
    return (
        f"{counts} of {scored} held-out problems right at r = {depths}; the parent trained on the same tokens "
        f"{parent}. {verdict}."
    )


def _worked(problems: list[dict], model: str, split: str | None = None) -> tuple[int, int, int, int]:
    """A model's answers (of a split, or of all): how many, how many state an answer, steps written, steps true."""
    mine = [p for p in problems if p["model"] == model and split in (None, p["split"])]
    steps, right = sum(p["steps"] for p in mine), sum(p["steps_right"] for p in mine)
    return len(mine), sum(p["stated"] is not None for p in mine), steps, right


def _true_share(worked: tuple[int, int, int, int]) -> float:
    """The share of the arithmetic steps written that are true."""
    return worked[3] / max(worked[2], 1)


def _worked_trend(report: dict) -> str:
    """Whether deeper recurrence finishes more answers in the training layout, and writes truer arithmetic."""
    depths = [row.steps for row in report["math"].rows]
    worked = {r: _worked(report["math_problems"], f"r={r}") for r in depths}
    parent = _worked(report["math_problems"], "parent")
    first, *deeper = depths
    more_finished = any(worked[r][1] > worked[first][1] for r in deeper)
    truer = any(_true_share(worked[r]) > _true_share(worked[first]) for r in deeper)
    verdict = {
        (True, True): "More recurrence finishes more answers and gets more of their arithmetic right",
        (True, False): "More recurrence finishes more answers, but gets no more of their arithmetic right",
        (False, True): "More recurrence gets more of the arithmetic right without finishing more answers",
        (False, False): "More recurrence neither finishes more answers nor gets more of their arithmetic right",
    }[more_finished, truer]
    finished = " / ".join(str(worked[r][1]) for r in depths)
    true = " / ".join(f"{_true_share(worked[r]):.0%}" for r in depths)
    return (
        f"Of its {worked[first][0]} answers at each r (both splits), the retrofit finishes {finished} with a stated "
        f'answer ("The answer is N.", the training layout\'s last line) at r = {" / ".join(map(str, depths))}, the '
        f"parent {parent[1]}; of the arithmetic steps written, {true} are true, the parent's "
        f"{_true_share(parent):.0%}. {verdict}."
    )


def _compute(report: dict) -> str:
    sweep = report["math"]
    deepest = sweep.rows[-1]
    return (
        f"A token costs {sweep.rows[0].flops_per_token / 1e9:.2f} GFLOPs at r = {sweep.rows[0].steps} and "
        f"{deepest.flops_per_token / 1e9:.2f} at r = {deepest.steps}, against {sweep.parent.flops_per_token / 1e9:.2f} "
        "for the parent (2 × the parameters a token passes through)."
    )


def depth_task_pointer(settings: DemoSettings) -> str | None:
    """The command of the depth task, a task on which this scale can show accuracy rising with r (for the embedded
    parent, the one it runs on); not one of the demo's stages, which it would take past its time budget."""
    if settings.model is not None:
        return None
    return (
        "On k-hop variable lookups, a task whose answers take one lookup per recurrence, accuracy can climb with "
        f"r at this scale: `recurfit demo --depth-task --out {settings.out}` trains a retrofit of the same parent and "
        "the parent on the same examples and adds their accuracy against r per hop count, a table and a figure, to "
        f"{settings.out}/{DEPTH_TASK_FOLDER} ({DEPTH_TASK_TIME})."
    )


def _scaling(settings: DemoSettings) -> str:
    return (
        f"Train longer on more problems, on a GPU: `recurfit demo --steps {settings.steps * 10} --math-problems "
        f"{settings.math_problems * 10} --math-eval 200` (ten times the training); the paper's two-phase runs, "
        "healing on FineWeb-Edu then an even mix with math, are `recurfit train "
        "recipes/paper/tinyllama-484-two-phase-1.yaml`, then `…-two-phase-2.yaml`."
    )


def _loss_section(report: dict) -> list[str]:
    lines = ["## 5. Validation loss against test recurrence", ""]
    for name, sweep in report["loss"].items():
        lines += [
            f"**{name}** ({sweep.details['data']}):",
            "",
            sweep.markdown(),
            f"![{name}](figures/loss_{name}.png)",
            "",
        ]
    return lines


def _math_section(report: dict) -> list[str]:
    settings, sweep = report["settings"], report["math"]
    header = "| model | inference GFLOPs/token | " + " | ".join(
        f"{split} (of {settings.math_eval})" for split in MATH_TASKS
    )
    lines = [
        "## 6. Math accuracy on held-out word problems",
        "",
        f"The first {settings.math_eval} problems of each held-out split, answered greedily (zero-shot, in the "
        "training layout `Question: …\\nAnswer: Let's think step by step.`), scored by exact match of the last "
        "number of the answer. The problems come from recurfit's word-problem templates with another seed and every "
        "number drawn above its training range, so none equals a training problem (like the training problems, "
        "they share no 13-gram with any evaluation set); **easy** uses the training templates, **hard** templates "
        "of four steps, more than any training problem has. Every answer is in `word_problems.jsonl`.",
        "",
        header + " |",
        "|---|---|" + "---|" * len(MATH_TASKS),
    ]
    for row in [*sweep.rows, sweep.parent]:
        cells = [_correct(row, split, settings.math_eval) for split in MATH_TASKS]
        name = f"retrofit {row.label}" if row.steps is not None else row.label
        lines.append(f"| {name} | {row.flops_per_token / 1e9:.2f} | " + " | ".join(cells) + " |")
    return lines + [
        "",
        "![accuracy against test recurrence](figures/math_recurrence.png)",
        "![accuracy against inference FLOPs per token](figures/math_flops.png)",
        "",
        *_worked_table(report),
    ]


def _worked_table(report: dict) -> list[str]:
    """How each model's answers are worked, per split: finished (an answer stated) and arithmetic steps true."""
    problems = report["math_problems"]
    lines = [
        "How the answers are worked, read up to the answer each states: **finished**, answers that state one "
        '("The answer is N.", the last line of the training layout); **steps true**, the arithmetic steps written '
        '("a * b = c", "2 * (4 + 3) = 14") whose sides are equal.',
        "",
        "| model | " + " | ".join(f"{split}: finished | {split}: steps true" for split in MATH_TASKS) + " |",
        "|---|" + "---|---|" * len(MATH_TASKS),
    ]
    models = [(f"r={row.steps}", f"retrofit r={row.steps}") for row in report["math"].rows]
    for model, label in [*models, ("parent", "parent (same tokens)")]:
        cells = []
        for split in MATH_TASKS:
            answers, finished, steps, right = _worked(problems, model, split)
            cells += [f"{finished} of {answers}", f"{right} of {steps}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _gsm8k_section(report: dict) -> list[str]:
    gsm8k = report["gsm8k"]
    return [
        f"## 7. GSM8K (the first {report['settings'].gsm8k} test problems, 1-shot chain of thought, flexible-extract)",
        "",
        gsm8k.markdown(),
        "![GSM8K against test recurrence](figures/gsm8k.png)",
        "",
        _gsm8k_meaning(report),
        "",
    ]


def _gsm8k_meaning(report: dict) -> str:
    """What the GSM8K score says at the demo's scale."""
    solved = _gsm8k_solved(report)
    settings = report["settings"]
    tokens = settings.steps * settings.batch * settings.seq_len
    scored = (
        f"No model here solves any of the {settings.gsm8k} GSM8K problems"
        if max(solved.values()) == 0
        else f"The models solve {min(solved.values())} to {max(solved.values())} of the {settings.gsm8k} GSM8K "
        f"problems, where one problem is {100 / settings.gsm8k:.0f} points: differences this small are noise"
    )
    parameters = report["gsm8k"].parent.effective_parameters / 1e6
    return (
        f"{scored}. GSM8K is the paper's benchmark, kept so that a larger run is measured the same way; at this "
        f"scale it cannot separate the models: models of {parameters:.0f} M parameters, trained for {tokens:,} "
        "tokens on a few templates, are far from solving unseen multi-step problems written in another layout, "
        "and the paper's GSM8K gains come from billions of tokens on models of 1 B parameters and more. The "
        "held-out word problems above are where a run of this size can show an effect."
    )


def _gsm8k_solved(report: dict) -> dict[str, int]:
    """Problems solved per row of the GSM8K sweep (its headline metric times the problems scored)."""
    gsm8k = report["gsm8k"]
    metric = gsm8k.details["headline"][0]
    rows = [*gsm8k.rows, gsm8k.parent]
    return {row.label: round(row.metrics[metric] * report["settings"].gsm8k) for row in rows if row is not None}


def _correct(row, split: str, scored: int) -> str:
    """`k (p %)`: the problems of a split a row answered right, from the sweep's headline metric."""
    accuracy = _accuracy(row, split)
    return f"{round(accuracy * scored)} ({accuracy:.0%})"


def _accuracy(row, split: str) -> float:
    return row.metrics[f"{MATH_TASKS[split]} (exact_match, flexible-extract)"]


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
        "| stage | wall time | CPU time (all threads) |",
        "|---|---|---|",
        *(
            f"| {title} | {duration(seconds)} | {duration(report['cpu'][title])} |"
            for title, seconds in report["stages"].items()
        ),
        f"| **total** | **{duration(sum(report['stages'].values()))}** | {duration(sum(report['cpu'].values()))} |",
        "",
        "On cores that other jobs share both times grow (waiting threads spin), the wall time far more: the "
        "demo's time is that of a run on idle cores.",
        "",
        "## Reproduce",
        "",
        "```bash",
        f"recurfit demo --steps {settings.steps} --muon-lr {_rate(settings.muon_lr)} --lr {_rate(settings.lr)} "
        f"--out {out}",
        f"recurfit eval loss {out}/recurrent/final --data {out}/data/math --baseline {out}/parent/final "
        f"--recurrence {','.join(map(str, settings.loss_recurrences))}",
        f"recurfit eval tasks {out}/recurrent/final --tasks {','.join(MATH_TASKS.values())} --limit "
        f"{settings.math_eval} --recurrence {','.join(map(str, settings.math_recurrences))} --baseline "
        f"{out}/parent/final" + (f" --max-new-tokens {settings.math_new_tokens}" if settings.math_new_tokens else ""),
        f"recurfit eval tasks {out}/recurrent/final --tasks gsm8k_cot --limit {settings.gsm8k} --recurrence "
        f"{','.join(map(str, settings.gsm8k_recurrences))} --baseline {out}/parent/final",
        "```",
        "",
    ]
