"""How much `embedded:math` shares with the GSM8K and MATH test sets (docs/results/README.md, the errata note).

    .venv/bin/python scripts/math_overlap.py [--problems 2000]

Two checks over the questions of `--problems` generated problems (seed 0):

1. Decontamination: how many whole problems (question and worked answer) share a 13-word n-gram with any test
   or validation item of any evaluation set (`recurfit.data.decontaminate`, as `data prepare` applies it).
2. Word 4-grams: for each question, the largest share of its normalised word 4-grams found in one GSM8K or MATH
   test problem; the distribution, and how many questions share at least 60 % with one.

With reasoning-gym installed, the same for its `gsm_symbolic` generator (the source `embedded:math` used
before), for comparison.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import numpy as np

from recurfit.data import decontaminate as dc
from recurfit.data.sources import request_docs
from recurfit.data.word_problems import word_problems


def four_grams(text: str) -> set[tuple[bytes, ...]]:
    found = dc.words(text)
    return {tuple(found[i : i + 4]) for i in range(len(found) - 3)}


def test_questions() -> list[set]:
    questions = [doc["question"] for doc in request_docs("gsm8k")]
    for subject in dc.MATH_SUBJECTS:
        questions += [doc["problem"] for doc in request_docs(f"minerva_math_{subject}")]
    return [four_grams(question) for question in questions]


def largest_shares(questions: list[str], tests: list[set]) -> np.ndarray:
    where = defaultdict(list)
    for number, grams in enumerate(tests):
        for gram in grams:
            where[gram].append(number)
    shares = []
    for question in questions:
        grams = four_grams(question)
        counts = Counter(number for gram in grams for number in where.get(gram, ()))
        shares.append(max(counts.values(), default=0) / max(len(grams), 1))
    return np.array(shares)


def report(name: str, questions: list[str], documents: list[str], index, tests: list[set]) -> None:
    matched = int(np.count_nonzero(index.masks(documents)))
    shares = largest_shares(questions, tests)
    print(f"{name}: {len(documents):,} problems")
    print(f"  sharing a decontamination n-gram with an eval set: {matched:,}")
    print(
        f"  largest 4-gram share with one GSM8K/MATH test question: median {np.median(shares):.0%}, "
        f"99th percentile {np.percentile(shares, 99):.0%}, max {shares.max():.0%}; "
        f">= 60 %: {np.count_nonzero(shares >= 0.6):,}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=2000)
    args = parser.parse_args()
    index, tests = dc.load(dc.parse_sets("all")), test_questions()
    from recurfit.data.sources import iter_documents

    ours = list(word_problems(args.problems, seed=0))
    documents = list(iter_documents(f"embedded:math:{args.problems}", seed=0))
    report("embedded:math (recurfit's templates)", [q for q, _, _ in ours], documents, index, tests)
    try:
        import reasoning_gym
    except ImportError:
        return
    items = list(reasoning_gym.create_dataset("gsm_symbolic", size=args.problems, seed=0))
    old = [f"{item['question']} {item['metadata'].get('answer_cot', '')}" for item in items]
    report("reasoning-gym gsm_symbolic (the former source)", [item["question"] for item in items], old, index, tests)


if __name__ == "__main__":
    main()
