"""`recurfit data prepare`: tokenise documents with the parent's tokenizer and pack them into a token store.

- **Budget.** `max_tokens` stops reading the sources once the training split holds that many tokens (at the
  end of a block of documents); sources that run dry first give a store of what they held, and say so.
- **Workers.** Blocks of documents are tokenised by `workers` processes while this one reads the sources and
  writes the shards in order, so the store does not depend on the number of workers.
- **Machines.** `task=(i, n)` makes the shards j with j mod n = i (see `shards.py`); n such tasks, started
  by any launcher (a Slurm array, torchrun ranks), fill one store folder on a shared file system, and the
  last one to finish writes `meta.json`. Every task reads the sources from the start (reading is cheap next
  to tokenising) and tokenises only its shards.
- **Resume.** Finished shards are kept, checked by their SHA-256; a re-run of a killed job redoes only the
  unfinished ones, and gives the same store as an uninterrupted run.

- **Decontamination.** Every document that shares a 13-word n-gram with a test or validation item of the
  evaluation sets (all of them unless told otherwise; `decontaminate/` states the rule) is dropped before
  tokenising, in the workers; the sets, n and the counts of dropped documents, per set, go in `meta.json`
  under `decontamination`, and the sets and n into the fingerprint.

- **Instruction data.** Sources whose records hold conversations (a `messages` field of `{role, content}`
  lists) are rendered with the tokenizer's chat template, and the store keeps, beside each shard's tokens, a
  mask of the assistant's tokens (`chat.py`, `packing.py`); `meta.json` says `loss_mask: assistant` and how the
  tokens were found. Decontamination reads the rendered text.

Re-running a finished job is a no-op (the store records a fingerprint of its inputs); a different job aimed at
an existing store is refused unless `force`. A row filter (`filters.py`) is checked against every source
before anything is written, and what it dropped and kept is recorded in `meta.json` under `filter`.

Here: the checks, the locks and resume, the disk, and the finished store; `pipeline.py` makes the shards.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..defaults import DECONTAMINATE
from ..errors import RecurfitError
from ..io.files import check_output, publish_directory
from ..io.lock import owned
from ..progress import size_text as _size
from . import decontaminate as dc
from . import shards as sh
from .filters import FilterStats
from .packing import DEFAULT_PACKING, BlockEncoder
from .pipeline import Job, build, end_documents
from .sources import check_filter, is_chat
from .store import FORMAT_VERSION, LOSS_MASK, MASK_DTYPE, META, SPLITS, read_meta, vocabulary_hash

DEFAULT_LAYOUT = sh.Layout()


@dataclass
class PrepareResult:
    folder: Path
    meta: dict | None  # None: this task's shards are done, and the store waits for other tasks
    skipped: bool  # True: the store already held exactly this job
    missing: list[int] | None = None  # shards other tasks have yet to make (when meta is None)


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
    max_tokens: int | None = None,
    workers: int = 1,
    task: tuple[int, int] = (0, 1),
    packing: str = DEFAULT_PACKING,
    layout: sh.Layout = DEFAULT_LAYOUT,
    decontaminate: str | Sequence[str] | None = DECONTAMINATE,
    say: Callable[[str], None] = lambda line: None,
) -> PrepareResult:
    """Tokenise `sources` (see `sources.py`) and pack them into rows of `seq_len + 1` tokens in `out`.

    A document goes to the validation split when a hash of its text falls in `val_fraction`: the split does
    not depend on document order, and the same document always lands in the same split. `row_filter` (see
    `filters.make_filter`) drops and rewrites rows of every source before tokenising. `decontaminate` names the
    evaluation sets whose test items no document may share an n-gram with (`all`, `none`, or names; see
    `decontaminate/`). `say` receives the
    lines worth printing (the expected size, a budget the sources could not fill, a task's share done)."""
    _check_settings(seq_len, val_fraction, sources, max_tokens, workers, task, layout)
    sets = dc.parse_sets(decontaminate)
    chat = any(is_chat(source, text_field) for source in sources)
    encoder = BlockEncoder(tokenizer, packing, val_fraction, chat=chat)
    job = Job(
        tuple(sources), seq_len, val_fraction, text_field, seed, packing, max_tokens, layout, row_filter, sets, chat
    )
    out = Path(out)
    digest = job.fingerprint(tokenizer)
    if (out / META).is_file() and not force:
        existing = read_meta(out)
        if existing.get("fingerprint") == digest:
            return PrepareResult(out, existing, skipped=True)
    check_output(out, force)
    for source in sources if row_filter is not None else ():
        check_filter(source, text_field, row_filter)
    building = out.parent / f".{out.name}.building-{digest}"
    alone = task[1] == 1
    with owned(out if alone else out.parent / f"{out.name}.task-{task[0]}-of-{task[1]}"):
        if alone and force and building.exists():
            shutil.rmtree(building)  # --force starts over (with tasks, it only replaces the finished store)
        with owned(out, wait=True):  # not while another task cuts the last shard and publishes the store
            if _finishing(building).exists() and not building.exists():
                _finishing(building).rename(building)  # the task finishing the store died: finish it again
            records = sh.read_records(building, verify=True, itemsize=np.dtype(encoder.dtype).itemsize)
        _check_disk(out.parent, job, encoder, task, records, say)
        building.mkdir(exist_ok=True)
        try:
            build(building, job, encoder, task, records, workers, show_progress)
        except FileNotFoundError:
            with owned(out, wait=True):  # another task may have finished the store, removing what this one made
                if not (out / META).is_file() or read_meta(out).get("fingerprint") != digest:
                    raise
        except RecurfitError:  # bad input found while reading: keep finished shards (a resume needs them), only
            if not records:  # an empty build folder goes
                shutil.rmtree(building, ignore_errors=True)
            raise
        with owned(out, wait=True):  # the last of several tasks to finish writes the store
            if (out / META).is_file() and read_meta(out).get("fingerprint") == digest and not force:
                return PrepareResult(out, read_meta(out), skipped=True)  # another task wrote it
            result = _store_if_complete(building, out, job, encoder, digest, tokenizer_name, tokenizer)
    if result.meta is not None and max_tokens is not None and not result.meta["budget_reached"]:
        got = result.meta["tokens"]["train"]
        say(
            f"The sources ran dry at {got:,} training tokens, {got / max_tokens:.1%} of the --max-tokens budget "
            f"of {max_tokens:,}."
        )
    return result


def _store_if_complete(building: Path, out: Path, job: Job, encoder, digest, tokenizer_name, tokenizer):
    """Write the store when every shard it needs is made (by any task); else say which shards are missing."""
    records = sh.read_records(building, verify=False, itemsize=0)
    plan = sh.plan(records, end_documents(building), job.max_tokens, job.layout)
    if not plan.ready:
        return PrepareResult(out, None, skipped=False, missing=plan.missing)
    finishing = _finishing(building)
    building.rename(finishing)  # from here on, a task still making a shard the store does not need adds nothing
    try:
        meta = _finish(finishing, out, plan, job, encoder, digest, tokenizer_name, tokenizer)
    except RecurfitError:  # the sources make no usable store with these settings: leave nothing behind
        shutil.rmtree(finishing, ignore_errors=True)
        raise
    return PrepareResult(out, meta, skipped=False)


def _finishing(building: Path) -> Path:
    """Where the build folder is finished: a name other tasks do not write to (a crash there is undone)."""
    return building.with_name(building.name.replace(".building-", ".finishing-"))


def _check_settings(seq_len, val_fraction, sources, max_tokens, workers, task, layout) -> None:
    if seq_len < 1:
        raise RecurfitError(f"--seq-len must be at least 1, got {seq_len}.")
    if not 0 <= val_fraction < 1:
        raise RecurfitError(f"--val-fraction must be in [0, 1), got {val_fraction}.")
    if not sources:
        raise RecurfitError("Give at least one --source.")
    if max_tokens is not None and max_tokens < seq_len + 1:
        raise RecurfitError(f"--max-tokens must be at least one row (seq_len + 1 = {seq_len + 1}), got {max_tokens}.")
    if workers < 1:
        raise RecurfitError(f"--workers must be at least 1, got {workers}.")
    index, count = task
    if not (count >= 1 and 0 <= index < count):
        raise RecurfitError(f"--task must be I/N with 0 <= I < N, got {index}/{count}.")
    if layout.block_documents < 1 or layout.shard_documents % layout.block_documents:
        raise RecurfitError(
            f"--shard-documents ({layout.shard_documents}) must be a multiple of {layout.block_documents} "
            "(the documents a worker tokenises at a time), or smaller."
        )


# ---------------------------------------------------------------- disk


def _check_disk(where: Path, job: Job, encoder: BlockEncoder, task, records: dict, say) -> None:
    """Print the size the store will take and refuse when the disk has less free (needs a budget to know)."""
    if job.max_tokens is None:
        say("Expected size on disk: unknown without --max-tokens (2 or 4 bytes per token of the sources).")
        return
    itemsize = np.dtype(encoder.dtype).itemsize + (np.dtype(MASK_DTYPE).itemsize if job.chat else 0)
    tokens = job.max_tokens / (1 - job.val_fraction)  # the training budget and the held-out share beside it
    total = tokens * itemsize
    share = total / task[1]
    written = sum((record["tokens"]["train"] + record["tokens"]["val"]) * itemsize for record in records.values())
    needed = max(0.0, share - written)
    free = free_bytes(where)
    of = f" (this task's share: {_size(share)})" if task[1] > 1 else ""
    say(
        f"Expected size on disk: {_size(total)}{of} for {tokens:,.0f} tokens × {itemsize} bytes; "
        f"{_size(free)} free where it is written."
    )
    if free < needed:
        raise RecurfitError(
            f"{where} has {_size(free)} free but the store needs {_size(needed)} more; free space, "
            "lower --max-tokens or choose another --out."
        )


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


# ---------------------------------------------------------------- the finished store


def _finish(building: Path, out: Path, plan: sh.Plan, job: Job, encoder, digest, tokenizer_name, tokenizer) -> dict:
    itemsize = np.dtype(encoder.dtype).itemsize
    used = list(plan.shards)
    if plan.last_blocks is not None:
        used[-1] = sh.cut(building, used[-1], plan.last_blocks, itemsize)
    row = job.seq_len + 1
    tokens = {split: sum(record["tokens"][split] for record in used) for split in SPLITS}
    rows = {split: tokens[split] // row for split in SPLITS}
    documents = sum(record["documents"] for record in used)
    if rows["train"] == 0:
        kept = sum(one.get("kept", 0) for one in sh.filter_counts(used).values())
        why = f" after the {job.row_filter.name} filter kept {kept:,} rows" if job.row_filter is not None else ""
        raise RecurfitError(
            f"The sources hold fewer than seq_len + 1 = {row} tokens of training text{why}; "
            "add data or lower --seq-len."
        )
    if rows["val"] == 0 and job.val_fraction > 0:
        raise RecurfitError(_no_validation_row(out, job.val_fraction, documents, tokens, job.seq_len))
    meta = {
        "format": FORMAT_VERSION,
        "fingerprint": digest,
        "seq_len": job.seq_len,
        "dtype": np.dtype(encoder.dtype).name,
        "rows": rows,
        "tokens": {split: n * row for split, n in rows.items()},
        "documents": documents,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "packing": job.packing,
        "bos_token_id": encoder.bos_token_id(),
        "tokenizer": tokenizer_name,
        "tokenizer_vocabulary": vocabulary_hash(tokenizer),
        "sources": list(job.sources),
        "val_fraction": job.val_fraction,
        "seed": job.seed,
        "max_tokens": job.max_tokens,
        "budget_reached": plan.budget_reached if job.max_tokens is not None else None,
        "shard_documents": job.layout.shard_documents,
        "shards": [
            {key: record[key] for key in ("name", "documents", "tokens", "sha256", "mask_sha256") if key in record}
            for record in used
        ],
    }
    if job.chat:
        meta["loss_mask"] = LOSS_MASK
        meta["assistant_tokens"] = encoder.chat.method  # how they were found (chat.py)
    if job.row_filter is not None:
        meta["filter"] = _filter_report(job.row_filter, sh.filter_counts(used), job.sources)
    if job.decontaminate:
        meta["decontamination"] = {**dc.settings(job.decontaminate), **sh.dropped_counts(used)}
    sh.remove_unused(building, used)
    sh.write_json(building / META, meta)
    publish_directory(building, out)
    # Builds of other jobs aimed at this store, which it replaces:
    for stale in [*out.parent.glob(f".{out.name}.building-*"), *out.parent.glob(f".{out.name}.finishing-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    return meta


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


def _filter_report(row_filter, per_source: dict, sources: Sequence[str]) -> dict:
    """The filter's settings, its counts over all sources, and the counts of each source."""
    blank = {"all": FilterStats().as_dict()}
    per_source = {source: sh.counts_plus(blank, {"all": per_source.get(source, {})})["all"] for source in sources}
    total = blank
    for counts in per_source.values():
        total = sh.counts_plus(total, {"all": counts})
    # The top-level generator_field is the one asked for (None: detected); each source's is the one it used.
    return {**total["all"], **row_filter.settings(), "sources": per_source}
