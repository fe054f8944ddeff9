"""Tests of `recurfit/data/packing.py`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SMALL, char_tokenizer, chat_tokenizer, conversations, write_conversations, write_documents

from recurfit.data import TokenStore, prepare
from recurfit.errors import RecurfitError


def bos_tokenizer():
    """The character tokenizer with a template that puts <s> before every text, as Llama's does."""
    from tokenizers import processors

    tokenizer = char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    return tokenizer


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


def test_bos_packing_frames_each_document_as_the_authors_did(tmp_path):
    tokenizer = bos_tokenizer()
    texts = ["  the cat sat. ", "a dog ran far.", "\nand then slept\n"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    source = [str(tmp_path / "d.jsonl")]
    meta = prepare(tokenizer, source, 8, tmp_path / "bos", val_fraction=0, show_progress=False).meta
    # preprocess_data_packing.py: tokenizer(text.strip() + eos_token, add_special_tokens=True), concatenated.
    authors = []
    for text in texts:
        authors += tokenizer(text.strip() + tokenizer.eos_token, add_special_tokens=True)["input_ids"]
    rows = len(authors) // 9
    np.testing.assert_array_equal(TokenStore(tmp_path / "bos")[:].reshape(-1), authors[: rows * 9])
    assert authors[0] == tokenizer.bos_token_id and meta["packing"] == "bos-eos" and meta["bos_token_id"] == 2
    eos = prepare(tokenizer, source, 8, tmp_path / "eos", val_fraction=0, packing="eos", show_progress=False).meta
    plain = []
    for text in texts:
        plain += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    np.testing.assert_array_equal(TokenStore(tmp_path / "eos")[:].reshape(-1), plain[: len(plain) // 9 * 9])
    assert eos["packing"] == "eos" and eos["bos_token_id"] is None and eos["fingerprint"] != meta["fingerprint"]
    with pytest.raises(RecurfitError, match="already exists"):  # another packing is another job
        prepare(tokenizer, source, 8, tmp_path / "bos", val_fraction=0, packing="eos", show_progress=False)
    # A tokenizer that adds no BOS packs the stripped document and EOS, and says so.
    assert (
        prepare(char_tokenizer(), source, 8, tmp_path / "none", val_fraction=0, show_progress=False).meta[
            "bos_token_id"
        ]
        is None
    )


def test_the_fast_path_gives_the_tokenizers_own_ids(tmp_path):
    """Workers call the Rust tokenizer's batch encoder directly: the ids must be those of tokenizer(...)."""
    from recurfit.data.packing import BlockEncoder
    from recurfit.model.loading import load_tokenizer

    texts = ["Hello world, this is a test.", "  Leading spaces\nand lines ", "数字 123 and émojis 🙂"]
    for tokenizer in (load_tokenizer(None), bos_tokenizer()):
        for packing, special in (("bos-eos", True), ("eos", False)):
            framed = [t.strip() for t in texts] if special else texts
            expected = tokenizer(framed, add_special_tokens=special)["input_ids"]
            assert BlockEncoder(tokenizer, packing, 0).encode(texts) == expected


def test_a_tokenizer_that_has_padded_a_batch_still_packs_documents_unpadded(tmp_path):
    """transformers leaves the Rust tokenizer padding after a call with padding=True (as the parity check and
    generation make); the store must not fill with pad tokens, nor its documents be cut by a truncation left on.
    The demo prepared stores 85 % padding this way before the encoder took its own copy."""
    texts = ["a dog ran far and then slept.", "the cat.", "a big red tree stood under the sky, then fell."]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    source = [str(tmp_path / "d.jsonl")]
    fresh = prepare(char_tokenizer(), source, 8, tmp_path / "fresh", val_fraction=0, show_progress=False)
    used = char_tokenizer()
    used.padding_side = "left"
    used(["a", "a longer text"], padding=True, truncation=True, max_length=4)
    backend = used.backend_tokenizer
    assert backend.padding is not None and backend.truncation is not None  # what broke packing is still set
    again = prepare(used, source, 8, tmp_path / "used", val_fraction=0, show_progress=False)
    whole_rows = sum(len(t) + 1 for t in texts) // 9  # of 9 tokens: the documents and their EOS, nothing more
    assert again.meta["tokens"] == fresh.meta["tokens"] == {"train": whole_rows * 9, "val": 0}
    np.testing.assert_array_equal(TokenStore(tmp_path / "used")[:], TokenStore(tmp_path / "fresh")[:])


def test_conversations_are_packed_with_their_masks_aligned_across_shards_and_a_cut(tmp_path):
    """A source of conversations and one of plain text, in shards of 16 documents and cut by a token budget: the
    tokens are each conversation's rendering and each text, each followed by EOS, in order; the masks, read as rows
    as the tokens are, mark each conversation's assistant tokens (not its EOS) and every token of the text."""
    from recurfit.data.chat import ChatRenderer

    tokenizer, chats = chat_tokenizer(), conversations(60)
    write_conversations(tmp_path / "chat.jsonl", chats)
    write_documents(tmp_path / "docs.jsonl", 30)
    texts = [json.loads(line)["text"] for line in (tmp_path / "docs.jsonl").read_text().splitlines()]
    sources, eos = [str(tmp_path / "chat.jsonl"), str(tmp_path / "docs.jsonl")], tokenizer.eos_token_id
    ids, mask = [], []
    for messages in chats:
        _, tokens, marks = ChatRenderer(tokenizer)(messages)
        ids, mask = ids + tokens + [eos], mask + marks + [0]
    in_chats = len(ids)
    for text in texts:
        tokens = tokenizer(text.strip())["input_ids"]
        ids, mask = ids + tokens + [eos], mask + [1] * (len(tokens) + 1)
    budget = (in_chats + len(ids)) // 2  # cut inside the texts' shards
    settings = dict(val_fraction=0, show_progress=False, layout=SMALL, decontaminate="none")
    meta = prepare(tokenizer, sources, 16, tmp_path / "store", max_tokens=budget, **settings).meta
    assert meta["loss_mask"] == "assistant" and meta["assistant_tokens"] == "generation" and meta["budget_reached"]
    assert len(meta["shards"]) > 4 and all("mask_sha256" in shard for shard in meta["shards"])
    assert in_chats < meta["tokens"]["train"] < len(ids) - 17
    store, masks = TokenStore(tmp_path / "store"), TokenStore(tmp_path / "store", masks=True)
    assert len(store) == len(masks) == meta["rows"]["train"] and 0 < sum(mask) < len(mask)
    used = len(store) * 17
    np.testing.assert_array_equal(store[:].reshape(-1), ids[:used])
    np.testing.assert_array_equal(masks[:].reshape(-1), mask[:used])
    np.testing.assert_array_equal(masks[3], mask[3 * 17 : 4 * 17])  # a row read alone, as training reads it
    # The template frames a conversation whatever the packing: `eos` packing stores the same conversations.
    eos_meta = prepare(tokenizer, sources[:1], 16, tmp_path / "eos", packing="eos", **settings).meta
    assert eos_meta["fingerprint"] != meta["fingerprint"]
    np.testing.assert_array_equal(TokenStore(tmp_path / "eos")[: in_chats // 17], store[: in_chats // 17])
