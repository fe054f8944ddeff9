"""`recurfit data prepare`: tokenise documents with the parent's tokenizer and pack them into a token store.

Re-running the same job is a no-op (the store records a fingerprint of its inputs); a different job aimed at
an existing store is refused unless `force`. The store appears atomically: a crash leaves nothing behind.
A row filter (`filters.py`) is checked against every source before anything is written, and what it dropped
and kept is recorded in the store's `meta.json` under `filter`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import RecurfitError
from ..files import staged_directory
from ..progress import progress_bar
from .filters import FilterStats
from .sources import check_filter, fingerprint, iter_documents
from .store import FORMAT_VERSION, META, SPLITS, read_meta

BATCH_DOCUMENTS = 512


@dataclass
class PrepareResult:
    folder: Path
    meta: dict
    skipped: bool  # True: the store already held exactly this job


def prepare(
    tokenizer,
    sources: Sequence[str],
    seq_len: int,
    out: str | Path,
    *,
    tokenizer_name: str = "",
    val_fraction: float = 0.01,
    text_field: str | None = None,
    seed: int = 0,
    force: bool = False,
    show_progress: bool = True,
    row_filter=None,
) -> PrepareResult:
    """Tokenise `sources` (see `sources.py`) and pack them into rows of `seq_len + 1` tokens in `out`.

    A document goes to the validation split when a hash of its text falls in `val_fraction`: the split does
    not depend on document order, and the same document always lands in the same split. `row_filter` (see
    `filters.make_filter`) drops and rewrites rows of every source before tokenising."""
    if seq_len < 1:
        raise RecurfitError(f"--seq-len must be at least 1, got {seq_len}.")
    if not 0 <= val_fraction < 1:
        raise RecurfitError(f"--val-fraction must be in [0, 1), got {val_fraction}.")
    if not sources:
        raise RecurfitError("Give at least one --source.")
    if tokenizer.eos_token_id is None:
        raise RecurfitError("The tokenizer has no EOS token, which separates packed documents.")
    out = Path(out)
    job = {
        "sources": [fingerprint(source, text_field) for source in sources],
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "seq_len": seq_len,
        "val_fraction": val_fraction,
        "seed": seed,
    }
    if row_filter is not None:  # only then, so that unfiltered stores keep their fingerprints
        job["filter"] = row_filter.settings()
    digest = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:20]
    if (out / META).is_file():
        existing = read_meta(out)
        if existing.get("fingerprint") == digest and not force:
            return PrepareResult(out, existing, skipped=True)
    stats = {source: FilterStats() for source in sources} if row_filter is not None else {}
    for source in stats:
        check_filter(source, text_field, row_filter)

    vocab_size = len(tokenizer)
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    with staged_directory(out, replace=force) as staging:
        packers = {split: _Packer(staging / f"{split}.bin", seq_len + 1, dtype) for split in SPLITS}
        documents = 0
        with progress_bar(disable=not show_progress) as bar:
            task = bar.add_task("tokenising", total=None)
            for batch in _batches(_all_documents(sources, text_field, seed, row_filter, stats), BATCH_DOCUMENTS):
                ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
                for text, tokens in zip(batch, ids):
                    packers[_split_of(text, val_fraction)].add(tokens + [tokenizer.eos_token_id])
                documents += len(batch)
                bar.update(task, advance=len(batch), description=f"tokenising ({packers['train'].tokens:,} tokens)")
        tokens = {split: packer.tokens for split, packer in packers.items()}
        rows = {split: packer.close() for split, packer in packers.items()}
        if rows["train"] == 0:
            kept = sum(one.kept for one in stats.values())
            why = f" after the {row_filter.name} filter kept {kept:,} rows" if row_filter is not None else ""
            raise RecurfitError(
                f"The sources hold fewer than seq_len + 1 = {seq_len + 1} tokens of training text{why}; "
                "add data or lower --seq-len."
            )
        if rows["val"] == 0 and val_fraction > 0:
            raise RecurfitError(_no_validation_row(out, val_fraction, documents, tokens, seq_len))
        meta = {
            "format": FORMAT_VERSION,
            "fingerprint": digest,
            "seq_len": seq_len,
            "dtype": np.dtype(dtype).name,
            "rows": rows,
            "tokens": {split: n * (seq_len + 1) for split, n in rows.items()},
            "documents": documents,
            "vocab_size": vocab_size,
            "eos_token_id": tokenizer.eos_token_id,
            "tokenizer": tokenizer_name,
            "sources": list(sources),
            "val_fraction": val_fraction,
            "seed": seed,
        }
        if row_filter is not None:
            meta["filter"] = _filter_report(row_filter, stats)
        (staging / META).write_text(json.dumps(meta, indent=2) + "\n")
    return PrepareResult(out, meta, skipped=False)


def _no_validation_row(out: Path, val_fraction: float, documents: int, tokens: dict, seq_len: int) -> str:
    """Why `out` would have no validation row, and a --val-fraction that would likely give it some."""
    row, total = seq_len + 1, sum(tokens.values())
    wanted = max(3 * row / max(total, 1), 3 / max(documents, 1))  # about three rows' worth, from three documents
    scale = 10 ** math.floor(math.log10(wanted))
    suggestion = min(0.5, math.ceil(wanted / scale) * scale)
    return (
        f"{out}: the held-out share (--val-fraction {val_fraction:g}) of {documents:,} documents holds "
        f"{tokens['val']:,} tokens, less than one validation row of {row}; pass --val-fraction {suggestion:g} or "
        "more, or --val-fraction 0 for a store without validation (which training cannot validate on)."
    )


def _tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def _all_documents(
    sources: Sequence[str], text_field: str | None, seed: int, row_filter=None, stats: dict | None = None
) -> Iterator[str]:
    for source in sources:
        yield from iter_documents(source, text_field, seed, row_filter, (stats or {}).get(source))


def _filter_report(row_filter, stats: dict[str, FilterStats]) -> dict:
    """The filter's settings, its counts over all sources, and the counts of each source."""
    total = FilterStats()
    for one in stats.values():
        total.add(one)
    # The top-level generator_field is the one asked for (None: detected); each source's is the one it used.
    return {**total.as_dict(), **row_filter.settings(), "sources": {src: one.as_dict() for src, one in stats.items()}}


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _split_of(text: str, val_fraction: float) -> str:
    bucket = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64
    return "val" if bucket < val_fraction else "train"


class _Packer:
    """Appends a token stream to a file in whole rows; the tail shorter than a row is dropped at close."""

    def __init__(self, path: Path, row_length: int, dtype):
        self.file = open(path, "wb")
        self.row_length, self.dtype = row_length, dtype
        self.pending: list[int] = []
        self.rows = 0

    @property
    def tokens(self) -> int:
        return self.rows * self.row_length + len(self.pending)

    def add(self, tokens: list[int]) -> None:
        self.pending.extend(tokens)
        whole = len(self.pending) // self.row_length * self.row_length
        if whole:
            np.asarray(self.pending[:whole], dtype=self.dtype).tofile(self.file)
            self.rows += whole // self.row_length
            del self.pending[:whole]

    def close(self) -> int:
        self.file.close()
        return self.rows
