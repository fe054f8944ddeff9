"""The token store `data prepare` writes: packed rows of `seq_len + 1` token ids, memory-mapped.

    DATA/meta.json                 seq_len, dtype, rows per split, tokenizer (name and vocabulary hash), packing,
                                   sources, fingerprint,
                                   and each shard's documents, token counts and SHA-256 checksums
    DATA/shards/00000.train.bin    the tokens of the shard's training documents, one after another
    DATA/shards/00000.val.bin      its held-out documents, the same way
    DATA/shards/00000.train.mask   with instruction data: one byte per token of the .bin beside it, 1 where
    DATA/shards/00000.val.mask     the token is the assistant's (meta.json's `loss_mask` is then `assistant`)
    ...

A split is the concatenation of its shard files in order, cut into rows of `seq_len + 1` tokens (the tail
shorter than a row is not used), so a row may begin in one shard and end in the next, and a sharded store
reads exactly as one made in one piece. A row holds `seq_len + 1` tokens so that inputs `row[:-1]` and targets
`row[1:]` are both `seq_len` long. Each document is followed by EOS (and, with `bos-eos` packing, preceded by
the tokenizer's BOS), as in the paper's pretraining data.

`TokenStore(folder, split, masks=True)` reads a store's masks as rows, as `TokenStore(folder, split)` reads its
tokens: row i of the masks belongs to row i of the tokens. Stores without masks (all stores of plain text, and
every store made before instruction data) load as before.

Stores of format 1 (before shards) hold one `train.bin` and `val.bin` of whole rows; they still load. Stores
that record no vocabulary hash (`tokenizer_vocabulary`) load too; `check_tokenizer` cannot check them, and
training then checks only that their vocabulary is no larger than the model's.
"""

from __future__ import annotations

import hashlib
import json
import operator
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import RecurfitError

META = "meta.json"
SPLITS = ("train", "val")
SHARDS = "shards"
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)


def vocabulary_hash(tokenizer) -> str:
    """A tokenizer's identity: a hash of its vocabulary (each token and its id), the same for every copy of it."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def check_tokenizer(folder: str | Path, meta: dict, tokenizer) -> None:
    """Refuses a store tokenised with another tokenizer than `tokenizer` (the model's): its token ids would mean
    other tokens. A store that records no vocabulary hash (prepared by an earlier version) is not checked."""
    recorded = meta.get("tokenizer_vocabulary")
    if recorded is None or tokenizer is None or recorded == vocabulary_hash(tokenizer):
        return
    model = tokenizer.name_or_path
    raise RecurfitError(
        f"{folder} was tokenised with {meta.get('tokenizer') or 'another tokenizer'}'s tokenizer, not the model's "
        f"({model}): prepare it again with `recurfit data prepare --tokenizer {model}`."
    )


LOSS_MASK = "assistant"  # meta.json's `loss_mask`: what a store's masks mark
MASK_DTYPE = np.uint8


def shard_path(folder: str | Path, name: str, split: str) -> Path:
    return Path(folder) / SHARDS / f"{name}.{split}.bin"


def mask_path(folder: str | Path, name: str, split: str) -> Path:
    return Path(folder) / SHARDS / f"{name}.{split}.mask"


def has_masks(meta: dict) -> bool:
    return meta.get("loss_mask") == LOSS_MASK


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META
    if not path.is_file():
        raise RecurfitError(f"{folder} is not a token store (no {META}); create it with `recurfit data prepare`.")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as problem:
        raise RecurfitError(f"{path} is corrupt ({problem.msg}); prepare the data again with --force.") from None
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
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
    if meta["format"] >= 2:
        checks += (("shards", lambda v: isinstance(v, list) and all(_valid_shard(s) for s in v), "a list of shards"),)
    for key, valid, expected in checks:
        if key not in meta:
            return f"{key!r} is missing"
        if not valid(meta[key]):
            return f"{key!r} must be {expected}, got {meta[key]!r}"
    return None


def _valid_shard(shard) -> bool:
    tokens = shard.get("tokens") if isinstance(shard, dict) else None
    return (
        isinstance(shard.get("name"), str)
        and isinstance(tokens, dict)
        and all(isinstance(tokens.get(split), int) and tokens[split] >= 0 for split in SPLITS)
    )


def split_files(folder: Path, meta: dict, split: str, masks: bool = False) -> list[tuple[Path, int]]:
    """The files of a split (of its masks, with `masks`), in order, each with the number of tokens of it the
    store uses."""
    if meta["format"] == 1:
        return [(folder / f"{split}.bin", meta["rows"][split] * (meta["seq_len"] + 1))]
    path = mask_path if masks else shard_path
    return [(path(folder, shard["name"], split), shard["tokens"][split]) for shard in meta["shards"]]


class TokenStore:
    """One split of a prepared folder: `store[i]` is row i as a numpy array of `seq_len + 1` ids; a slice of
    rows is a 2-D array. With `masks`, the rows of the split's assistant masks (0 or 1 per token) instead."""

    def __init__(self, folder: str | Path, split: str = "train", masks: bool = False):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
        self.folder, self.split = Path(folder), split
        self.meta = read_meta(folder)
        if masks and not has_masks(self.meta):
            raise RecurfitError(
                f"{folder} holds no assistant masks (it was prepared from plain text); prepare it from "
                "conversations (a `messages` field) to mask the loss to the assistant's tokens."
            )
        self.has_masks = has_masks(self.meta)
        self.seq_len: int = self.meta["seq_len"]
        self.num_rows: int = self.meta["rows"][split]
        self.dtype = np.dtype(MASK_DTYPE if masks else self.meta["dtype"])
        self.files = split_files(self.folder, self.meta, split, masks)
        for path, tokens in self.files:
            expected = tokens * self.dtype.itemsize
            actual = path.stat().st_size if path.is_file() else -1
            if actual != expected:
                raise RecurfitError(
                    f"{path} should hold {expected} bytes ({tokens} tokens) but holds {max(actual, 0)}: "
                    "the store is incomplete or damaged; prepare it again with --force."
                )
        if self.num_rows * (self.seq_len + 1) > sum(tokens for _, tokens in self.files):
            raise RecurfitError(f"{self.folder}/{META} counts more {split} rows than its files hold; prepare it again.")

    @cached_property
    def _maps(self) -> list[np.ndarray]:
        return [np.memmap(path, dtype=self.dtype, mode="r", shape=(tokens,)) for path, tokens in self.files if tokens]

    @cached_property
    def _starts(self) -> np.ndarray:
        """The position of each non-empty file's first token in the split's token sequence."""
        return np.cumsum([0] + [len(tokens) for tokens in self._maps])

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split: a view into one file, or a copy across files."""
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            offset = start - int(self._starts[first])
            piece = self._maps[first][offset : offset + stop - start]
            pieces.append(piece)
            start += len(piece)
            first += 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index) -> np.ndarray:
        width = self.seq_len + 1
        if isinstance(index, slice):
            start, stop, step = index.indices(self.num_rows)
            rows = range(start, stop, step)
            if not rows:
                return np.zeros((0, width), dtype=self.dtype)
            if step == 1:
                return self._tokens(start * width, stop * width).reshape(-1, width)
            return np.stack([self[i] for i in rows])
        row = operator.index(index)
        if row < 0:
            row += self.num_rows
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {index} of {self.num_rows}")
        return self._tokens(row * width, (row + 1) * width)

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    def __repr__(self) -> str:
        return f"TokenStore({str(self.folder)!r}, {self.split}: {self.num_rows} rows of {self.seq_len + 1})"
