"""Tests of `recurfit/evaluate/suite.py`."""

from __future__ import annotations

import pytest

from recurfit.errors import RecurfitError
from recurfit.evaluate.suite import (
    PAPER_SUITE,
    RunSettings,
    check_tasks,
    offline_tasks,
    plan_runs,
    resolve_tasks,
    task_columns,
    task_label,
    task_manager,
)


def test_offline_task_names_are_accepted_with_or_without_the_suffix():
    assert (
        check_tasks(["arc_easy_offline", "mmlu_anatomy"])
        == check_tasks(["arc_easy", "mmlu_anatomy_offline"])
        == ["arc_easy_offline", "mmlu_anatomy_offline"]
    )


def test_lm_eval_records_the_git_commit_without_printing_git_errors(tmp_path, monkeypatch, capfd):
    from lm_eval import evaluator

    from recurfit.evaluate.suite import quiet_git_hash

    monkeypatch.chdir(tmp_path)  # not a git repository
    evaluator.get_git_commit_hash()
    assert "not a git repository" in capfd.readouterr().err  # lm-eval's own call is noisy here
    with quiet_git_hash():
        assert evaluator.get_git_commit_hash() is None
    assert "fatal" not in capfd.readouterr().err


def test_offline_task_names_resolve_and_unknown_ones_fail_with_a_suggestion():
    manager = task_manager("offline")
    assert {"arc_challenge", "gsm8k_cot", "minerva_math", "mmlu"} <= set(offline_tasks())
    assert resolve_tasks(["arc_challenge", "gsm8k_cot"], "offline", manager) == [
        "arc_challenge_offline",
        "gsm8k_cot_offline",
    ]
    assert resolve_tasks(["mmlu_anatomy", "minerva_math_algebra"], "offline", manager) == [
        "mmlu_anatomy_offline",
        "minerva_math_algebra_offline",
    ]
    assert len(resolve_tasks(["paper"], "offline", manager)) == 9
    with pytest.raises(RecurfitError, match="did you mean 'arc_challenge'"):
        resolve_tasks(["arc_challenge", "arc_chalenge"], "offline", manager)


def test_hub_names_are_lm_evals_but_gsm8k_cot_is_the_authors_variant_and_runs_get_the_papers_settings():
    manager = task_manager("hub")  # indexes task files only: nothing is downloaded
    names = resolve_tasks(["paper"], "hub", manager)
    assert names == [*PAPER_SUITE[:7], "gsm8k_cot_sean", "minerva_math"]
    assert [task_label(name) for name in names] == list(PAPER_SUITE)
    for _data, tasks in (("hub", names), ("offline", resolve_tasks(["paper"], "offline", task_manager("offline")))):
        runs = plan_runs(tasks)
        assert runs == {RunSettings(num_fewshot=0): tasks[:7], RunSettings(num_fewshot=1, max_length=1024): tasks[7:]}
    assert plan_runs(["boolq"]) == {RunSettings(): ["boolq"]}  # not the paper's: lm-eval's defaults
    with pytest.raises(RecurfitError, match="lm_eval ls tasks"):
        resolve_tasks(["no_such_task"], "hub", manager)


def test_the_papers_other_tasks_resolve_offline_or_through_the_hub():
    """LAMBADA and Social IQa have offline data; WebQuestions and ASDiv run only as lm-eval's own (Hub) tasks, and
    asking for them offline says so. `paper-shapes` is the appendix figure's suite, zero-shot like the authors ran."""
    offline, hub = task_manager("offline"), task_manager("hub")
    assert resolve_tasks(["lambada_openai", "social_iqa_offline"], "offline", offline) == [
        "lambada_openai_offline",
        "social_iqa_offline",
    ]
    others = ["lambada_openai", "social_iqa", "webqs", "asdiv"]
    assert resolve_tasks(others, "hub", hub) == others
    for name in ("webqs", "asdiv"):
        with pytest.raises(RecurfitError, match=f"No offline data for '{name}': run it with `--data hub`.*network"):
            resolve_tasks(["arc_easy", name], "offline", offline)
    shapes = resolve_tasks(["paper-shapes"], "offline", offline)
    assert [task_label(name) for name in shapes] == [*PAPER_SUITE[:7], "social_iqa", "lambada_openai"]
    assert plan_runs(shapes) == {RunSettings(num_fewshot=0): shapes}
    assert plan_runs(["asdiv", "webqs"]) == {RunSettings(num_fewshot=0): ["asdiv"], RunSettings(): ["webqs"]}
    assert task_columns("lambada_openai_offline", {"perplexity,none": 3.0, "acc,none": 0.5}) == {
        "lambada_openai (acc)": 0.5
    }
    assert list(task_columns("webqs", {"exact_match,none": 0.1})) == ["webqs (exact_match)"]


def test_table_columns_put_the_papers_metric_first_and_keep_the_others():
    results = {"acc,none": 0.5, "acc_stderr,none": "N/A", "acc_norm,none": 0.25, "alias": "x"}
    assert task_columns("arc_easy_offline", results) == {"arc_easy (acc_norm)": 0.25, "arc_easy (acc)": 0.5}
    assert list(task_columns("winogrande_offline", {"acc,none": 0.5})) == ["winogrande (acc)"]
    gsm8k = {"exact_match,strict-match": 0.1, "exact_match,flexible-extract": 0.2}
    assert task_columns("gsm8k_cot_sean", gsm8k) == {
        "gsm8k_cot (exact_match, flexible-extract)": 0.2,
        "gsm8k_cot (exact_match, strict-match)": 0.1,
    }
    math = {"exact_match,none": 0.1, "math_verify,none": 0.2}  # lm-eval's own minerva_math (--data hub)
    assert list(task_columns("minerva_math", math)) == ["minerva_math (math_verify)", "minerva_math (exact_match)"]
    with pytest.raises(RecurfitError, match="No known metric"):
        task_columns("lambada_openai", {"perplexity,none": 3.0})
