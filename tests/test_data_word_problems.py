"""`data prepare` at scale: token budget, workers, shard tasks, resume after SIGKILL, BOS packing, disk check."""

from __future__ import annotations


def test_the_embedded_math_problems_share_no_ngram_with_any_eval_set():
    from recurfit.data import decontaminate as dc
    from recurfit.data.sources import iter_documents

    index = dc.load(dc.parse_sets("all"))
    problems = list(iter_documents("embedded:math:3000", seed=0))
    assert len(set(problems)) > 2900 and not index.masks(problems).any()
    # The check can fail: the source it replaced (GSM8K test questions with the numbers varied) fails it.
    gsm8k = next(dc.EVAL_SETS["gsm8k"]()).replace("16", "17")
    assert index.masks([gsm8k]).any()
