"""Data: packing, idempotent prepare, sources, and the deterministic, resumable, rank-sliced row stream."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import char_tokenizer, write_documents

from recurfit.data import Phase, RowStream, TokenStore, iter_documents, prepare
from recurfit.data.sources import format_math
from recurfit.errors import RecurfitError


def test_rows_are_the_documents_joined_by_eos(tmp_path):
    tokenizer = char_tokenizer()
    write_documents(tmp_path / "docs.jsonl", 50)
    result = prepare(
        tokenizer, [str(tmp_path / "docs.jsonl")], 16, tmp_path / "store", val_fraction=0, show_progress=False
    )
    store = TokenStore(tmp_path / "store")
    stream = []
    for line in (tmp_path / "docs.jsonl").read_text().splitlines():
        stream += tokenizer(json.loads(line)["text"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    rows = len(stream) // 17
    assert len(store) == rows == result.meta["rows"]["train"]
    np.testing.assert_array_equal(np.asarray(store[:]).reshape(-1), stream[: rows * 17])
    assert len(TokenStore(tmp_path / "store", "val")) == 0


def test_prepare_is_idempotent_and_refuses_other_jobs(tmp_path):
    tokenizer = char_tokenizer()
    write_documents(tmp_path / "docs.jsonl", 40)
    source, settings = [str(tmp_path / "docs.jsonl")], {"show_progress": False, "val_fraction": 0.2}
    first = prepare(tokenizer, source, 16, tmp_path / "store", **settings)
    mtime = (tmp_path / "store" / "shards" / "00000.train.bin").stat().st_mtime_ns
    again = prepare(tokenizer, source, 16, tmp_path / "store", **settings)
    assert again.skipped and not first.skipped
    assert (tmp_path / "store" / "shards" / "00000.train.bin").stat().st_mtime_ns == mtime
    with pytest.raises(RecurfitError, match="already exists"):
        prepare(tokenizer, source, 8, tmp_path / "store", **settings)
    assert TokenStore(tmp_path / "store").seq_len == 16  # untouched
    assert prepare(tokenizer, source, 8, tmp_path / "store", force=True, **settings).meta["seq_len"] == 8


def test_validation_split_follows_the_text_not_the_order(tmp_path):
    from recurfit.data.packing import split_of as _split_of

    tokenizer = char_tokenizer()
    write_documents(tmp_path / "a.jsonl", 200)
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    (tmp_path / "b.jsonl").write_text("\n".join(reversed(lines)) + "\n")
    held_out = [json.loads(line)["text"] for line in lines if _split_of(json.loads(line)["text"], 0.2) == "val"]
    assert 20 < len(held_out) < 60
    val_tokens = sum(len(tokenizer(text, add_special_tokens=False).input_ids) + 1 for text in held_out)
    for name in "ab":
        meta = prepare(
            tokenizer,
            [str(tmp_path / f"{name}.jsonl")],
            8,
            tmp_path / name.upper(),
            val_fraction=0.2,
            show_progress=False,
        ).meta
        assert meta["rows"]["val"] == val_tokens // 9  # the same documents held out, whatever the order


def test_damaged_store_and_bad_sources_are_clear_errors(tmp_path):
    tokenizer = char_tokenizer()
    write_documents(tmp_path / "docs.jsonl", 20)
    prepare(tokenizer, [str(tmp_path / "docs.jsonl")], 8, tmp_path / "store", show_progress=False, val_fraction=0.3)
    with open(tmp_path / "store" / "shards" / "00000.train.bin", "ab") as file:
        file.write(b"\0\0")
    with pytest.raises(RecurfitError, match="incomplete or damaged"):
        TokenStore(tmp_path / "store")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(RecurfitError, match=r"bad.jsonl:2 is not valid JSON"):
        list(iter_documents(str(tmp_path / "bad.jsonl")))
    (tmp_path / "other.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(RecurfitError, match="--text-field"):
        list(iter_documents(str(tmp_path / "other.jsonl")))
    with pytest.raises(RecurfitError, match="embedded:prose"):
        list(iter_documents(str(tmp_path / "missing.jsonl")))
    with pytest.raises(RecurfitError, match="not a token store"):
        TokenStore(tmp_path)


def test_text_and_parquet_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "book.txt").write_text("First paragraph.\n\nSecond one.\n\n\n")
    assert list(iter_documents(str(tmp_path / "book.txt"))) == ["First paragraph.", "Second one."]
    pq.write_table(pa.table({"content": ["a b", "", "c"]}), tmp_path / "t.parquet")
    assert list(iter_documents(str(tmp_path / "t.parquet"))) == ["a b", "c"]


def test_math_format_drops_generator_instructions():
    text = format_math("How many? Give the result as your final answer. Do not include units.", "2+2=4\n#### 4", "4")
    assert text == "Question: How many?\nAnswer: Let's think step by step. 2+2=4\nThe answer is 4."


def test_embedded_sources_are_offline_and_deterministic():
    first = list(iter_documents("embedded:math:3", seed=5))
    assert first == list(iter_documents("embedded:math:3", seed=5)) and len(first) == 3
    assert first != list(iter_documents("embedded:math:3", seed=6))
    assert all(doc.startswith("Question: ") and "The answer is" in doc for doc in first)
    prose = iter_documents("embedded:prose")
    assert len(next(prose).split()) > 15


# ---------------------------------------------------------------- the stream


def test_mixture_weights_and_phase_budgets(workspace):
    prose, math = str(workspace / "prose"), str(workspace / "math")
    stream = RowStream([Phase({prose: 1.0}, tokens=32 * 10), Phase({prose: 1.0, math: 3.0})], seed=0)
    sources = [stream._next()[0] for _ in range(10 + 400)]
    assert sources[:10] == [0] * 10  # the healing phase: prose only, exactly its budget
    mixed = sources[10:]
    assert mixed.count(1) == 300 and mixed.count(0) == 100  # 1:3, exact over whole cycles
    assert all(abs(mixed[:n].count(1) - 0.75 * n) <= 1 for n in range(1, 400))  # and never bursty


def test_rows_cover_a_store_once_per_epoch(workspace):
    store = TokenStore(workspace / "prose")
    stream = RowStream([Phase({str(workspace / "prose"): 1})], seed=3)
    epoch = [stream._next()[1] for _ in range(len(store))]
    assert sorted(epoch) == list(range(len(store))) and epoch != sorted(epoch)
    assert [stream._next()[1] for _ in range(len(store))] != epoch  # a fresh order next epoch


def test_ranks_split_the_same_global_batches(workspace):
    phases = [Phase({str(workspace / "prose"): 1, str(workspace / "math"): 1})]
    single = RowStream(phases, seed=1)
    ranks = [RowStream(phases, seed=1) for _ in range(2)]
    for _ in range(3):
        whole = single.next_batch(8)
        parts = [stream.next_batch(8, rank, 2) for rank, stream in enumerate(ranks)]
        torch.testing.assert_close(torch.cat(parts), whole)


def test_stream_resumes_exactly(workspace):
    phases = [
        Phase({str(workspace / "prose"): 1}, tokens=32 * 20),
        Phase({str(workspace / "prose"): 1, str(workspace / "math"): 2}),
    ]
    reference = RowStream(phases, seed=2)
    batches = [reference.next_batch(6) for _ in range(10)]
    first = RowStream(phases, seed=2)
    for _ in range(4):
        first.next_batch(6)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = RowStream(phases, seed=2)
    resumed.load_state_dict(state)
    for expected in batches[4:]:
        torch.testing.assert_close(resumed.next_batch(6), expected)
    with pytest.raises(RecurfitError, match="other data"):
        RowStream(phases, seed=9).load_state_dict(state)


def test_a_field_that_is_not_text_is_an_error_naming_file_and_line(tmp_path):
    for value, kind in ((123, "int 123"), (["a", "b"], "list ['a', 'b']"), ({"t": 1}, "dict {'t': 1}")):
        (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
        with pytest.raises(RecurfitError, match=re.escape(f"docs.jsonl:2: field 'text' holds {kind}, not text")):
            list(iter_documents(str(tmp_path / "docs.jsonl")))
    (tmp_path / "docs.jsonl").write_text('{"text": null}\n{"text": ""}\n{"text": "kept"}\n')
    assert list(iter_documents(str(tmp_path / "docs.jsonl"))) == ["kept"]  # empty rows are skipped, as before


def test_every_store_gets_a_validation_row_or_prepare_says_how(tmp_path):
    tokenizer = char_tokenizer()
    write_documents(tmp_path / "docs.jsonl", 40)
    source = [str(tmp_path / "docs.jsonl")]
    with pytest.raises(
        RecurfitError,
        match=r"store: the held-out share \(--val-fraction 0.01\) of 40 documents .*"
        r"less than one validation row of 17; pass --val-fraction 0.08 or more",
    ):
        prepare(tokenizer, source, 16, tmp_path / "store", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]  # nothing half-written
    result = prepare(tokenizer, source, 16, tmp_path / "store", val_fraction=0.08, show_progress=False)
    assert result.meta["rows"]["val"] > 0
