"""Tests of `recurfit/cli/evaluate.py`."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from recurfit.data.store import TokenStore
from recurfit.evaluate.results import Sweep


@pytest.mark.parametrize("command", [["eval", "loss", "--data", "nowhere"], ["eval", "tasks", "--tasks", "arc_easy"]])
def test_an_existing_out_is_refused_before_the_model_is_loaded(tmp_path, capsys, command):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")
    # the model does not exist: reaching it would be a different error
    code, text = run_cli(capsys, *command[:2], tmp_path / "no-model", *command[2:], "--out", out)
    assert code == 2 and "already exists; pass --force" in text and "no-model" not in text


def test_an_unknown_task_is_refused_before_the_model_is_loaded(tmp_path, capsys):
    code, text = run_cli(
        capsys, "eval", "tasks", tmp_path / "no-model", "--tasks", "arc_easy,gsm8k", "--out", tmp_path / "o"
    )
    # lm-eval's own gsm8k has no bundled data: the closest offline task, or --data hub.
    assert code == 2 and "No offline data for 'gsm8k' (did you mean 'gsm8k_cot'?)" in text and "--data hub" in text
    assert "no-model" not in text


def test_eval_tasks_offline_refuses_a_hub_only_task_before_loading_a_model(tmp_path, capsys):
    code, text = run_cli(capsys, "eval", "tasks", tmp_path / "no-model", "--tasks", "webqs", "--out", tmp_path / "out")
    assert code == 2 and "No offline data for 'webqs': run it with `--data hub`" in text
    assert not (tmp_path / "out").exists()


def test_eval_tasks_backend_vllm_without_vllm_is_refused_naming_the_setup_script(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    argv = ["eval", "tasks", tmp_path / "no-model", "--tasks", "gsm8k_cot", "--backend", "vllm"]
    code, text = run_cli(capsys, *argv, "--out", tmp_path / "out")
    assert code == 2 and not (tmp_path / "out").exists()
    assert "--backend vllm: vLLM is not installed in this environment; run ./scripts/setup-vllm.sh" in text


def test_eval_loss_writes_table_results_and_figures_and_never_overwrites(saved, workspace, tmp_path, capsys):
    out = tmp_path / "loss"
    code, text = run_cli(
        capsys,
        "eval",
        "loss",
        saved / "model",
        "--data",
        workspace / "prose",
        "--recurrence",
        "1,2,4",
        "--baseline",
        saved / "parent",
        "--out",
        out,
    )
    assert code == 0, text
    rows = len(TokenStore(workspace / "prose", "val"))
    plan = f"Loss plan: {rows:,} rows, {rows * 32:,} predicted tokens; r = 1,2,4 in one pass of 4 recurrences: "
    assert plan + f"{rows * 32 * 4:,} tokens × recurrences; the parent ({saved / 'parent'}): one pass" in text
    assert text.index("Loss plan") < text.index("loss at r=1,2,4")  # said before the sweep's progress
    figures = {f"{name}.{suffix}" for name in ("recurrence", "flops") for suffix in ("png", "pdf", "svg")}
    assert {p.name for p in out.iterdir()} == {"results.json", "table.md", *figures}
    sweep = Sweep.load(out / "results.json")
    assert [row.steps for row in sweep.rows] == [1, 2, 4] and sweep.parent is not None
    assert sweep.details["tokens"] == sweep.details["sequences"] * 32
    table = (out / "table.md").read_text()
    assert "| r=4 |" in table and f"| parent ({saved / 'parent'}) |" in table
    before = (out / "results.json").read_text()
    code, text = run_cli(capsys, "eval", "loss", saved / "model", "--data", workspace / "prose", "--out", out)
    assert code == 2 and "--force" in text and (out / "results.json").read_text() == before


def test_eval_loss_of_a_fixed_depth_model_is_one_row_and_bad_data_is_an_error(saved, workspace, tmp_path, capsys):
    argv = ["eval", "loss", saved / "parent", "--data", workspace / "math", "--limit", "3", "--out", tmp_path / "p"]
    code, text = run_cli(capsys, *argv)
    assert code == 0 and "Loss plan: 3 rows, 96 predicted tokens; one pass (a fixed-depth model)." in text
    sweep = Sweep.load(tmp_path / "p" / "results.json")
    assert len(sweep.rows) == 1 and sweep.rows[0].steps is None
    code, text = run_cli(
        capsys, "eval", "loss", saved / "model", "--data", tmp_path / "nothing.jsonl", "--out", tmp_path / "x"
    )
    assert code == 2 and "nothing.jsonl" in text and not (tmp_path / "x").exists()


def test_eval_tasks_table_has_a_row_per_r_the_parent_and_chance(saved, tmp_path, capsys):
    out = tmp_path / "tasks"
    code, text = run_cli(
        capsys,
        "eval",
        "tasks",
        saved / "model",
        "--tasks",
        "arc_challenge,gsm8k_cot",
        "--recurrence",
        "1,2",
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
        "--baseline",
        saved / "parent",
        "--out",
        out,
    )
    assert code == 0, text
    sweep = Sweep.load(out / "results.json")
    assert sweep.metrics == [
        "arc_challenge (acc_norm)",
        "arc_challenge (acc)",
        "gsm8k_cot (exact_match, flexible-extract)",
        "gsm8k_cot (exact_match, strict-match)",
    ]
    assert sweep.details["headline"] == ["arc_challenge (acc_norm)", "gsm8k_cot (exact_match, flexible-extract)"]
    assert sweep.details["model_args"] == {"add_bos_token": True}
    assert [row.label for row in sweep.rows] == ["r=1", "r=2"]
    assert sweep.chance.metrics["arc_challenge (acc_norm)"] == pytest.approx(0.25)
    assert "Each task's first column is the metric the paper reports" in (out / "table.md").read_text()
    assert set(json.loads((out / "lm_eval.json").read_text())) == {"r=1", "r=2", "parent"}
    code, text = run_cli(capsys, "eval", "tasks", saved / "model", "--tasks", "gsm8k", "--out", tmp_path / "bad")
    assert code == 2 and "did you mean 'gsm8k_cot'" in text and not (tmp_path / "bad").exists()


def test_lens_writes_its_figure_and_prints_its_table_and_never_overwrites(saved, tmp_path, capsys):
    out = tmp_path / "lens.png"
    argv = ["lens", saved / "model", "--prompt", "the cat", "-r", "3", "--max-new-tokens", "2", "--out", out]
    code, text = run_cli(capsys, *argv, "--exit", "kl:1e-3,argmax:2")
    assert code == 0, text
    assert out.read_bytes().startswith(b"\x89PNG") and sorted(tmp_path.iterdir()) == [out]  # no staging file left
    assert "| # | token | top at r = 3 | p | KL at r | kl:1e-3 | argmax:2 |" in text
    assert "| 7 | `t` |" in text  # the prompt's 7 characters, then the continuation
    assert f"Wrote {out}." in text
    code, text = run_cli(capsys, *argv)
    assert code == 2 and f"error: {out} already exists; pass --force" in text


@pytest.mark.parametrize(
    "options, message",
    [
        (["--exit", "entropy:3"], "--exit takes CRITERION[:VALUE] with CRITERION one of kl, state, argmax"),
        (["--exit", "kl:often"], "--exit 'kl:often': 'often' is not a number."),
        (["-r", "0"], "--recurrence must be between 1 and 1024, got 0."),
        (["--out", "{tmp}/lens.jpg"], "must name a .png, .svg or .pdf file"),
    ],
)
def test_lens_refuses_bad_settings_in_one_line_before_the_model_loads(tmp_path, capsys, options, message):
    options = [option.format(tmp=tmp_path) for option in options]
    out = ["--out", tmp_path / "lens.png"] if "--out" not in options else []
    code, text = run_cli(capsys, "lens", tmp_path / "no-model", "--prompt", "x", *out, *options)
    assert code == 2 and message in text and text.count("error:") == 1 and "no-model" not in text
    assert list(tmp_path.iterdir()) == []
