"""The shards of a store being built: the unit of work, of resume and of splitting a job over machines.

The documents of all sources, in order, are cut into shards of `shard_documents` documents (the last one
shorter), and each shard into blocks of `block_documents` (what a worker process tokenises at a time). Shard j
holds documents [j·D, (j+1)·D): which documents a shard holds depends only on the job, never on how many
workers or machines made it, so the store is the same however it is made.

A store is built in a folder beside it, `.NAME.building-FINGERPRINT/`:

    shards/00003.train.bin.partial   a shard being written (redone if its writer died)
    shards/00003.train.bin           a finished shard's files (with instruction data, its .mask files too) ...
    shards/00003.json                ... and its record, written last: documents, tokens and SHA-256 of each
                                     split (and of each mask), and per block (documents, train tokens, val
                                     tokens)
    end.json                         written by a task that read the sources to their end: the document count

Whoever finds every needed shard recorded (`plan`) writes `meta.json` and renames the folder to the store.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..defaults import BLOCK_DOCUMENTS, SHARD_DOCUMENTS
from .store import MASK_DTYPE, SHARDS, SPLITS, mask_path, shard_path

END = "end.json"
CHUNK = 1 << 24  # bytes read at a time when checking a checksum


@dataclass(frozen=True)
class Layout:
    shard_documents: int = SHARD_DOCUMENTS
    block_documents: int = BLOCK_DOCUMENTS

    def shard_of(self, document: int) -> int:
        return document // self.shard_documents

    def ends_block(self, documents_read: int) -> bool:
        """True when the document just read (the `documents_read`-th) is the last of its block."""
        return documents_read % self.shard_documents % self.block_documents == 0


def record_path(folder: Path, index: int) -> Path:
    return folder / SHARDS / f"{shard_name(index)}.json"


def shard_name(index: int) -> str:
    return f"{index:05d}"


# ---------------------------------------------------------------- filter counts per block


def counts_minus(now: dict, before: dict) -> dict:
    """What a filter counted between two snapshots of its per-source `FilterStats.as_dict()`."""
    return {source: _subtract(stats, before.get(source, {})) for source, stats in now.items()}


def counts_plus(total: dict, more: dict) -> dict:
    out = dict(total)
    for source, stats in more.items():
        out[source] = _add(out.get(source, {}), stats)
    return out


def _subtract(now: dict, before: dict) -> dict:
    out = {}
    for key, value in now.items():
        if isinstance(value, dict):
            out[key] = {k: v - before.get(key, {}).get(k, 0) for k, v in value.items()}
            out[key] = {k: v for k, v in out[key].items() if v}
        elif isinstance(value, int):
            out[key] = value - before.get(key, 0)
        else:
            out[key] = value
    return out


def _add(total: dict, more: dict) -> dict:
    out = dict(total)
    for key, value in more.items():
        if isinstance(value, dict):
            merged = dict(out.get(key, {}))
            for k, v in value.items():
                merged[k] = merged.get(k, 0) + v
            out[key] = dict(sorted(merged.items(), key=lambda item: (-item[1], item[0])))
        elif isinstance(value, int):
            out[key] = out.get(key, 0) + value
        else:
            out[key] = out.get(key) or value
    return out


# ---------------------------------------------------------------- writing and checking shards


class ShardWriter:
    """Appends blocks to one shard's files, hashing as it writes; `finish` publishes the files and the record."""

    def __init__(self, folder: Path, index: int, masks: bool = False):
        self.folder, self.index = folder, index
        (folder / SHARDS).mkdir(exist_ok=True)  # not parents: a build folder another task published is gone
        self.paths = {split: shard_path(folder, shard_name(index), split) for split in SPLITS}
        if masks:  # keyed (split, "mask") beside the tokens' split keys
            self.paths.update({(split, "mask"): mask_path(folder, shard_name(index), split) for split in SPLITS})
        self.files = {key: open(f"{path}.partial", "wb") for key, path in self.paths.items()}
        self.hashes = {key: hashlib.sha256() for key in self.paths}
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.blocks: list[list[int]] = []
        self.block_filter: list[dict] = []  # what the row filter counted in each block (none without a filter)
        self.block_dropped: list[dict] = []  # what decontamination dropped in each block (none without it)

    def add(
        self, documents: int, train: np.ndarray, val: np.ndarray, filter_counts: dict, dropped=None, masks=None
    ) -> None:
        for split, ids in zip(SPLITS, (train, val)):
            self._write(split, ids)
            self.tokens[split] += len(ids)
        for split, mask in zip(SPLITS, masks or ()):
            self._write((split, "mask"), mask.astype(MASK_DTYPE, copy=False))
        self.blocks.append([documents, len(train), len(val)])
        if filter_counts:
            self.block_filter.append(filter_counts)
        if dropped is not None:
            self.block_dropped.append(dropped)

    def _write(self, key, values: np.ndarray) -> None:
        data = values.tobytes()
        self.files[key].write(data)
        self.hashes[key].update(data)

    def finish(self) -> dict:
        for key, file in self.files.items():
            file.flush()
            os.fsync(file.fileno())
            file.close()
            os.replace(f"{self.paths[key]}.partial", self.paths[key])
        record = {
            "name": shard_name(self.index),
            "index": self.index,
            "documents": sum(block[0] for block in self.blocks),
            "tokens": dict(self.tokens),
            "sha256": {split: self.hashes[split].hexdigest() for split in SPLITS},
            "blocks": self.blocks,
            "block_filter": self.block_filter,
            "block_dropped": self.block_dropped,
        }
        if (SPLITS[0], "mask") in self.hashes:
            record["mask_sha256"] = {split: self.hashes[split, "mask"].hexdigest() for split in SPLITS}
        write_json(record_path(self.folder, self.index), record)
        return record

    def abandon(self) -> None:
        for file in self.files.values():
            file.close()


def write_json(path: Path, value) -> None:
    """Write whole or not at all: a temporary file, synced, renamed over `path`."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as file:
        file.write(json.dumps(value, indent=1) + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def file_sha256(path: Path, size: int | None = None) -> str:
    """SHA-256 of the file's first `size` bytes (all of it by default)."""
    digest, left = hashlib.sha256(), size if size is not None else path.stat().st_size
    with open(path, "rb") as file:
        while left > 0:
            chunk = file.read(min(CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def read_records(folder: Path, verify: bool, itemsize: int) -> dict[int, dict]:
    """The shards recorded in `folder`. With `verify`, a shard whose files do not match its record's sizes and
    checksums is deleted, to be made again."""
    records = {}
    for path in sorted((folder / SHARDS).glob("*.json")) if (folder / SHARDS).is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # torn by a crash: the shard is redone
        if verify and not _intact(folder, record, itemsize):
            _delete_shard(folder, record["index"])
            continue
        records[record["index"]] = record
    return records


def _intact(folder: Path, record: dict, itemsize: int) -> bool:
    for path, size, sha in _files(folder, record, itemsize):
        if not path.is_file() or path.stat().st_size != size or file_sha256(path) != sha:
            return False
    return True


def _files(folder: Path, record: dict, itemsize: int) -> list[tuple[Path, int, str]]:
    """A shard's files, each with its size in bytes and SHA-256 as its record says: tokens, and masks if any."""
    files = [
        (shard_path(folder, record["name"], s), record["tokens"][s] * itemsize, record["sha256"][s]) for s in SPLITS
    ]
    mask_size = np.dtype(MASK_DTYPE).itemsize
    for split, sha in record.get("mask_sha256", {}).items():
        files.append((mask_path(folder, record["name"], split), record["tokens"][split] * mask_size, sha))
    return files


def _delete_shard(folder: Path, index: int) -> None:
    for path in (folder / SHARDS).glob(f"{shard_name(index)}.*"):
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------- the store the records make


@dataclass
class Plan:
    """Which shards make the store (the last one cut after `last_blocks` blocks), or what is still missing."""

    shards: list[dict] = field(default_factory=list)
    last_blocks: int | None = None  # blocks of the last shard used; None: all of them
    missing: list[int] = field(default_factory=list)  # shard indices not yet made
    budget_reached: bool = False

    @property
    def ready(self) -> bool:
        return not self.missing


def plan(records: dict[int, dict], documents: int | None, budget: int | None, layout: Layout) -> Plan:
    """The shards, in order, that hold the first `budget` training tokens (at a block's end), or all of the
    sources' `documents` (None: the end is not known yet)."""
    result, train = Plan(), 0
    index = 0
    while True:
        if documents is not None and index * layout.shard_documents >= documents:
            return result  # the sources ran dry
        record = records.get(index)
        if record is None:
            known = max(records, default=-1)
            result.missing = [i for i in range(index, known + 2) if i not in records]
            return result
        for used, block in enumerate(record["blocks"], 1):
            train += block[1]
            if budget is not None and train >= budget:
                result.shards.append(record)
                result.last_blocks = used if used < len(record["blocks"]) else None
                result.budget_reached = True
                return result
        result.shards.append(record)
        if record["documents"] < layout.shard_documents:
            return result  # a short shard is the last of the sources
        index += 1


def cut(folder: Path, record: dict, blocks: int, itemsize: int) -> dict:
    """The record of `record`'s shard truncated to its first `blocks` blocks; the files are truncated too."""
    kept = record["blocks"][:blocks]
    tokens = {"train": sum(b[1] for b in kept), "val": sum(b[2] for b in kept)}
    sha, mask_sha = {}, {}
    for split in SPLITS:
        path = shard_path(folder, record["name"], split)
        os.truncate(path, tokens[split] * itemsize)
        sha[split] = file_sha256(path)
        if "mask_sha256" in record:
            path = mask_path(folder, record["name"], split)
            os.truncate(path, tokens[split] * np.dtype(MASK_DTYPE).itemsize)
            mask_sha[split] = file_sha256(path)
    new = {
        **record,
        "documents": sum(b[0] for b in kept),
        "tokens": tokens,
        "sha256": sha,
        **({"mask_sha256": mask_sha} if mask_sha else {}),
        "blocks": kept,
        "block_filter": record["block_filter"][:blocks],
        "block_dropped": record.get("block_dropped", [])[:blocks],  # absent from shards made before decontamination
    }
    write_json(record_path(folder, record["index"]), new)
    return new


def filter_counts(records: Iterable[dict]) -> dict:
    """Per source, what the row filter counted over the blocks of `records`."""
    total: dict = {}
    for record in records:
        for counts in record["block_filter"]:
            total = counts_plus(total, counts)
    return total


def dropped_counts(records: Iterable[dict]) -> dict | None:
    """What decontamination dropped over the blocks of `records` (None without decontamination)."""
    from .decontaminate import add_counts

    total = None
    for record in records:
        for counts in record.get("block_dropped", []):
            total = add_counts(total, counts)
    return total


def remove_unused(folder: Path, used: Iterable[dict]) -> None:
    """Delete every shard file, record and partial file that the store does not use."""
    names = {record["name"] for record in used}
    for path in (folder / SHARDS).iterdir():
        if path.name.split(".")[0] not in names or path.name.endswith((".partial", ".json")):
            path.unlink(missing_ok=True)  # another task may be renaming its partial file at this moment
    (folder / END).unlink(missing_ok=True)
