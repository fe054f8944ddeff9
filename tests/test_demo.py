"""The demo pipeline end to end on a tiny parent: every stage runs and the report holds what it promises."""

import json

import numpy as np
import pytest
import yaml

from recurfit.data.decontaminate import EVAL_SETS
from recurfit.data.store import TokenStore
from recurfit.data.word_problems import read_solution
from recurfit.demo.report import _rates
from recurfit.demo.run import run_demo
from recurfit.demo.settings import DemoSettings
from recurfit.errors import RecurfitError
from recurfit.model.loading import load_tokenizer


def test_demo_writes_a_report_with_tables_figures_and_samples(workspace, tmp_path, capsys):
    from rich.console import Console

    settings = DemoSettings(
        out=tmp_path / "demo",
        model=str(workspace / "parent"),
        shape=(2, 2, 2),
        steps=4,
        heal_steps=1,
        seq_len=32,
        mean_recurrence=2,
        backprop_depth=1,
        math_problems=40,
        loss_recurrences=[1, 2, 4],
        loss_rows=2,
        math_eval=3,
        math_recurrences=[1, 2],
        math_new_tokens=6,
        gsm8k=2,
        gsm8k_recurrences=[1, 2],
        max_new_tokens=4,
    )
    pad = load_tokenizer(settings.model).pad_token_id
    console = Console(quiet=True)
    report = run_demo(settings, console).read_text()
    out = tmp_path / "demo"
    headings = [line for line in report.splitlines() if line.startswith("## ")]
    assert [heading.split(" ")[1] for heading in headings] == [
        *("Conclusion", "1.", "2-4.", "5.", "6.", "7.", "Sample", "Time:", "Reproduce")
    ]
    assert "6. Math accuracy on held-out word problems" in headings[4] and "7. GSM8K" in headings[5]
    conclusion = report.split("## 1.")[0]
    claims = ("**English.**", "**Math, easy split.**", "**Math, hard split.**", "**Math, the worked answers.**")
    for claim in (*claims, "**What this run cannot show.**"):
        assert claim in conclusion
    assert "recurfit demo --steps 40 " in conclusion  # the command that scales it up
    # Where the time went, stage by stage, on a named machine (AVX2 CPUs emulate bf16: it matters).
    assert "## Time: " in report and "CPU capability" in report and "Newton–Schulz in" in report
    stages = [line for line in report.splitlines() if line.startswith("| ") and line.endswith(" s |")]
    assert [line.split(".")[0].split(" |")[0] for line in stages] == [*(f"| {n}" for n in range(1, 9)), "| **total**"]
    assert "| r=4 |" in report and "| parent (same tokens) |" in report and "**r = 4**" in report
    figures = {p.name for p in (out / "figures").iterdir()}
    names = ("training", "loss_prose", "loss_math", "math_recurrence", "math_flops", "gsm8k")
    assert figures == {f"{name}.{suffix}" for name in names for suffix in ("png", "pdf", "svg")}
    assert (out / "recurrent" / "final" / "config.json").is_file()
    # Both models train on prose, then on an even mix of prose and math.
    for run in ("recurrent", "parent"):
        phases = yaml.safe_load((out / run / "config.yaml").read_text())["data"]["phases"]
        assert [[source["path"] for source in phase["sources"]] for phase in phases] == [
            [str(out / "data" / "prose")],
            [str(out / "data" / "prose"), str(out / "data" / "math")],
        ]
    # Prose and math loss after healing and at the end, for both models, as their logs have them.
    logs = {run: [json.loads(line) for line in (out / run / "log.jsonl").open()] for run in ("recurrent", "parent")}
    for store in ("prose", "math"):
        for run, label, key in (
            ("recurrent", "retrofit", f"{store}/loss@2"),
            ("parent", "parent (same tokens)", f"{store}/loss"),
        ):
            losses = [record[key] for record in logs[run] if record["kind"] == "eval" and record["step"] in (1, 4)]
            assert f"| {store} | {label} | {losses[0]:.3f} | {losses[1]:.3f} | {losses[1] - losses[0]:+.3f} |" in report
    # The accuracy table counts the problems each model answered right, as the per-problem answers have them.
    problems = [json.loads(line) for line in (out / "word_problems.jsonl").open()]
    assert len(problems) == 3 * 2 * 3  # r = 1, r = 2 and the parent; two splits; three problems each
    for model, label in (("r=1", "retrofit r=1"), ("r=2", "retrofit r=2"), ("parent", "parent (same tokens)")):
        right = [
            sum(p["correct"] for p in problems if p["model"] == model and p["split"] == split)
            for split in ("easy", "hard")
        ]
        math_section = report.split("## 6. ")[1].split("How the answers are worked")[0]  # the accuracy table
        (row,) = [line for line in math_section.splitlines() if line.startswith(f"| {label} |")]
        assert [cell.split(" ")[0] for cell in row.split(" | ")[2:]] == [str(n) for n in right]
    assert all(p["correct"] == (p["extracted"] == p["target"]) for p in problems)
    # How the answers are worked: each record reads its own answer, and the table counts the records.
    assert all(read_solution(p["answer"]) == (p["stated"], p["steps"], p["steps_right"]) for p in problems)
    worked = report.split("How the answers are worked")[1].split("## 7. ")[0]
    for model, label in (("r=1", "retrofit r=1"), ("r=2", "retrofit r=2"), ("parent", "parent (same tokens)")):
        expected = []
        for split in ("easy", "hard"):
            mine = [p for p in problems if p["model"] == model and p["split"] == split]
            finished = sum(p["stated"] is not None for p in mine)
            steps, right = sum(p["steps"] for p in mine), sum(p["steps_right"] for p in mine)
            expected += [f"{finished} of {len(mine)}", f"{right} of {steps}"]
        assert f"| {label} | " + " | ".join(expected) + " |" in worked
    # The parent's progress lines show no recurrence; the retrofit's do.
    lines = capsys.readouterr().err.splitlines()
    progress = [line for line in lines if line.startswith("training: ")]
    assert all("r̄" in line for line in progress[:4]) and not any("r̄" in line for line in progress[4:])
    # The stores hold the documents and one EOS each: no padding left by the parity check's padded batch.
    for store in ("prose", "math"):
        splits = [TokenStore(tmp_path / "demo" / "data" / store, split) for split in ("train", "val")]
        tokens = np.concatenate([split[:].reshape(-1) for split in splits])
        meta = splits[0].meta
        assert 0 < (tokens == meta["eos_token_id"]).sum() <= meta["documents"]
        assert pad not in tokens or pad == meta["eos_token_id"]
        assert meta["decontamination"]["sets"] == sorted(EVAL_SETS)  # the one default: every eval set
    # Both models train at the healing study's rates, and the report says why.
    for run in ("recurrent", "parent"):
        optimizer = yaml.safe_load((tmp_path / "demo" / run / "config.yaml").read_text())["optimizer"]
        assert (optimizer["muon_lr"], optimizer["lr"]) == (settings.muon_lr, settings.lr) == (5e-3, 2.5e-4)
    assert "Muon at 5e-3 (AdamW at 2.5e-4 " in report and "5 times the paper's (Muon 1e-3, AdamW 5e-5)" in report
    with pytest.raises(RecurfitError, match="--force"):
        run_demo(settings, console)


def test_the_report_names_the_rates_and_how_they_relate_to_the_papers(tmp_path):
    assert _rates(DemoSettings(muon_lr=1e-3, lr=5e-5)).endswith(": the paper's rates")
    assert "2 times the paper's" in _rates(DemoSettings(muon_lr=2e-3, lr=1e-4))
    assert "not the paper's" in _rates(DemoSettings(muon_lr=2e-3, lr=5e-5))


def test_options_left_out_are_the_settings_own_and_rates_given_reach_the_settings(monkeypatch):
    from recurfit.cli import main
    from recurfit.demo import run

    seen = []
    monkeypatch.setattr(run, "run_demo", lambda settings, console: seen.append(settings))
    assert main(["demo", "--out", "x"]) in (0, None)
    defaults = DemoSettings()
    assert (seen[0].shape, seen[0].steps, seen[0].muon_lr, seen[0].lr) == (
        defaults.shape,
        defaults.steps,
        defaults.muon_lr,
        defaults.lr,
    )
    assert main(["demo", "--out", "x", "--muon-lr", "1e-3", "--lr", "5e-5"]) in (0, None)
    assert (seen[1].muon_lr, seen[1].lr) == (1e-3, 5e-5)
    with pytest.raises(SystemExit):
        main(["demo", "--muon-lr", "-1"])


def test_the_recipe_run_by_hand_is_the_demos_retrofit_at_its_defaults():
    """recipes/demo.yaml is the packaged recipe, and `recurfit train recipes/demo.yaml` after the demo's data stage
    trains what `recurfit demo` trains: its healing tokens and eval schedule follow the demo's rules."""
    from importlib import resources
    from pathlib import Path

    from recurfit.demo.settings import recipe, training_config, with_shape

    packaged = resources.files("recurfit.demo").joinpath("recipe.yaml").read_text()
    assert (Path(__file__).parent.parent / "recipes" / "demo.yaml").read_text() == packaged
    settings = with_shape(DemoSettings())  # the shape the demo chooses for the embedded parent
    data = {name: settings.out / "data" / name for name in ("prose", "math")}
    assert training_config(settings, data, settings.out / "recurrent", settings.shape) == recipe()


def test_the_report_of_the_embedded_parent_points_to_the_depth_task_run_into_its_folder(tmp_path):
    from recurfit.demo.report import depth_task_pointer

    pointer = depth_task_pointer(DemoSettings(out=tmp_path / "run"))
    assert f"`recurfit demo --depth-task --out {tmp_path / 'run'}`" in pointer
    assert f"{tmp_path / 'run'}/depth-task" in pointer
    # The act runs on the embedded parent only (its core is where that model's lookups happen).
    assert depth_task_pointer(DemoSettings(out=tmp_path / "run", model="HuggingFaceTB/SmolLM2-360M")) is None


def verdict_report(accuracy: dict[int, float], parent: float, worked: dict[str, tuple], prose: dict) -> dict:
    """A demo's report of the given results: held-out accuracy per r on 100 problems, worked answers per model
    (answers, stated, steps written, steps true), and prose validation losses per run and step."""
    from recurfit.demo.settings import MATH_TASKS
    from recurfit.evaluate.results import Row, Sweep

    metric = f"{MATH_TASKS['easy']} (exact_match, flexible-extract)"
    rows = [Row(f"r={r}", {metric: value}, steps=r) for r, value in accuracy.items()]
    problems = [
        {"model": model, "split": "easy", "stated": 1 if i < stated else None, "steps": 1, "steps_right": int(i < true)}
        for model, (answers, stated, _, true) in worked.items()
        for i in range(answers)
    ]
    settings = DemoSettings(math_eval=100, heal_steps=1, steps=4, mean_recurrence=2)
    validation = {run: {step: {f"prose/loss{'@2' if run == 'recurrent' else ''}": v} for step, v in losses.items()}
                  for run, losses in prose.items()}  # fmt: skip
    return {
        "settings": settings,
        "math": Sweep("tasks", "m", [metric], rows, parent=Row("parent", {metric: parent})),
        "math_problems": problems,
        "validation": validation,
    }


@pytest.mark.parametrize(
    "accuracy, verdict",
    [
        ({1: 0.10, 2: 0.40}, "More recurrence answers more: r = 2 gets 30 more right"),
        ({1: 0.40, 2: 0.10}, "More recurrence does not answer more of them here"),
        ({1: 0.10, 2: 0.12}, "r = 2 gets 2 more right than r = 1, within twice the standard error"),
    ],
)
def test_the_math_verdict_follows_the_accuracies(accuracy, verdict):
    from recurfit.demo.report import _math_trend

    report = verdict_report(accuracy, 0.2, {}, {})
    assert verdict in _math_trend(report, "easy")


@pytest.mark.parametrize(
    "deep, verdict",
    [
        ((10, 8, 10, 9), "More recurrence finishes more answers and gets more of their arithmetic right"),
        ((10, 8, 10, 2), "More recurrence finishes more answers, but gets no more of their arithmetic right"),
        ((10, 2, 10, 9), "More recurrence gets more of the arithmetic right without finishing more answers"),
        ((10, 2, 10, 2), "More recurrence neither finishes more answers nor gets more of their arithmetic right"),
    ],
)
def test_the_worked_answers_verdict_compares_the_deeper_r_with_r_1(deep, verdict):
    from recurfit.demo.report import _worked_trend

    worked = {"r=1": (10, 4, 10, 5), "r=2": deep, "parent": (10, 5, 10, 5)}
    assert verdict in _worked_trend(verdict_report({1: 0.1, 2: 0.1}, 0.1, worked, {}))


@pytest.mark.parametrize(
    "retrofit, parent, verdict, standing",
    [
        (
            {1: 2.0, 4: 1.9},
            {1: 2.0, 4: 1.5},
            "English is kept",
            "the parent, which lost no layers, ends 0.400 nats ahead",
        ),
        ({1: 2.0, 4: 2.3}, {1: 2.0, 4: 2.4}, "English is partly forgotten", "the retrofit ends 0.100 nats ahead"),
    ],
)
def test_the_english_verdict_follows_the_prose_losses(retrofit, parent, verdict, standing):
    from recurfit.demo.report import _english

    text = _english(verdict_report({1: 0.1}, 0.1, {}, {"recurrent": retrofit, "parent": parent}))
    assert verdict in text and standing in text
