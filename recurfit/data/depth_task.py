"""k-hop variable dereferencing, a generated task whose answers take a number of sequential steps.

A program binds single-letter variables in a few independent chains, its statements shuffled; each chain starts
at a digit and every later variable names the one before it. Then one variable of each chain is queried:

    n=c,c=7,u=4,k=n,e=u.k=7,e=4

`k` is three hops from its value (k -> n -> c -> 7), `e` two. The queried variables' values are the answers: one
supervised token per chain, so every example gives several. Chains are independent (distinct names), so an answer
already given never shortens another; each chain's value is drawn on its own (chains may share one), so the
answers cannot be had by elimination either (with distinct values, the last query's answer is the one digit not
yet given, and a model that only learns that scores about 61 % on three chains). Every character is one token
for SmolLM2's tokenizer (the study counts on that, and checks it).

Decontamination by construction: a chain's path (its value, then its names from the root to a variable) falls in
the test or the training part by a hash of the path. Every path of a training example, every prefix of every
chain, is in the training part; every queried path of a test example is in the test part. So no test question's
chain ever appears in training, at any hop count. Test examples are generated per hop count, also above those
trained on.
"""

from __future__ import annotations

import hashlib
import random
import string
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import RecurfitError

NAMES = string.ascii_lowercase
VALUES = string.digits
TEST_SHARE = 8  # one path in TEST_SHARE is held out for testing
SPLITS = ("train", "test")
QUERIES = ("one", "all")  # one query per chain, or every variable of each chain up to the drawn hop count
ATTEMPTS = 64  # draws of a chain before the program is drawn again


@dataclass(frozen=True)
class DepthExample:
    text: str  # the program, ".", then the queries: "n=c,c=7,k=n.k=7"
    answers: tuple[tuple[int, str, int], ...]  # (character index of the answer, the answer, its hop count)

    @property
    def prompt(self) -> str:
        """The text before the first answer: what a model reads to give it."""
        return self.text[: self.answers[0][0]]


def split_of(path: str) -> str:
    """The split a chain's path ("7cnk": value, then names from the root) belongs to, by a hash of the path."""
    digest = hashlib.sha256(path.encode()).digest()
    return "test" if digest[0] % TEST_SHARE == 0 else "train"


def examples(
    split: str,
    count: int,
    hops: list[int] | range,
    chains: int = 4,
    extra: int = 1,
    seed: int = 0,
    queries: str = "one",
) -> Iterator[DepthExample]:
    """`count` examples of `chains` chains each; each chain's queried variable is `hops` hops from its value (drawn
    from `hops` per chain), and the chain runs on for up to `extra` more variables past it (its later variables
    are distractors). With `queries="all"` (training only) every variable of a chain up to the queried one is
    asked, in a shuffled order. The same arguments give the same examples."""
    if split not in SPLITS:
        raise RecurfitError(f"Unknown split {split!r}; the depth task has {', '.join(SPLITS)}.")
    if queries not in QUERIES or (queries == "all" and split != "train"):
        raise RecurfitError(f"queries must be 'one', or 'all' for training examples; got {queries!r} ({split}).")
    longest = max(hops) + extra
    if chains * longest > len(NAMES):
        raise RecurfitError(
            f"{chains} chains of up to {longest} variables need {chains * longest} names; there are "
            f"{len(NAMES)}: use fewer chains or hops."
        )
    rng = random.Random(f"{split}:{seed}")  # a string seed: the two splits' streams are unrelated
    for _ in range(count):
        yield _example(rng, split, list(hops), chains, extra, queries == "all")


def _example(rng: random.Random, split: str, hops: list[int], chains: int, extra: int, every=False) -> DepthExample:
    while not (program := _program(rng, split, hops, chains, extra, every)):
        pass  # the names left could not make a chain of the split: draw the program again
    statements, queries = program
    rng.shuffle(statements)
    if every:
        rng.shuffle(queries)
    text = ",".join(statements) + "."
    answers = []
    for i, (name, value, depth) in enumerate(queries):
        text += ("," if i else "") + f"{name}="
        answers.append((len(text), value, depth))
        text += value
    return DepthExample(text, tuple(answers))


def _program(rng: random.Random, split: str, hops: list[int], chains: int, extra: int, every=False):
    """The statements of `chains` chains and each one's query (name, value, hops) (with `every`, one per variable
    up to the drawn hop count), or None where a chain of the split could not be drawn from the names left."""
    names, values = rng.sample(NAMES, len(NAMES)), [rng.choice(VALUES) for _ in range(chains)]
    statements, queries = [], []
    for value in values:
        depth = rng.choice(hops)
        chain = _chain(rng, split, value, names, depth, depth + rng.randint(0, extra))
        if chain is None:
            return None
        statements += [f"{name}={target}" for name, target in zip(chain, [value, *chain])]
        queries += [(chain[h - 1], value, h) for h in (range(1, depth + 1) if every else [depth])]
    return statements, queries


def _chain(rng: random.Random, split: str, value: str, names: list[str], depth: int, length: int):
    """A chain of `length` names taken from `names` (which it removes) whose paths fit `split` (for training every
    path along it is a training path, for testing the queried one, to `depth`, is a test path), or None after
    `ATTEMPTS` draws that did not fit."""
    for _ in range(ATTEMPTS):
        chain = rng.sample(names, length)
        paths = [value + "".join(chain[:i]) for i in range(1, length + 1)]
        if split == "test":
            fits = split_of(paths[depth - 1]) == "test"
        else:
            fits = all(split_of(path) == "train" for path in paths)
        if fits:
            for name in chain:
                names.remove(name)
            return chain
    return None


def bindings(example: DepthExample) -> dict[str, str]:
    """The program's statements, read back from the text: each variable and what it names (a variable or a value)."""
    program, _ = example.text.split(".", 1)
    return dict(statement.split("=") for statement in program.split(","))


def paths(example: DepthExample) -> dict[str, str]:
    """Every variable's path (value, then names from the root to it), read back from the text."""
    binds = bindings(example)
    found = {}
    for variable in binds:
        name, path = variable, ""
        while name not in VALUES:
            path, name = name + path, binds[name]
        found[variable] = name + path
    return found


def queried_paths(example: DepthExample) -> list[str]:
    """The path of each queried variable."""
    found = paths(example)
    return [found[example.text[index - 2]] for index, _, _ in example.answers]
