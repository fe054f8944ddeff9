"""Validation loss and perplexity as a function of test-time recurrence (`recurfit eval loss`).

A recurrent model is read out at every requested r during one pass through the recurrence
(`RecurrentModel.final_hidden_states_at`): the prelude runs once and the core max(r) times, all readouts from
the same s_0.
A fixed-depth model (the parent) is evaluated once. Data is either a prepared token store (its `val` split,
rows of seq_len + 1, read from the memory map a batch at a time) or any document source `data prepare` accepts,
tokenised here into right-padded windows; padding is masked out of both attention and loss, so a batch gives the
per-row results of its rows alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..data.sources import iter_documents
from ..data.store import META, TokenStore, check_tokenizer
from ..defaults import LOSS_RECURRENCES
from ..errors import RecurfitError
from ..model.modeling import RecurrentForCausalLM
from ..progress import progress_bar
from .results import Row, Sweep


@dataclass
class Examples:
    """Token sequences held in memory (windows of text), each at most `seq_len + 1` long (inputs are all but the
    last token)."""

    sequences: list[list[int]]
    description: str

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def tokens(self) -> int:
        """Predicted tokens: every token of a sequence but its first."""
        return sum(len(s) - 1 for s in self.sequences)

    @property
    def vocabulary(self) -> int:
        """The vocabulary the sequences need: their largest id + 1."""
        return max(max(s) for s in self.sequences) + 1

    def chunks(self, size: int) -> Iterator[list[list[int]]]:
        for start in range(0, len(self.sequences), size):
            yield self.sequences[start : start + size]


@dataclass
class StoreRows:
    """The first `rows` validation rows of a token store, read from the memory-mapped store one batch at a time:
    host memory holds a batch, however large the split (a billion tokens as Python lists would take tens of GB)."""

    store: TokenStore
    rows: int
    description: str

    def __len__(self) -> int:
        return self.rows

    @property
    def tokens(self) -> int:
        """Predicted tokens: `seq_len` of each row of `seq_len + 1`."""
        return self.rows * self.store.seq_len

    @property
    def vocabulary(self) -> int:
        """The vocabulary of the tokenizer that made the store (as training checks it: no row is read)."""
        return self.store.vocab_size

    def chunks(self, size: int) -> Iterator[np.ndarray]:
        for start in range(0, self.rows, size):
            yield self.store[start : min(start + size, self.rows)]


def load_examples(
    source: str, tokenizer=None, seq_len: int = 256, limit: int | None = None, seed: int = 1
) -> Examples | StoreRows:
    """A token store's first `limit` `val` rows (read as they are scored), or documents from `source` cut into
    windows of `seq_len + 1` tokens."""
    if (Path(source) / META).is_file():
        store = TokenStore(source, "val")
        check_tokenizer(source, store.meta, tokenizer)
        if len(store) == 0:
            raise RecurfitError(
                f"{source} has no validation rows (prepared with --val-fraction {store.meta.get('val_fraction', 0)}); "
                "prepare it again with a larger --val-fraction, or pass --data a text source."
            )
        rows = min(limit or len(store), len(store))
        return StoreRows(store, rows, f"{source} (val split, {store.seq_len + 1}-token rows)")
    if tokenizer is None:
        raise RecurfitError(f"{source} is text, not a token store: a tokenizer is needed (the model folder's).")
    sequences = list(islice(_windows(iter_documents(source, seed=seed), tokenizer, seq_len), limit))
    if not sequences:
        raise RecurfitError(f"{source} has no document with at least two tokens to score.")
    return Examples(sequences, f"{source} (documents in windows of ≤ {seq_len + 1} tokens)")


def _windows(documents: Iterator[str], tokenizer, seq_len: int) -> Iterator[list[int]]:
    for text in documents:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        # Consecutive windows share one token, so every token after the document's first is predicted once.
        for start in range(0, max(len(ids) - 1, 0), seq_len):
            yield ids[start : start + seq_len + 1]


def batches(examples: Examples | StoreRows, batch_size: int) -> Iterator[tuple[torch.LongTensor, torch.LongTensor]]:
    """`(input_ids, attention_mask)`, right-padded with zeros."""
    for chunk in examples.chunks(batch_size):
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, sequence in enumerate(chunk):
            ids[row, : len(sequence)] = torch.as_tensor(np.asarray(sequence, dtype=np.int64))
            mask[row, : len(sequence)] = 1
        yield ids, mask


def summed_nll(logits: torch.Tensor, ids: torch.LongTensor, mask: torch.LongTensor) -> torch.Tensor:
    """Per row: the summed negative log-likelihood of each real token given those before it."""
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets, ignore_index=-100, reduction="none")
    return nll.sum(dim=1)


@torch.no_grad()
def sweep_nll(model, ids, mask, steps: Sequence[int] | None, generator=None, initial_state=None) -> dict:
    """`{r: per-row summed NLL}` for a recurrent model (one pass to max(steps)); `{None: …}` for a fixed one."""
    if not isinstance(model, RecurrentForCausalLM):
        return {None: summed_nll(model(input_ids=ids, attention_mask=mask).logits, ids, mask)}
    hidden_at = model.model.final_hidden_states_at(
        ids, steps, attention_mask=mask, initial_state=initial_state, generator=generator
    )
    return {r: summed_nll(model.lm_head(hidden), ids, mask) for r, hidden in hidden_at}


def evaluate_loss(
    model,
    examples: Examples | StoreRows,
    steps: Sequence[int],
    batch_size: int = 8,
    seed: int = 0,
    show_progress: bool = True,
) -> dict:
    """`{r or None: {"loss", "perplexity"}}`: mean NLL per predicted token and its exponential."""
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)  # s_0: the same on every run
    totals: dict = {}
    label = f"loss at r={','.join(map(str, steps))}" if isinstance(model, RecurrentForCausalLM) else "loss"
    with progress_bar(disable=not show_progress) as progress:
        task = progress.add_task(label, total=len(examples))
        for ids, mask in batches(examples, batch_size):
            for r, nll in sweep_nll(model, ids.to(device), mask.to(device), steps, generator).items():
                totals[r] = totals.get(r, 0.0) + nll.sum().item()
            progress.advance(task, len(ids))
    return {
        r: {"loss": total / examples.tokens, "perplexity": math.exp(total / examples.tokens)}
        for r, total in totals.items()
    }


def loss_sweep(
    model,
    examples: Examples | StoreRows,
    *,
    recurrences: Sequence[int] = LOSS_RECURRENCES,
    name: str = "model",
    baseline=None,
    baseline_name: str = "parent",
    batch_size: int = 8,
    seed: int = 0,
    show_progress: bool = True,
) -> Sweep:
    """The loss table: `model` at each test recurrence (once if it is not recurrent), the `baseline` (its
    parent, say) alongside. `name` and `baseline_name` label the rows and the figures' legends."""
    for lm, label in ((model, name), (baseline, baseline_name)):
        if lm is not None:
            _check_vocabulary(lm, examples, label)
    measured = evaluate_loss(model, examples, recurrences, batch_size, seed, show_progress)
    rows = [Row.measured(model, r, metrics) for r, metrics in sorted(measured.items(), key=lambda item: item[0] or 0)]
    parent_row = None
    if baseline is not None:
        (metrics,) = evaluate_loss(baseline, examples, recurrences, batch_size, seed, show_progress).values()
        parent_row = Row.measured(baseline, None, metrics, label=f"parent ({baseline_name})")
    details = {
        "data": examples.description,
        "sequences": len(examples),
        "tokens": examples.tokens,
        "seed": seed,
    }
    return Sweep("loss", name, ["loss", "perplexity"], rows, parent_row, None, details)


def _check_vocabulary(model, examples: Examples | StoreRows, name: str) -> None:
    if examples.vocabulary > model.config.vocab_size:
        raise RecurfitError(
            f"{examples.description} needs a vocabulary of {examples.vocabulary} tokens but {name} has "
            f"{model.config.vocab_size}: it was tokenised for another model. Prepare it with this model's tokenizer "
            "(`recurfit data prepare --tokenizer`)."
        )


def sweep_plan(examples: Examples | StoreRows, recurrences: Sequence[int] | None, baseline_name: str | None) -> str:
    """What a loss sweep will compute, said before it starts: rows, predicted tokens and tokens × recurrences
    (`recurrences` None: a fixed-depth model, read once). Every r is read out of one pass to the largest."""
    tokens = f"{len(examples):,} rows, {examples.tokens:,} predicted tokens"
    if recurrences:
        deepest = max(recurrences)
        at = ",".join(map(str, sorted(recurrences)))
        cost = f"r = {at} in one pass of {deepest} recurrences: {examples.tokens * deepest:,} tokens × recurrences"
    else:
        cost = "one pass (a fixed-depth model)"
    parent = f"; the parent ({baseline_name}): one pass over the same tokens" if baseline_name else ""
    return f"Loss plan: {tokens}; {cost}{parent}."
