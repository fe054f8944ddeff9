"""Data: packing, idempotent prepare, sources, and the deterministic, resumable, rank-sliced row stream."""

from __future__ import annotations

import json

import pytest
import torch

from recurfit.data import Phase, RowStream, TokenStore
from recurfit.errors import RecurfitError


def test_mixture_weights_and_phase_budgets(workspace):
    prose, math = str(workspace / "prose"), str(workspace / "math")
    stream = RowStream([Phase({prose: 1.0}, tokens=32 * 10), Phase({prose: 1.0, math: 3.0})], seed=0)
    sources = [stream._next()[0] for _ in range(10 + 400)]
    assert sources[:10] == [0] * 10  # the healing phase: prose only, exactly its budget
    mixed = sources[10:]
    assert mixed.count(1) == 300 and mixed.count(0) == 100  # 1:3, exact over whole cycles
    assert all(abs(mixed[:n].count(1) - 0.75 * n) <= 1 for n in range(1, 400))  # and never bursty


def test_a_store_asked_for_more_rows_than_it_holds_warns_or_refuses(workspace):
    prose, math = str(workspace / "prose"), str(workspace / "math")
    phases = [Phase({prose: 1.0}, tokens=32 * 10), Phase({prose: 1.0, math: 3.0})]
    stream, whole = RowStream(phases, seed=0), RowStream(phases, seed=0)
    held = [len(store) for store in stream.stores]
    more = 10 + 2 * held[1]  # math's 3/4 of the second phase: 1.5 passes over it
    for _ in range(4):  # the plan is made mid-phase, as after a resume
        stream._next()
    asked = stream.rows_asked(more - 4)
    for _ in range(more):
        whole._next()
    assert all(abs(a - taken) <= 1 for a, taken in zip(asked, whole.consumed))  # the round-robin's one row
    assert whole.consumed[1] > held[1] > whole.consumed[0] - held[0]
    warning = stream.repeat_warning(more - 4, "warn")
    assert warning.startswith(f"warning: {math} holds {held[1] * 32:,} training tokens and the run asks ")
    assert "(1.50 passes)" in warning and prose + " " not in warning
    assert stream.repeat_warning(more - 4, "allow") is None and stream.repeat_warning(held[1], "warn") is None
    with pytest.raises(RecurfitError, match=r"math holds .* \(1\.50 passes\), and data.repeat is refuse"):
        stream.repeat_warning(more - 4, "refuse")


def test_the_last_phase_runs_on_past_its_budget(workspace):
    stream = RowStream([Phase({str(workspace / "prose"): 1.0}, tokens=32 * 2)], seed=0)
    assert [stream._next()[0] for _ in range(5)] == [0] * 5


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
