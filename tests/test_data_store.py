"""Tests of `recurfit/data/store.py`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import char_tokenizer, write_documents

from recurfit.data import Phase, RowStream, TokenStore, iter_documents, prepare
from recurfit.errors import RecurfitError


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


def test_a_store_of_plain_text_has_no_masks_to_read(workspace):
    """Stores made before instruction data hold no masks: they load as before, and asking their masks says why."""
    store = TokenStore(workspace / "prose")
    assert not store.has_masks and "loss_mask" not in store.meta and len(store) > 0
    with pytest.raises(RecurfitError, match=r"holds no assistant masks .* prepare it from conversations"):
        TokenStore(workspace / "prose", masks=True)


def test_stores_of_format_1_still_load(tmp_path):
    """A store as recurfit wrote it before shards: train.bin and val.bin of whole rows."""
    store = tmp_path / "old"
    store.mkdir()
    rows = np.arange(5 * 9, dtype=np.uint16).reshape(5, 9) % 40
    rows.tofile(store / "train.bin")
    rows[:2].tofile(store / "val.bin")
    meta = {
        "format": 1,
        "fingerprint": "0" * 20,
        "seq_len": 8,
        "dtype": "uint16",
        "rows": {"train": 5, "val": 2},
        "tokens": {"train": 45, "val": 18},
        "documents": 9,
        "vocab_size": 46,
        "eos_token_id": 1,
    }
    (store / "meta.json").write_text(json.dumps(meta))
    np.testing.assert_array_equal(TokenStore(store)[:], rows)
    np.testing.assert_array_equal(TokenStore(store, "val")[1], rows[1])
    batch = RowStream([Phase({str(store): 1.0})], seed=0).next_batch(5)
    assert sorted(map(tuple, batch.tolist())) == sorted(map(tuple, rows.tolist()))


def test_a_store_made_with_another_tokenizer_is_refused_by_train_and_eval_loss(tmp_path, workspace, saved, capsys):
    from conftest import CHARS, run_cli, tiny_config

    from recurfit.train import load_config
    from recurfit.train.loop import Trainer

    other = tmp_path / "other"
    prepare(char_tokenizer(CHARS[::-1]), [str(workspace / "prose.jsonl")], 32, other, tokenizer_name="reversed-chars",
            show_progress=False, val_fraction=0.05, decontaminate="none")  # fmt: skip
    meta = json.loads((other / "meta.json").read_text())
    assert meta["vocab_size"] == TokenStore(workspace / "prose").vocab_size  # the sizes agree: only the hash tells
    config = tiny_config(workspace, tmp_path / "run", data={"phases": [{"sources": [str(other)]}], "validation": []})
    with pytest.raises(RecurfitError, match=rf"{other} was tokenised with reversed-chars's tokenizer, not the model's"):
        Trainer(load_config(None, [], base=config))
    assert not (tmp_path / "run").exists()
    code, text = run_cli(capsys, "eval", "loss", saved / "model", "--data", other, "--out", tmp_path / "eval")
    assert code == 2 and "was tokenised with reversed-chars's tokenizer, not the model's" in text
    assert f"({saved / 'model'})" in text and not (tmp_path / "eval").exists()
    code, text = run_cli(
        capsys, "eval", "loss", saved / "model", "--data", workspace / "prose", "--out", tmp_path / "ok"
    )
    assert code == 0, text  # the same tokenizer saved with the model: accepted


def test_a_store_that_records_no_tokenizer_still_trains_and_evaluates(tmp_path, workspace, saved, capsys):
    """Stores prepared before the tokenizer's vocabulary hash was recorded: nothing to check them against."""
    import shutil

    from conftest import run_cli

    old = tmp_path / "old"
    shutil.copytree(workspace / "prose", old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["tokenizer_vocabulary"]
    (old / "meta.json").write_text(json.dumps(meta))
    code, text = run_cli(capsys, "eval", "loss", saved / "model", "--data", old, "--out", tmp_path / "eval")
    assert code == 0, text
