"""Evaluation across test recurrence: the single-pass sweep, padding, the lm-eval model, offline tasks, CLI."""

import json

from conftest import run_cli


def test_lm_eval_command_line_runs_the_registered_model(saved, tmp_path, capsys):
    out = tmp_path / "lm"
    code, text = run_cli(
        capsys,
        "lm-eval",
        "--model",
        "recurfit",
        "--model_args",
        f"pretrained={saved / 'model'},num_steps=2",
        "--tasks",
        "arc_easy_offline",
        "--limit",
        "2",
        "--output_path",
        out,
    )
    assert code == 0, text
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    assert "arc_easy_offline" in results["results"] and results["config"]["model"] == "recurfit"
