"""A KV cache that knows which recurrence it is in.

The attention modules call `cache.update(k, v, layer_idx)`. Prelude and coda layers have one slot each,
as in any decoder. Core layers run once per step, so `RecurrentCache` maps `(layer_idx, step)` to a slot.
The model calls `cache.begin_step(step, rows)` before each core step: `rows` are the batch rows the core
runs on (adaptive depth drops the rows that stopped recurring), and the cache keeps every row's entries.

Policies:
- `"all"`: one slot per core layer per step. A token at step s attends to the earlier tokens' step-s keys:
  exactly what a forward over the whole sequence computes, so cached and uncached generation agree.
- `"latest"`: one slot per core layer, whatever r. A new token's core steps overwrite each other, and
  earlier tokens are seen at their last computed step. Memory is that of a (P + R + C)-layer model, and
  the result is an approximation (its cost is measured in docs/results/cpu-archive.md, "The decoding modes").

The latest-step rule: when a token did not run step s (r changed between calls, or the token exited
early), later tokens that attend at step s read that token's latest computed step. Slots for steps that
did not exist yet start as copies of the deepest existing step. Slots for steps this forward skipped
receive the new tokens' keys from their last computed step. So all slots always cover every token.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..defaults import CACHE_POLICIES
from .compat import SLIDING_LAYERS_ROLL_BACK
from .config import RecurrentConfig
from .families import attention_types


class RecurrentCache(Cache):
    def __init__(self, config: RecurrentConfig, policy: str = "all", rollback: bool = False):
        """`rollback=True` keeps sliding-window layers' older entries until `truncate` (speculative decoding)."""
        if policy not in CACHE_POLICIES:
            raise ValueError(f"cache policy must be one of {CACHE_POLICIES}, got {policy!r}.")
        self.policy = policy
        self.prelude, self.core, self.coda = config.shape
        text = config.text_config
        self.kinds = attention_types(text)
        self.sliding_window = getattr(text, "sliding_window", None)
        super().__init__(layers=[self._new_layer(i, rollback) for i in range(len(self.kinds))])
        self.step = 0  # 1-based core step while the core runs; 0 in the prelude and coda
        self.slots: dict[tuple[int, int], int] = {}  # (core layer index, step >= 2) -> index in self.layers
        self.steps_stored = 1  # steps each core layer has a slot for
        self._before: dict[int, DynamicLayer] = {}  # slot -> its state before this forward
        self._written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> keys/values added this forward
        self._latest: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # core layer -> new tokens' latest keys
        self.rows: torch.LongTensor | None = None  # the batch rows this core step runs on (None: all)
        self.frozen: torch.Tensor | None = None  # rows that run this step but keep their latest entries
        self.final_state: torch.Tensor | None = None  # the last position's s_r after each forward (warm starts)

    def _new_layer(self, layer_idx: int, rollback: bool) -> DynamicLayer:
        """Each step's slot of a core layer is a copy of its layer, rollback setting included."""
        if self.kinds[layer_idx] != "sliding_attention" or not self.sliding_window:
            return DynamicLayer()
        layer = DynamicSlidingWindowLayer(sliding_window=self.sliding_window)
        if not rollback:
            return layer
        if SLIDING_LAYERS_ROLL_BACK:
            layer.activate_past_recording()  # keeps older entries until `truncate` crops
            return layer
        # A layer that keeps every entry rolls back too, and the sliding mask still hides what lies outside the window.
        return DynamicLayer()

    def _is_core(self, layer_idx: int) -> bool:
        return self.prelude <= layer_idx < self.prelude + self.core

    # ------------------------------------------------------------ slots

    def slot(self, layer_idx: int, step: int) -> int:
        """The index in `self.layers` that (layer, step) reads and writes, created on first use."""
        if not self._is_core(layer_idx) or step <= 1 or self.policy == "latest":
            return layer_idx
        key = (layer_idx, step)
        if key not in self.slots:
            # A new depth: earlier tokens never ran it, so it starts as their deepest step (latest-step rule).
            deepest = self.slot(layer_idx, self.steps_stored)
            self.layers.append(copy.copy(self._before.get(deepest, self.layers[deepest])))
            self.slots[key] = len(self.layers) - 1
        return self.slots[key]

    def begin_forward(self) -> None:
        """Called by the model before each forward: remember every slot's state before new tokens arrive."""
        self._before = {index: copy.copy(layer) for index, layer in enumerate(self.layers)}
        self._written, self._latest = {}, {}
        self.rows = None
        self.step = 0

    def begin_step(self, step: int, rows: torch.LongTensor | None = None, frozen: torch.Tensor | None = None) -> None:
        """Called by the model before core step `step` (1-based), which runs on `rows` of the batch (None: all);
        `frozen` (a bool per row) marks rows that run but keep their latest step's entries (adaptive exit)."""
        self.step, self.rows, self.frozen = step, rows, frozen

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        index = self.slot(layer_idx, self.step)
        if torch.is_autocast_enabled(key_states.device.type):
            # Attention reads keys and values in autocast's dtype: storing them in it is exact and halves the cache.
            dtype = torch.get_autocast_dtype(key_states.device.type)
            key_states, value_states = key_states.to(dtype), value_states.to(dtype)
        if self._is_core(layer_idx) and self.step > 1:
            if self.rows is not None:
                # Rows that stopped recurring keep their latest computed step here too (the latest-step rule):
                # the running rows' new entries are scattered into the last step's, over the whole batch.
                key_states = self._latest[layer_idx][0].index_copy(0, self.rows, key_states)
                value_states = self._latest[layer_idx][1].index_copy(0, self.rows, value_states)
            elif self.frozen is not None:  # the same rule, as a masked write (no host wait for the row indices)
                keep = self.frozen[:, None, None, None]
                key_states = torch.where(keep, self._latest[layer_idx][0], key_states)
                value_states = torch.where(keep, self._latest[layer_idx][1], value_states)
            if self.policy == "latest":
                # Step s replaces the new tokens' step s-1 entries: restart from the slot before this forward.
                self.layers[index] = copy.copy(self._before[index])
        if self._is_core(layer_idx):
            self._latest[layer_idx] = (key_states, value_states)
        self._written[index] = (key_states, value_states)
        keys, values = self.layers[index].update(key_states, value_states, *args, **kwargs)
        if self.rows is not None and self._is_core(layer_idx):
            return keys[self.rows], values[self.rows]  # attention runs on the running rows only
        return keys, values

    def end_core(self, steps_run: int) -> None:
        """After the core loop: give slots of steps that were not run the new tokens' latest step."""
        self.step, self.rows, self.frozen = 0, None, None
        if self.policy == "latest":
            return
        for layer_idx in range(self.prelude, self.prelude + self.core):
            latest = self._written[self.slot(layer_idx, steps_run)]
            for step in range(steps_run + 1, self.steps_stored + 1):
                self.layers[self.slot(layer_idx, step)].update(*latest)
        self.steps_stored = max(self.steps_stored, steps_run)

    def end_forward(self) -> None:
        """After the forward (the static cache advances its device-side length here; this one has grown already)."""

    def keep_final_state(self, state: torch.Tensor) -> None:
        """Keep the last position's s_r (batch, 1, hidden) for the next token's warm start."""
        self.final_state = state[:, -1:]

    @contextmanager
    def probe(self, rows: torch.LongTensor | None = None):
        """Run the coda on `rows` of the batch (None: all) for a look at intermediate logits (adaptive exit),
        without keeping what it caches."""
        coda = range(self.prelude + self.core, len(self.kinds))
        saved = {index: copy.copy(self.layers[index]) for index in coda}
        if rows is not None:
            for index in coda:
                self.layers[index].batch_select_indices(rows)  # on the copy in the cache; `saved` is restored
        running, self.step, self.rows = (self.step, self.rows), 0, None
        try:
            yield
        finally:
            self.step, self.rows = running
            for index, layer in saved.items():
                self.layers[index] = layer

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens in every slot (roll back rejected draft tokens)."""
        for layer in self.layers:
            layer.crop(length - layer.get_seq_length())

    def step_slots(self, layer_idx: int) -> list[int]:
        """The slots of a core layer, step 1 first."""
        return [self.slot(layer_idx, step) for step in range(1, self.steps_stored + 1)]

    # ------------------------------------------------------------ reporting

    def memory_bytes(self) -> int:
        """Bytes held by cached keys and values over all slots."""
        return sum(
            tensor.numel() * tensor.element_size()
            for layer in self.layers
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if isinstance(tensor, torch.Tensor)
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if self.layers else 0
