"""Evaluation across test recurrence: the single-pass sweep, padding, the lm-eval model, offline tasks, CLI."""

import pytest
import torch
from conftest import char_tokenizer, recurrent, tiny_parent, token_batch

from recurfit import retrofit
from recurfit.data.store import TokenStore
from recurfit.errors import RecurfitError
from recurfit.evaluate.loss import (
    Examples,
    _windows,
    batches,
    evaluate_loss,
    load_examples,
    loss_sweep,
    summed_nll,
    sweep_nll,
    sweep_plan,
)


def ragged(lengths=(12, 7, 3, 10), seed=3) -> Examples:
    generator = torch.Generator().manual_seed(seed)
    return Examples([torch.randint(1, 97, (n,), generator=generator).tolist() for n in lengths], "random ids")


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo3", "gemma"])
def test_one_pass_readouts_equal_separate_forwards_from_the_same_state(family):
    model = recurrent(family)
    ids = token_batch(2, 12)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding on one row
    s0 = torch.randn(2, 12, model.config.hidden_size) * 0.1
    readouts = dict(model.model.final_hidden_states_at(ids, [1, 3, 4], attention_mask=mask, initial_state=s0))
    assert list(readouts) == [1, 3, 4]
    for r, hidden in readouts.items():
        separate = model.model(ids, attention_mask=mask, num_steps=r, initial_state=s0)[0]
        torch.testing.assert_close(hidden, separate, rtol=0, atol=1e-5)
    assert (readouts[1] - readouts[4]).abs().max() > 1e-3  # depth changes the answer, so the check has teeth


def test_loss_equals_the_models_own_loss_at_each_r():
    model = recurrent(state_init_std=0.0)
    ids = token_batch(3, 10)
    mask = torch.ones_like(ids)
    nll = sweep_nll(model, ids, mask, [1, 3])
    for r in (1, 3):
        expected = model(ids, labels=ids, num_steps=r).loss * ids.shape[0] * (ids.shape[1] - 1)
        torch.testing.assert_close(nll[r].sum(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("parent", [False, True])
def test_padded_batches_give_each_sequence_its_loss_alone(parent):
    model = tiny_parent("qwen3") if parent else recurrent("qwen3", state_init_std=0.0)
    examples = ragged()
    steps = [1, 2, 4]
    batched = evaluate_loss(model, examples, steps, batch_size=4, show_progress=False)
    alone = evaluate_loss(model, examples, steps, batch_size=1, show_progress=False)
    assert list(batched) == ([None] if parent else steps)
    for r in batched:
        assert batched[r]["loss"] == pytest.approx(alone[r]["loss"], abs=1e-5)
    # Padding is neither attended to nor scored: the same ids padded with other tokens change nothing.
    ids, mask = next(batches(examples, 4))
    noisy = torch.where(mask.bool(), ids, torch.randint_like(ids, 1, 97))
    torch.testing.assert_close(
        sweep_nll(model, ids, mask, steps)[steps[0] if not parent else None],
        sweep_nll(model, noisy, mask, steps)[steps[0] if not parent else None],
    )


def test_windows_predict_every_token_after_the_first_exactly_once():
    tokenizer = char_tokenizer()
    texts = ["the cat sat on the mat. " * 5, "a dog."]
    windows = list(_windows(iter(texts), tokenizer, seq_len=16))
    assert all(2 <= len(w) <= 17 for w in windows)
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]  # + EOS
    assert sum(len(w) - 1 for w in windows) == sum(n - 1 for n in lengths)


def test_summed_nll_ignores_masked_targets():
    logits = torch.randn(1, 4, 10)
    ids = torch.tensor([[1, 2, 3, 4]])
    full = summed_nll(logits, ids, torch.ones_like(ids))
    cut = summed_nll(logits, ids, torch.tensor([[1, 1, 0, 0]]))
    expected = torch.nn.functional.cross_entropy(logits[0, :1], ids[0, 1:2], reduction="sum")
    torch.testing.assert_close(cut[0], expected)
    assert full[0] > cut[0]


@pytest.fixture
def row_reads(monkeypatch):
    """The number of rows of each read from a token store, as it happens."""
    reads = []
    getitem = TokenStore.__getitem__

    def counted(store, index):
        rows = getitem(store, index)
        reads.append(len(rows) if isinstance(index, slice) else 1)
        return rows

    monkeypatch.setattr(TokenStore, "__getitem__", counted)
    return reads


def test_a_stores_rows_are_read_a_batch_at_a_time_as_they_are_scored(workspace, row_reads):
    store = str(workspace / "math")
    examples = load_examples(store, limit=5)
    assert row_reads == []  # nothing is read (or held) before scoring
    assert len(examples) == 5 and examples.tokens == 5 * 32
    model = recurrent(state_init_std=0.0)
    streamed = evaluate_loss(model, examples, [1, 2], batch_size=2, show_progress=False)
    assert row_reads == [2, 2, 1]
    rows = TokenStore(store, "val")[:5]
    in_memory = Examples([row.tolist() for row in rows], "the same rows")
    alone = evaluate_loss(model, in_memory, [1, 2], batch_size=5, show_progress=False)
    assert {r: streamed[r]["loss"] for r in (1, 2)} == pytest.approx({r: alone[r]["loss"] for r in (1, 2)}, abs=1e-5)


def test_a_limit_beyond_the_split_reads_the_whole_split(workspace):
    examples = load_examples(str(workspace / "math"), limit=10**9)
    assert len(examples) == len(TokenStore(workspace / "math", "val"))


def test_a_store_of_a_larger_vocabulary_is_refused_before_any_row_is_scored(workspace, row_reads):
    examples = load_examples(str(workspace / "math"))
    model = retrofit(tiny_parent("llama", vocab_size=examples.vocabulary - 1), (2, 2, 2))
    with pytest.raises(RecurfitError, match=f"needs a vocabulary of {examples.vocabulary} tokens"):
        loss_sweep(model, examples, recurrences=[1], show_progress=False)
    assert row_reads == []


def test_the_plan_gives_rows_tokens_and_tokens_times_the_deepest_recurrence():
    examples = ragged()  # 4 rows, 28 predicted tokens
    recurrent_plan = sweep_plan(examples, [4, 1, 2], "parent")
    assert "4 rows, 28 predicted tokens" in recurrent_plan
    assert "r = 1,2,4 in one pass of 4 recurrences: 112 tokens × recurrences" in recurrent_plan
    assert "the parent (parent): one pass over the same tokens" in recurrent_plan
    fixed = sweep_plan(examples, None, None)
    assert "one pass (a fixed-depth model)" in fixed and "parent" not in fixed
