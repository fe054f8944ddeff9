"""`data prepare` at scale: token budget, workers, shard tasks, resume after SIGKILL, BOS packing, disk check."""

from __future__ import annotations

import numpy as np
from conftest import SMALL, char_tokenizer

from recurfit.data import Phase, RowStream, TokenStore, prepare


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
