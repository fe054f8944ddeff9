"""The depth task: answers right by construction, seeded, split by hop count, test chains never in training."""

import pytest

from recurfit.data.depth_task import examples, paths, queried_paths, split_of
from recurfit.errors import RecurfitError


def resolve(text: str, name: str) -> str:
    """The value of `name` in the program, by following its bindings one hop at a time."""
    binds = dict(statement.split("=") for statement in text.split(".")[0].split(","))
    while not name.isdigit():
        name = binds[name]
    return name


def test_answers_are_the_values_and_hop_counts_of_the_queried_variables():
    for example in examples("train", 50, range(1, 5), seed=3):
        for index, answer, _ in example.answers:
            assert example.text[index] == answer
            assert example.text[index - 1] == "="
            assert resolve(example.text, example.text[index - 2]) == answer
        assert [len(path) - 1 for path in queried_paths(example)] == [h for _, _, h in example.answers]


def test_seeded_and_test_examples_have_the_asked_hop_count():
    assert list(examples("train", 5, [2, 3], seed=1)) == list(examples("train", 5, [2, 3], seed=1))
    assert list(examples("train", 5, [2, 3], seed=1)) != list(examples("train", 5, [2, 3], seed=2))
    for example in examples("test", 20, [7], chains=3):
        assert {hops for _, _, hops in example.answers} == {7}


def test_test_chains_never_appear_in_training():
    test = {path for e in examples("test", 300, range(1, 7), chains=3) for path in queried_paths(e)}
    train = {path for e in examples("train", 3000, range(1, 5)) for path in paths(e).values()}
    assert test and all(split_of(path) == "test" for path in test)
    assert all(split_of(path) == "train" for path in train)
    assert not test & train
    assert 0.08 < sum(split_of(f"{v}{n}") == "test" for v in "0123456789" for n in "abcdefghij") / 100 < 0.2


def test_every_character_is_one_token_for_the_embedded_tokenizer():
    from recurfit.model.loading import load_tokenizer

    tokenizer = load_tokenizer(None)
    for example in examples("train", 20, range(1, 5)):
        assert len(tokenizer(example.text).input_ids) == len(example.text)


def test_too_many_chains_or_an_unknown_split_is_refused():
    with pytest.raises(RecurfitError, match="fewer chains or hops"):
        next(examples("train", 1, [8], chains=4))
    with pytest.raises(RecurfitError, match="Unknown split"):
        next(examples("valid", 1, [2]))


def test_answers_cannot_be_had_by_elimination():
    """Values are drawn per chain: some examples repeat one, so 'the digit not yet given' is not the answer."""
    repeats = sum(len({a for _, a, _ in e.answers}) < 3 for e in examples("train", 200, [2], chains=3))
    assert 0.1 < repeats / 200 < 0.5  # 1 - (9/10)(8/10) = 28 % of examples share a value


def test_all_queries_ask_every_variable_up_to_the_drawn_hop_count():
    for example in examples("train", 50, range(1, 5), chains=2, queries="all", seed=4):
        for index, answer, _ in example.answers:
            assert resolve(example.text, example.text[index - 2]) == answer
        asked = [example.text[index - 2] for index, _, _ in example.answers]
        assert len(asked) == len(set(asked))
        hops = sorted(h for _, _, h in example.answers)
        assert hops.count(1) == 2 and all(hops.count(h) >= hops.count(h + 1) for h in range(1, 4))
        assert [len(path) - 1 for path in queried_paths(example)] == [h for _, _, h in example.answers]
    with pytest.raises(RecurfitError, match="for training examples"):
        next(examples("test", 1, [2], queries="all"))
