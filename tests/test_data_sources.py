"""Tests of `recurfit/data/sources.py`."""

from __future__ import annotations

import json
import re

import pytest
from conftest import bad_data_files

from recurfit.data import iter_documents
from recurfit.data.sources import format_math
from recurfit.errors import RecurfitError


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


def test_a_field_that_is_not_text_is_an_error_naming_file_and_line(tmp_path):
    shapeless = [{"from": "human", "value": "hi"}]  # ShareGPT's layout, not OpenAI's {role, content}
    for value, kind in (
        (123, "int 123"),
        (["a", "b"], "list ['a', 'b']"),
        ({"t": 1}, "dict {'t': 1}"),
        (shapeless, "list [{'from': 'human', 'value': 'hi'}]"),
    ):
        (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
        expected = f"docs.jsonl:2: field 'text' holds {kind}, neither text nor a list of {{role, content}} messages"
        with pytest.raises(RecurfitError, match=re.escape(expected)):
            list(iter_documents(str(tmp_path / "docs.jsonl")))
    (tmp_path / "docs.jsonl").write_text('{"text": null}\n{"text": ""}\n{"text": "kept"}\n')
    assert list(iter_documents(str(tmp_path / "docs.jsonl"))) == ["kept"]  # empty rows are skipped, as before


def test_a_messages_field_is_read_as_conversations_and_tells_the_store_to_keep_masks(tmp_path):
    from recurfit.data.sources import is_chat

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"id": 1, "messages": messages}) + "\n")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "plain"}) + "\n")
    assert list(iter_documents(str(tmp_path / "chat.jsonl"))) == [messages]
    assert is_chat(str(tmp_path / "chat.jsonl"), None) and not is_chat(str(tmp_path / "docs.jsonl"), None)
    assert not is_chat("embedded:math:3", None)


def test_unreadable_data_files_are_named_in_one_line(tmp_path):
    from recurfit.data.sources import iter_documents
    from recurfit.errors import RecurfitError

    for path, message in bad_data_files(tmp_path).items():
        with pytest.raises(RecurfitError) as problem:
            list(iter_documents(str(path)))
        assert str(problem.value).startswith(message) and "\n" not in str(problem.value)
