"""The training data order: phases of weighted mixtures of token stores, deterministic and resumable.

The stream is one global sequence of rows. A step takes the next `global_batch` rows; every rank walks the
same sequence and reads only its own slice, so 1 process and N processes see the same global batches, and
the stream's whole position (`state_dict`) is a handful of integers saved with each checkpoint.

- Within a store, rows come in a random permutation per epoch, seeded by (seed, store, epoch).
- Between stores of a mixture, rows interleave by smooth weighted round-robin: after any prefix, each store
  has contributed its weight's share to within one row (no random bursts, nothing to re-draw on resume).
- A phase ends after its token budget; the last phase runs until training stops (e.g. healing on prose for
  the first N tokens, then a mixture, as in the paper's two-phase training).
- A store asked for more rows than it holds starts another pass; `repeat_warning` says so before a run starts,
  or refuses the run.
- With `masks` (training's `data.assistant_only_loss`), each row comes with its assistant mask (`next_rows`);
  every store must then have masks (prepared from conversations).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..defaults import DataRepeat
from ..errors import RecurfitError
from .store import TokenStore


@dataclass(frozen=True)
class Phase:
    mixture: Mapping[str, float]  # token-store folder -> weight
    tokens: int | None = None  # budget; None: until training ends (last phase only)


class RowStream:
    """`vocab_size`: token ids must be below it (the model's vocabulary); a row that is not stops the run.
    `masks`: rows come with their assistant masks (`next_rows`)."""

    def __init__(self, phases: Sequence[Phase], seed: int = 0, vocab_size: int | None = None, masks: bool = False):
        if not phases:
            raise RecurfitError("The data config needs at least one source.")
        for index, phase in enumerate(phases):
            if phase.tokens is None and index != len(phases) - 1:
                raise RecurfitError(
                    f"data.phases[{index}] has no token budget; only the last phase may run open-ended."
                )
            if not phase.mixture or any(w <= 0 for w in phase.mixture.values()):
                raise RecurfitError(
                    f"data.phases[{index}] needs sources with positive weights, got {dict(phase.mixture)}."
                )
        self.phases, self.seed, self.vocab_size = list(phases), seed, vocab_size
        self.paths = list(dict.fromkeys(path for phase in phases for path in phase.mixture))
        self.stores = [TokenStore(path, "train") for path in self.paths]
        self.masks = [self._masks(store) for store in self.stores] if masks else None
        for store in self.stores:
            if len(store) == 0:
                raise RecurfitError(
                    f"{store.folder} has no training rows; prepare it again from more text or with a smaller --seq-len."
                )
        lengths = {store.seq_len for store in self.stores}
        if len(lengths) != 1:
            raise RecurfitError(f"All training stores need the same seq_len; got {dict(zip(self.paths, lengths))}.")
        self.seq_len = lengths.pop()
        self._permutations: dict[tuple[int, int], np.ndarray] = {}
        self.position = 0  # rows taken so far, over all phases
        self.phase = 0
        self.phase_start = 0  # position where the current phase began
        self.consumed = [0] * len(self.stores)  # rows taken from each store, over all phases
        self.credit = [0.0] * len(self.stores)

    # ------------------------------------------------------------ order

    def _next(self) -> tuple[int, int]:
        """(store index, row index) of the next row, advancing the stream."""
        phase = self.phases[self.phase]
        if not self._last(self.phase) and (self.position - self.phase_start) >= self._budget_rows(phase):
            self.phase += 1
            self.phase_start = self.position
            self.credit = [0.0] * len(self.stores)
            phase = self.phases[self.phase]
        total = sum(phase.mixture.values())
        for path, weight in phase.mixture.items():
            self.credit[self.paths.index(path)] += weight / total
        source = max((self.paths.index(path) for path in phase.mixture), key=lambda i: (self.credit[i], -i))
        self.credit[source] -= 1.0
        epoch, offset = divmod(self.consumed[source], len(self.stores[source]))
        self.consumed[source] += 1
        self.position += 1
        return source, int(self._permutation(source, epoch)[offset])

    def _last(self, phase: int) -> bool:
        return phase == len(self.phases) - 1

    def _budget_rows(self, phase: Phase) -> int:
        """Rows a phase with a token budget takes: the first that reach its budget."""
        return -(-phase.tokens // self.seq_len)

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._permutations:
            self._permutations = {k: v for k, v in self._permutations.items() if k[0] != source}
            rng = np.random.default_rng([self.seed, source, epoch])
            self._permutations[key] = rng.permutation(len(self.stores[source]))
        return self._permutations[key]

    @staticmethod
    def _masks(store: TokenStore) -> TokenStore:
        if not store.has_masks:
            raise RecurfitError(
                f"data.assistant_only_loss is on, but {store.folder} holds no assistant masks (it was prepared "
                "from plain text): prepare it from conversations (a `messages` field), or set "
                "data.assistant_only_loss=false to train on every token."
            )
        return TokenStore(store.folder, "train", masks=True)

    def next_batch(self, global_rows: int, rank: int = 0, world: int = 1) -> torch.LongTensor:
        """The next `global_rows` rows of the stream; this rank's contiguous share as a (rows/world, L+1) tensor."""
        return self.next_rows(global_rows, rank, world)[0]

    def next_rows(
        self, global_rows: int, rank: int = 0, world: int = 1
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """`next_batch`'s rows, and with masks their assistant masks (a bool tensor of the same shape; else None)."""
        if global_rows % world:
            raise RecurfitError(f"The global batch ({global_rows} rows) must divide among {world} processes.")
        order = [self._next() for _ in range(global_rows)]
        share = global_rows // world
        mine = order[rank * share : (rank + 1) * share]
        rows = np.stack([self.stores[source][row] for source, row in mine])
        if self.vocab_size is not None and rows.max() >= self.vocab_size:  # name the first row at fault
            index = int((rows >= self.vocab_size).any(axis=1).argmax())
            source, row = mine[index]
            self.check_ids(rows[index], self.stores[source].folder, f"train row {row}")
        masks = None
        if self.masks is not None:
            masks = torch.from_numpy(np.stack([self.masks[source][row] for source, row in mine]).astype(bool))
        return torch.from_numpy(rows.astype(np.int64)), masks

    def check_ids(self, ids: np.ndarray, folder, where: str) -> None:
        """An id the model has no embedding for would crash the forward: say which store holds it."""
        if self.vocab_size is not None and len(ids) and int(ids.max()) >= self.vocab_size:
            raise RecurfitError(
                f"{folder} ({where}) holds token id {int(ids.max())}, but the model's vocabulary has "
                f"{self.vocab_size} ids: the store was tokenised for another model or is damaged; prepare it "
                "again with the model's tokenizer (`recurfit data prepare --tokenizer … --force`)."
            )

    # ------------------------------------------------------------ supply

    def rows_asked(self, more_rows: int) -> list[float]:
        """Rows each store will have given once the stream gives `more_rows` more: what it gave so far, and each
        phase's rows to come shared by weight (the round-robin keeps every store within a row of its share)."""
        asked = [float(count) for count in self.consumed]
        position, end, start = self.position, self.position + more_rows, self.phase_start
        for index in range(self.phase, len(self.phases)):
            phase = self.phases[index]
            stop = end if self._last(index) else min(end, start + self._budget_rows(phase))
            total = sum(phase.mixture.values())
            for path, weight in phase.mixture.items():
                asked[self.paths.index(path)] += max(stop - position, 0) * weight / total
            position = start = max(position, stop)
        return asked

    def repeat_warning(self, more_rows: int, repeat: DataRepeat) -> str | None:
        """Whether the next `more_rows` rows read a store more than once, as `data.repeat` wants it said: None
        (`allow`, or every store suffices), a warning (`warn`), or a RecurfitError (`refuse`)."""
        short = [
            f"{store.folder} holds {len(store) * self.seq_len:,} training tokens and the run asks "
            f"{round(asked) * self.seq_len:,} of it ({asked / len(store):.2f} passes)"
            for store, asked in zip(self.stores, self.rows_asked(more_rows))
            if round(asked) > len(store)
        ]
        if not short or repeat == "allow":
            return None
        if repeat == "refuse":
            raise RecurfitError(
                "; ".join(short) + ", and data.repeat is refuse: prepare more text into the store, lower steps "
                "or the phase budgets, or set data.repeat=warn to train on its rows again."
            )
        return (
            "warning: " + "; ".join(short) + ": its rows repeat, in a fresh order each pass (data.repeat=refuse "
            "stops such a run, data.repeat=allow trains without this warning)."
        )

    # ------------------------------------------------------------ resume

    def state_dict(self) -> dict:
        return {
            "paths": self.paths,
            "seed": self.seed,
            "position": self.position,
            "phase": self.phase,
            "phase_start": self.phase_start,
            "consumed": list(self.consumed),
            "credit": list(self.credit),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["paths"] != self.paths or state["seed"] != self.seed:
            raise RecurfitError(
                "The checkpoint was trained on other data (sources or seed differ from the config); "
                "resume with the config it was started with."
            )
        self.position, self.phase, self.phase_start = state["position"], state["phase"], state["phase_start"]
        self.consumed, self.credit = list(state["consumed"]), list(state["credit"])
