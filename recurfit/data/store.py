"""The token store `data prepare` writes: packed rows of `seq_len + 1` token ids, memory-mapped.

    DATA/meta.json    seq_len, dtype, rows per split, tokenizer, vocab size, eos id, sources, fingerprint
    DATA/train.bin    rows × (seq_len + 1) ids, row-major
    DATA/val.bin      the held-out documents, packed the same way

A row holds `seq_len + 1` tokens so that inputs `row[:-1]` and targets `row[1:]` are both `seq_len` long.
Documents are concatenated with EOS between them, as in the paper's pretraining data.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import RecurfitError

META = "meta.json"
SPLITS = ("train", "val")
FORMAT_VERSION = 1


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META
    if not path.is_file():
        raise RecurfitError(f"{folder} is not a token store (no {META}); create it with `recurfit data prepare`.")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as problem:
        raise RecurfitError(f"{path} is corrupt ({problem.msg}); prepare the data again with --force.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise RecurfitError(f"{folder} was written by another recurfit version; prepare it again with --force.")
    problem = _meta_problem(meta)
    if problem:
        raise RecurfitError(f"{path}: {problem}; prepare the store again with --force (meta.json is not for editing).")
    return meta


def _meta_problem(meta: dict) -> str | None:
    """The first key of meta.json that is missing or of the wrong kind, as a phrase; None if all are right."""

    def whole(value, least):
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    checks = (
        ("seq_len", lambda v: whole(v, 1), "a whole number >= 1"),
        ("dtype", lambda v: v in ("uint16", "uint32"), "'uint16' or 'uint32'"),
        (
            "rows",
            lambda v: isinstance(v, dict) and all(whole(v.get(split), 0) for split in SPLITS),
            "a mapping of train and val to row counts",
        ),
        ("vocab_size", lambda v: whole(v, 1), "a whole number >= 1"),
    )
    for key, valid, expected in checks:
        if key not in meta:
            return f"{key!r} is missing"
        if not valid(meta[key]):
            return f"{key!r} must be {expected}, got {meta[key]!r}"
    return None


class TokenStore:
    """One split of a prepared folder: `store[i]` is row i as a numpy array of `seq_len + 1` ids."""

    def __init__(self, folder: str | Path, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
        self.folder, self.split = Path(folder), split
        self.meta = read_meta(folder)
        self.seq_len: int = self.meta["seq_len"]
        self.num_rows: int = self.meta["rows"][split]
        path = self.folder / f"{split}.bin"
        expected = self.num_rows * (self.seq_len + 1) * np.dtype(self.meta["dtype"]).itemsize
        actual = path.stat().st_size if path.is_file() else -1
        if actual != expected:
            raise RecurfitError(
                f"{path} should hold {expected} bytes ({self.num_rows} rows) but holds {max(actual, 0)}: "
                "the store is incomplete or damaged; prepare it again with --force."
            )

    @cached_property
    def rows(self) -> np.ndarray:
        if self.num_rows == 0:
            return np.zeros((0, self.seq_len + 1), dtype=self.meta["dtype"])
        path = self.folder / f"{self.split}.bin"
        return np.memmap(path, dtype=self.meta["dtype"], mode="r", shape=(self.num_rows, self.seq_len + 1))

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index) -> np.ndarray:
        return self.rows[index]

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    def __repr__(self) -> str:
        return f"TokenStore({str(self.folder)!r}, {self.split}: {self.num_rows} rows of {self.seq_len + 1})"
