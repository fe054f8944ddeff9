"""The worker pipeline of `data prepare`: the job that defines a store, and how one task makes its shards.

The sources' documents are read in blocks, in order, by this process; blocks of the shards this task makes go
to `workers` processes that decontaminate and tokenise them (`packing.BlockEncoder`), and come back in order to
be written shard by shard (`shards.ShardWriter`), until the sources end or the token budget is reached.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..progress import progress_bar
from . import decontaminate as dc
from . import shards as sh
from .chat import template_hash
from .filters import FilterStats
from .packing import BlockEncoder
from .sources import fingerprint, iter_documents
from .store import FORMAT_VERSION, vocabulary_hash


@dataclass(frozen=True)
class Job:
    """What defines a store's contents; its fingerprint names the build folder and marks the finished store."""

    sources: tuple[str, ...]
    seq_len: int
    val_fraction: float
    text_field: str | None
    seed: int
    packing: str
    max_tokens: int | None
    layout: sh.Layout
    row_filter: object = None
    decontaminate: tuple[str, ...] = ()  # evaluation sets whose n-grams drop documents
    chat: bool = False  # a source holds conversations: rendered with the chat template, assistant masks kept

    def fingerprint(self, tokenizer) -> str:
        job = {
            "sources": [fingerprint(source, self.text_field) for source in self.sources],
            "tokenizer": vocabulary_hash(tokenizer),
            "seq_len": self.seq_len,
            "val_fraction": self.val_fraction,
            "seed": self.seed,
            "packing": self.packing,
            "max_tokens": self.max_tokens,
            "shard_documents": self.layout.shard_documents,
            "block_documents": self.layout.block_documents,
            "format": FORMAT_VERSION,
        }
        if self.row_filter is not None:
            job["filter"] = self.row_filter.settings()
        if self.decontaminate:  # absent when off: stores made before decontamination keep their fingerprint
            job["decontaminate"] = dc.settings(self.decontaminate)
        if self.chat:  # absent for plain text, as before instruction data: the template makes the tokens
            job["chat_template"] = template_hash(tokenizer)
        return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class Block:
    shard: int
    documents: int
    texts: list[str] | None  # None once handed to a worker
    filter_counts: dict


class DocumentBlocks:
    """The sources' documents in blocks; only the blocks of shards `wanted` are yielded (with their texts),
    and reading stops once `stop_before(shard)` says no later shard is needed. `documents` is the count of
    the sources' documents once they have been read to their end (None until then)."""

    def __init__(self, job: Job, wanted: Callable[[int], bool], stop_before: Callable[[int], bool]):
        self.job, self.wanted, self.stop_before = job, wanted, stop_before
        self.documents: int | None = None

    def __iter__(self) -> Iterator[Block]:
        job, layout = self.job, self.job.layout
        stats = {source: FilterStats() for source in job.sources} if job.row_filter is not None else {}
        documents = _all_documents(job.sources, job.text_field, job.seed, job.row_filter, stats)
        counted = previous = _snapshot(stats)
        texts: list[str] = []
        pending: Block | None = None  # the last full block, yielded once another document shows it is not last
        read = 0
        for text in documents:
            if pending is not None:
                yield pending
                pending = None
            shard = layout.shard_of(read)
            if read % layout.shard_documents == 0 and self.stop_before(shard):
                return
            read += 1
            if self.wanted(shard):
                texts.append(text)
            if layout.ends_block(read):
                previous, counted = counted, _snapshot(stats)
                pending = self._block(shard, read, texts, sh.counts_minus(counted, previous))
                texts = []
        self.documents = read
        end = _snapshot(stats)
        if texts:  # a last, short block; the rows the filter read after its last document count with it
            pending = self._block(layout.shard_of(read - 1), read, texts, sh.counts_minus(end, counted))
        elif pending is not None:
            pending.filter_counts = sh.counts_minus(end, previous)
        if pending is not None:
            yield pending

    def _block(self, shard: int, read: int, texts: list[str], counts: dict) -> Block | None:
        size = (read - 1) % self.job.layout.block_documents + 1
        return Block(shard, size, texts, counts) if self.wanted(shard) else None


def _snapshot(stats: dict[str, FilterStats]) -> dict:
    return {source: one.as_dict() for source, one in stats.items()}


class Workers:
    """Runs the encoder on blocks in `count` processes (in this one when count is 1), results in order."""

    def __init__(self, encoder: BlockEncoder, count: int):
        self.encoder, self.count, self.pool = encoder, count, None

    def __enter__(self) -> Workers:
        if self.count > 1:
            # fork: the workers start at once with the tokenizer already loaded; spawn where there is no fork.
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            context = multiprocessing.get_context(method)
            self.pool = context.Pool(self.count, initializer=_start_worker, initargs=(self.encoder,))
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def map(self, blocks) -> Iterator[tuple[Block, tuple]]:
        if self.pool is None:
            for block in blocks:
                if block is not None:
                    yield block, self.encoder(block.texts)
            return
        window: deque = deque()
        for block in blocks:
            if block is None:
                continue
            window.append((block, self.pool.apply_async(_encode, (block.texts,))))
            block.texts = None
            if len(window) >= 2 * self.count:  # enough queued to keep every worker busy, no more in memory
                done, result = window.popleft()
                yield done, result.get()
        while window:
            done, result = window.popleft()
            yield done, result.get()


_worker_encoder: BlockEncoder | None = None


def _start_worker(encoder: BlockEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode(texts: list) -> tuple:
    return _worker_encoder(texts)


@contextmanager
def _one_thread_per_worker() -> Iterator[None]:
    """The Rust tokenizer would use every core in each worker; one thread each makes --workers the core count."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def build(building: Path, job: Job, encoder, task, records: dict, workers: int, show_progress: bool) -> None:
    """Make this task's missing shards (and `end.json` if the sources were read to their end)."""
    if sh.plan(records, end_documents(building), job.max_tokens, job.layout).ready:
        return  # everything is made already (a re-run after a stop while finishing)
    if job.decontaminate:  # loaded here, once: the workers (forked after) share it
        encoder.screen = dc.load(job.decontaminate)
    TaskBuild(building, job, task, records).run(encoder, workers, show_progress)


class TaskBuild:
    """One task's part of a build: which shards it makes, and where the budget lets it stop."""

    def __init__(self, building: Path, job: Job, task: tuple[int, int], records: dict):
        self.building, self.job, self.records = building, job, records
        self.index, self.count = task

    def wanted(self, shard: int) -> bool:
        return shard % self.count == self.index and shard not in self.records

    def train_before(self, shard: int) -> int | None:
        """Training tokens of shards before `shard`, if all of them are made (by this task or another)."""
        if any(i not in self.records for i in range(shard)):
            self.records.update(sh.read_records(self.building, verify=False, itemsize=0))
        if any(i not in self.records for i in range(shard)):
            return None
        return sum(self.records[i]["tokens"]["train"] for i in range(shard))

    def stop_before(self, shard: int) -> bool:
        """True when the shards before `shard` hold the budget, known or (with other tasks' shards unmade)
        estimated from those made: each unmade one taken as the average, less one for safety."""
        budget = self.job.max_tokens
        if budget is None:
            return False
        known = self.train_before(shard)
        if known is not None:
            return known >= budget
        made = [record["tokens"]["train"] for i, record in self.records.items() if i < shard]
        return bool(made) and sum(made) + (shard - len(made) - 1) * sum(made) / len(made) >= budget

    def run(self, encoder, workers: int, show_progress: bool) -> None:
        budget = self.job.max_tokens
        blocks = DocumentBlocks(self.job, self.wanted, self.stop_before)
        writer, before = None, None
        pool = Workers(encoder, workers)
        with _one_thread_per_worker(), pool, progress_bar(disable=not show_progress) as bar:
            progress = bar.add_task("tokenising", total=math.ceil(budget / self.count) if budget else None)
            try:
                for block, (train, val, dropped, masks) in pool.map(blocks):
                    if writer is None or writer.index != block.shard:
                        self._finish(writer)
                        writer = sh.ShardWriter(self.building, block.shard, masks=self.job.chat)
                        before = self.train_before(block.shard)
                    writer.add(block.documents, train, val, block.filter_counts, dropped, masks)
                    bar.update(progress, advance=len(train), description=f"tokenising shard {block.shard}")
                    if budget is not None and before is not None and before + writer.tokens["train"] >= budget:
                        break
                self._finish(writer)
                writer = None
            finally:
                if writer is not None:
                    writer.abandon()
        if blocks.documents is not None:
            sh.write_json(self.building / sh.END, {"documents": blocks.documents})

    def _finish(self, writer: sh.ShardWriter | None) -> None:
        if writer is not None:
            self.records[writer.index] = writer.finish()


def end_documents(building: Path) -> int | None:
    """The count of the sources' documents, once a task has read them to their end (None until then)."""
    path = building / sh.END
    return json.loads(path.read_text())["documents"] if path.is_file() else None


def _all_documents(sources, text_field, seed, row_filter=None, stats: dict | None = None) -> Iterator[str]:
    for source in sources:
        yield from iter_documents(source, text_field, seed, row_filter, (stats or {}).get(source))
