"""recurfit's generated word problems: the training problems (`embedded:math`) and the held-out ones."""

from __future__ import annotations

import pytest


def test_the_embedded_math_problems_share_no_ngram_with_any_eval_set():
    from recurfit.data import decontaminate as dc
    from recurfit.data.sources import iter_documents

    index = dc.load(dc.parse_sets("all"))
    problems = list(iter_documents("embedded:math:3000", seed=0))
    assert len(set(problems)) > 2900 and not index.masks(problems).any()
    # The check can fail: the source it replaced (GSM8K test questions with the numbers varied) fails it.
    gsm8k = next(dc.EVAL_SETS["gsm8k"]()).replace("16", "17")
    assert index.masks([gsm8k]).any()


def test_held_out_problems_equal_no_training_problem_are_worked_right_and_share_no_ngram_with_any_eval_set():
    import re

    from recurfit.data import decontaminate as dc
    from recurfit.data.word_problems import held_out_problems, word_problems

    def sentences(steps: str) -> list[str]:
        return re.split(r"(?<=\.) ", steps)

    training = list(word_problems(4000, seed=0))  # the demo's training problems
    held_out = {split: list(held_out_problems(200, split)) for split in ("easy", "hard")}
    questions = {question for question, _, _ in training}
    for problems in held_out.values():
        assert len({question for question, _, _ in problems}) > 190
        assert not questions & {question for question, _, _ in problems}
        for question, steps, answer in problems:
            for left, right in re.findall(r"(\d+(?: [-+*/] \d+)+) = (\d+)", steps.replace("$", "")):
                assert eval(left) == int(right), (question, steps)  # noqa: S307 (digits and operators only)
            assert re.findall(r"\d+", steps)[-1] == answer and int(answer) >= 0
    # The hard split's problems take four steps, more than any training problem.
    assert max(len(sentences(steps)) for _, steps, _ in training) == 3
    assert {len(sentences(steps)) for _, steps, _ in held_out["hard"]} == {4}
    # Every number a held-out problem draws lies above the training range it is drawn from: here, the largest.
    largest = max(int(n) for question, _, _ in training for n in re.findall(r"\d+", question))
    assert max(int(n) for question, _, _ in held_out["easy"] for n in re.findall(r"\d+", question)) > largest
    index = dc.load(dc.parse_sets("all"))
    assert not index.masks([f"{q} {s} {a}" for problems in held_out.values() for q, s, a in problems]).any()
    with pytest.raises(ValueError, match="split must be one of \\['easy', 'hard'\\]"):
        next(held_out_problems(1, "medium"))


def test_read_solution_states_the_answer_and_checks_every_arithmetic_step():
    from recurfit.data.word_problems import Solution, held_out_problems, read_solution, word_problems

    # Every worked solution the templates write, in the training layout, states its answer and is true throughout.
    for question, steps, answer in [*word_problems(300), *held_out_problems(50, "hard")]:
        solution = read_solution(f" {steps}\nThe answer is {answer}.")
        assert solution.stated == answer and solution.steps == solution.steps_right >= 1, (question, steps)
    # A model's answer: a wrong step and a chained one are caught, "The answer is: N" states N, and what follows
    # the stated answer is not part of the solution.
    answer = " 2 * (46 + 32) = 2 * 104 = 208 metres. $208 - $8 = $200.\nThe answer is: $1,200.\n5 + 5 = 10."
    assert read_solution(answer) == Solution("1200", steps=2, steps_right=1)
    # No stated answer; an operation in words is not a step; a decimal is a number, not a sentence's end.
    assert read_solution("The discount is 30% of $340 = $102. 217 / 10 = 21.7 each. 217 / 10 = 21") == Solution(
        None, steps=2, steps_right=1
    )
    # Only arithmetic is evaluated: anything else on a side of "=" makes the step untrue, never runs.
    assert read_solution("2 ** 3 = 8. (1 + 1 = 2") == Solution(None, steps=2, steps_right=0)
    assert read_solution("(" * 5000 + "1" + ")" * 5000 + " + 1 = 2") == Solution(None, steps=1, steps_right=0)
