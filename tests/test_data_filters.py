"""`data prepare --filter nemotron-sft`: rows of RL-trained reasoning models dropped, role tags removed, counted."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROWS, char_tokenizer, write_jsonl

from recurfit.data import TokenStore, iter_documents, prepare
from recurfit.data.filters import REASONING_GENERATORS, FilterStats, make_filter
from recurfit.errors import RecurfitError

KEPT = [kept for _, _, kept in ROWS if kept is not None]


def test_reasoning_rows_are_dropped_others_kept_and_tags_stripped_exactly(tmp_path):
    write_jsonl(tmp_path / "sft.jsonl")
    stats = FilterStats()
    documents = iter_documents(str(tmp_path / "sft.jsonl"), row_filter=make_filter("nemotron-sft"), stats=stats)
    assert list(documents) == KEPT
    assert stats.as_dict() == {
        "generator_field": "generator",
        "rows": 11,
        "dropped": 6,
        "kept": 5,
        "tagged": 2,
        "emptied": 0,
        "no_generator": 1,
        "dropped_by_generator": {
            "DeepSeek-R1": 1,
            "DeepSeek-R1-0528": 1,
            "deepseek-ai/DeepSeek-R1-Zero": 1,
            "QwQ-32B": 1,
            "Qwen3-235B-A22B-Thinking-2507": 1,
            "gpt-oss-120b": 1,
        },
        "generators": {generator: 1 for generator, _, _ in ROWS if generator},
    }
    # Without the filter the same file gives every text untouched.
    assert list(iter_documents(str(tmp_path / "sft.jsonl"))) == [text for _, text, _ in ROWS]


def test_role_tags_only_are_removed():
    keep = make_filter("nemotron-sft", exclude=["nothing-matches"])
    stats = FilterStats()
    cases = {
        "<extra_id_1>User\nq<extra_id_1>Assistant\na": "q\na",  # a tag in mid-line becomes a line break
        "<extra_id_1>User q\n<extra_id_1>Assistant   \na": "q\na",  # and spaces after the tag
        "<extra_id_1>User\n\nq": "q",
        "User: q\nAssistant: a <extra_id_1>Tool\n<extra_id_12>User\nx": "User: q\nAssistant: a <extra_id_1>Tool\nx",
        "<extra_id_1>User\n<extra_id_1>Assistant\n": None,  # nothing left: dropped
    }
    for text, expected in cases.items():
        assert keep.apply(text, "m", stats) == expected
    assert (stats.rows, stats.kept, stats.tagged, stats.emptied) == (5, 4, 4, 1)


def test_parquet_struct_json_and_list_generator_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["<extra_id_1>User\nq1\n<extra_id_1>Assistant\na1", "r1 trace", "kept plain", ""]
    models = ["Qwen3-30B-A3B", "Qwen2.5-32B, DeepSeek-R1", "Phi-4", "DeepSeek-R1"]  # any excluded name drops
    pq.write_table(
        pa.table({"text": texts, "metadata": [{"category": "math", "models_used": m} for m in models]}),
        tmp_path / "struct.parquet",
    )
    pq.write_table(
        pa.table({"text": texts, "metadata": [json.dumps({"models_used": m}) for m in models]}),
        tmp_path / "json.parquet",
    )
    pq.write_table(pa.table({"text": texts, "generator": [m.split(", ") for m in models]}), tmp_path / "list.parquet")
    for name, field in (("struct", "metadata.models_used"), ("json", "metadata.models_used"), ("list", "generator")):
        stats = FilterStats()
        path = str(tmp_path / f"{name}.parquet")
        assert list(iter_documents(path, row_filter=make_filter("nemotron-sft"), stats=stats)) == [
            "q1\na1",
            "kept plain",
        ]
        assert (stats.generator_field, stats.rows, stats.dropped, stats.kept) == (field, 3, 1, 2)
        assert dict(stats.dropped_by_generator) == {"DeepSeek-R1": 1}


def test_prepare_records_the_counts_and_packs_only_kept_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = char_tokenizer()
    write_jsonl(tmp_path / "a.jsonl", ROWS[:6])  # all dropped
    pq.write_table(
        pa.table({"text": [t for _, t, _ in ROWS[6:]], "generator": [g for g, _, _ in ROWS[6:]]}),
        tmp_path / "b.parquet",
    )
    sources = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")]
    settings = dict(val_fraction=0, show_progress=False)
    result = prepare(tokenizer, sources, 8, tmp_path / "store", **settings, row_filter=make_filter("nemotron-sft"))
    report = result.meta["filter"]
    assert [report[key] for key in ("name", "rows", "dropped", "kept", "tagged")] == ["nemotron-sft", 11, 6, 5, 2]
    assert report["excluded_generators"] == list(REASONING_GENERATORS) and report["generator_field"] is None
    assert [report["sources"][s]["kept"] for s in sources] == [0, 5]
    assert report["sources"][sources[1]]["generator_field"] == "generator"
    assert json.loads((tmp_path / "store" / "meta.json").read_text())["filter"] == report
    assert result.meta["documents"] == 5
    stream = []
    for text in KEPT:
        stream += tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    rows = len(stream) // 9
    np.testing.assert_array_equal(np.asarray(TokenStore(tmp_path / "store")[:]).reshape(-1), stream[: rows * 9])

    again = prepare(tokenizer, sources, 8, tmp_path / "store", **settings, row_filter=make_filter("nemotron-sft"))
    assert again.skipped and again.meta["filter"] == report
    with pytest.raises(RecurfitError, match="already exists"):  # the unfiltered job is another job
        prepare(tokenizer, sources[1:], 8, tmp_path / "store", **settings)
    other = make_filter("nemotron-sft", exclude=["default", "qwen3-*"])
    assert other.excluded == (*REASONING_GENERATORS, "qwen3-*")
    meta = prepare(tokenizer, sources, 8, tmp_path / "store", **settings, row_filter=other, force=True).meta
    assert meta["filter"]["dropped_by_generator"]["Qwen3-235B-A22B"] == 1 and meta["filter"]["kept"] == 4


def test_missing_fields_are_one_clear_error_before_anything_is_written(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = char_tokenizer()
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "good.jsonl")
    write_jsonl(tmp_path / "in" / "model.jsonl", key="model")
    pq.write_table(pa.table({"text": ["a"], "metadata": [{"category": "x"}]}), tmp_path / "in" / "meta.parquet")
    (tmp_path / "in" / "later.jsonl").write_text('{"text": "a", "generator": "m"}\n{"text": "b"}\n')
    (tmp_path / "in" / "notes.txt").write_text("a paragraph\n")
    filt = make_filter("nemotron-sft")

    def refused(source, match, row_filter=filt):
        with pytest.raises(RecurfitError, match=match):
            sources = [str(tmp_path / "in" / "good.jsonl"), source]
            prepare(tokenizer, sources, 4, tmp_path / "out", show_progress=False, row_filter=row_filter)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no store, no staging folder

    message = r"model.jsonl:1 has none of the fields 'generator', 'metadata.generator', .*--generator-field"
    refused(str(tmp_path / "in" / "model.jsonl"), message)
    refused(str(tmp_path / "in" / "meta.parquet"), r"meta.parquet has none of the fields .*its fields: text, metadata")
    refused(str(tmp_path / "in" / "later.jsonl"), r"later.jsonl:2 has none of the fields")  # found while reading
    refused(str(tmp_path / "in" / "notes.txt"), r"is plain text \(.txt\).*without --filter nemotron-sft")
    refused("embedded:prose", "is an embedded source")
    named = make_filter("nemotron-sft", "model_name")
    refused(str(tmp_path / "in" / "good.jsonl"), r"good.jsonl:1 has no field 'model_name'", named)
    with pytest.raises(RecurfitError, match="only apply with --filter"):
        make_filter(None, exclude=["x"])
    # A named field is used as given.
    stats = FilterStats()
    named = make_filter("nemotron-sft", "model")
    assert list(iter_documents(str(tmp_path / "in" / "model.jsonl"), row_filter=named, stats=stats)) == KEPT
    assert stats.dropped == 6


def test_hub_sources_are_filtered_and_checked(tmp_path, monkeypatch):
    from recurfit.data import sources

    records = [{"text": text, "generator": generator, "uuid": str(i)} for i, (generator, text, _) in enumerate(ROWS)]
    monkeypatch.setattr(sources, "_hub_dataset", lambda spec: iter(records))
    filt = make_filter("nemotron-sft")
    assert list(iter_documents("hf:nvidia/Nemotron-Pretraining-SFT-v1:Nemotron-SFT-General", row_filter=filt)) == KEPT
    monkeypatch.setattr(sources, "_hub_dataset", lambda spec: iter([{"text": "a", "uuid": "1"}]))
    with pytest.raises(RecurfitError, match=r"hf:some/set has none of the fields .*\(its fields: text, uuid\)"):
        prepare(char_tokenizer(), ["hf:some/set"], 4, tmp_path / "out", show_progress=False, row_filter=filt)
    assert list(tmp_path.iterdir()) == []
