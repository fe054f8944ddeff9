"""A static KV cache for a depth-recurrent model: every buffer allocated once, written at device-side positions.

`RecurrentCache` grows per token and keeps per-step bookkeeping in Python dicts, which is exact but costs host work
at every layer call. `StaticRecurrentCache` holds a key and a value buffer of shape
`(batch, kv_heads, max_length, head_dim)` per slot, where the slots are, in order:

    prelude layers (P)  |  core layer j at step s (R × max_steps; R for `latest`)  |  coda layers (C)

A forward writes its new tokens' keys at positions `length … length + q - 1` (a tensor on the device), attends over
the whole buffer through a mask built from the positions (causal, padding, sliding window), and advances `length`.
Nothing in a decoding step depends on a host value, so the step compiles to one graph and CUDA graphs can replay it.
Each slot is a tensor of its own, as in transformers' `StaticCache`: a write into a view of one shared buffer is
functionalised by torch.compile into a copy of the whole buffer per layer call (measured on the CPU: the compiled
step 2.8 × slower than eager at r = 32), a write into a graph input is done in place.

The same rules as `RecurrentCache` hold, so greedy tokens are the same:
- `"all"`: one slot per core layer and step. A forward that ran fewer steps than the buffer holds writes its
  latest step's keys into the deeper slots (the latest-step rule), so a later, deeper token reads what the
  dynamic cache would give it.
- `"latest"`: one slot per core layer; every step overwrites the new tokens' entries.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..defaults import CACHE_POLICIES
from .config import RecurrentConfig
from .families import attention_types


class StaticRecurrentCache(Cache):
    is_compileable = False  # transformers' `generate` must not build its own masks for it: the model does

    def __init__(
        self,
        config: RecurrentConfig,
        batch_size: int,
        max_length: int,
        max_steps: int,
        policy: str = "all",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        if policy not in CACHE_POLICIES:
            raise ValueError(f"cache policy must be one of {CACHE_POLICIES}, got {policy!r}.")
        if max_steps < 1 or max_length < 1:
            raise ValueError(
                f"StaticRecurrentCache needs max_steps and max_length >= 1, got {max_steps}, {max_length}."
            )
        super().__init__(layers=[])
        self.policy, self.max_length, self.max_steps = policy, max_length, max_steps
        self.prelude, self.core, self.coda = config.shape
        text = config.text_config
        self.kinds = attention_types(text)
        self.sliding_window = getattr(text, "sliding_window", None)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        core_slots = self.core * (max_steps if policy == "all" else 1)
        shape = (batch_size, text.num_key_value_heads, max_length, head_dim)
        slots = self.prelude + core_slots + self.coda
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(slots)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(slots)]
        # What a forward's layers write to, by part. The core's are the current step's slots, chosen by `begin_step`
        # on the host: a compiled recurrence step reads them from here, so one graph serves every step and every r.
        coda = slice(len(self.keys) - self.coda, len(self.keys))
        self.prelude_keys, self.prelude_values = self.keys[: self.prelude], self.values[: self.prelude]
        self.coda_keys, self.coda_values = self.keys[coda], self.values[coda]
        self.step_keys, self.step_values = self._core_slots(1)
        self.frozen: torch.Tensor | None = None  # rows that keep their latest entries this step (adaptive exit)
        self.latest_keys, self.latest_values = self.step_keys, self.step_values
        self.real = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)  # non-padding positions
        self.length = torch.zeros((), dtype=torch.long, device=device)  # tokens stored (the same for every row)
        # The last position's s_r after each forward (warm starts): a buffer of its own, written in place, because a
        # CUDA graph's outputs are overwritten by its next replay and the next token reads this one's state. float32
        # whatever the weights' dtype: the model keeps its state in float32.
        self.state = torch.zeros(batch_size, 1, text.hidden_size, dtype=torch.float32, device=device)
        self.state_kept = False
        self.steps_stored = 1
        self._new_positions: torch.Tensor | None = None
        self.compiled_step = None  # a recurfit.model.compiled.CompiledDecoder: the model's one-token calls go there
        # recurfit.model.compiled.TokenGraph per (r, prelude): captured with this cache's addresses, freed with it
        self.token_graphs: dict = {}
        self.exit_tracker = (
            None  # recurfit.generation.exit.StaticExitTracker: adaptive exit's buffers, at fixed addresses
        )
        for buffer in (*self.keys, *self.values, self.real, self.length, self.state):
            torch._dynamo.mark_static_address(buffer)  # fixed addresses, read in place by a captured token

    # ------------------------------------------------------------ slots

    def slot(self, layer_idx: int, step: int) -> int:
        """The buffer index (layer, step) reads and writes."""
        if layer_idx < self.prelude:
            return layer_idx
        core_slots = self.core * (self.max_steps if self.policy == "all" else 1)
        if layer_idx >= self.prelude + self.core:
            return layer_idx + core_slots - self.core
        if self.policy == "latest" or step <= 1:
            return layer_idx
        return self.prelude + (step - 1) * self.core + (layer_idx - self.prelude)

    # ------------------------------------------------------------ the model's calls

    def check_device(self, device: torch.device) -> None:
        if self.length.device != device:
            raise ValueError(
                f"The static cache is on {self.length.device} and the model on {device}: build StaticRecurrentCache "
                "with device=model.device (recurfit.model.compiled.decoding_cache does)."
            )

    def begin_forward(self, attention_mask: torch.Tensor | None, new_tokens: int, layer_attention, mask_format):
        """Record the new tokens (their padding from the last `new_tokens` columns of the 2-D `attention_mask`) and
        return their position ids and, per attention kind, the 4-D mask over the whole buffer."""
        positions = self.length + torch.arange(new_tokens, device=self.length.device)
        self._new_positions = positions
        batch = self.real.shape[0]
        new_real = (
            torch.ones(batch, new_tokens, dtype=torch.bool, device=self.real.device)
            if attention_mask is None
            else attention_mask[:, -new_tokens:].to(device=self.real.device, dtype=torch.bool)
        )
        real_before = self.real.sum(-1, keepdim=True)
        self.real.index_copy_(1, positions, new_real)
        # Position ids count each row's real tokens, so left padding does not shift RoPE (as positions_from_mask).
        position_ids = (real_before + new_real.long().cumsum(-1) - 1).clamp(min=0)
        masks = {kind: self._mask(positions, kind, mask_format) for kind in set(layer_attention)}
        return position_ids, masks

    def _mask(self, positions: torch.Tensor, kind: str, mask_format: torch.dtype) -> torch.Tensor:
        """(batch, 1, new tokens, max_length): a new token sees the real tokens at or before it (and itself, so a
        padding row attends somewhere instead of producing NaN), within the sliding window where there is one."""
        keys = torch.arange(self.max_length, device=positions.device)
        query = positions[:, None]
        allowed = (keys[None, :] <= query) & self.real[:, None, :]
        if kind == "sliding_attention" and self.sliding_window:
            allowed = allowed & (keys[None, :] > query - self.sliding_window)
        allowed = (allowed | (keys[None, :] == query))[:, None]
        if mask_format == torch.bool:
            return allowed
        return torch.zeros((), dtype=mask_format, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(mask_format).min
        )

    def begin_step(self, step: int, rows: torch.LongTensor | None = None, frozen: torch.Tensor | None = None) -> None:
        """Before core step `step`: its slots. `frozen` (a bool per row, adaptive exit) marks rows that run the step
        but keep their latest step's entries (the latest-step rule, as `RecurrentCache` writes them): a masked write
        rather than fewer rows, so that the step keeps one shape (one compiled graph, replayable)."""
        if rows is not None:
            raise ValueError(
                "StaticRecurrentCache runs every row at every step: keep settled rows in the batch with `frozen`."
            )
        if step > self.max_steps:
            raise ValueError(f"this StaticRecurrentCache holds {self.max_steps} steps; the forward runs step {step}.")
        self.step_keys, self.step_values = self._core_slots(step)
        self.frozen = frozen
        if frozen is not None:
            # Frozen rows' latest entries are in the step before's slots (the same slots under `latest`). Step 1 has
            # none before it and no frozen row: it reads step 2's, so that no step's slots alias the ones it writes
            # (aliased inputs would make it a graph of its own; a one-step cache decodes at a fixed depth).
            self.latest_keys, self.latest_values = self._core_slots(step - 1 if step > 1 else min(2, self.max_steps))

    def _core_slots(self, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        indices = [self.slot(layer_idx, step) for layer_idx in range(self.prelude, self.prelude + self.core)]
        return [self.keys[i] for i in indices], [self.values[i] for i in indices]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # By part, through lists whose lengths do not depend on max_steps: no compiled graph specialises on r.
        if layer_idx < self.prelude:
            keys, values = self.prelude_keys[layer_idx], self.prelude_values[layer_idx]
        elif layer_idx < self.prelude + self.core:
            keys, values = self.step_keys[layer_idx - self.prelude], self.step_values[layer_idx - self.prelude]
        else:
            keys, values = (
                self.coda_keys[layer_idx - self.prelude - self.core],
                self.coda_values[layer_idx - self.prelude - self.core],
            )
        key_states, value_states = key_states.to(keys.dtype), value_states.to(values.dtype)
        if self.prelude <= layer_idx < self.prelude + self.core and self.frozen is not None:
            core = layer_idx - self.prelude
            keep = self.frozen[:, None, None, None]
            key_states = torch.where(keep, self.latest_keys[core].index_select(2, self._new_positions), key_states)
            value_states = torch.where(
                keep, self.latest_values[core].index_select(2, self._new_positions), value_states
            )
        keys.index_copy_(2, self._new_positions, key_states)
        values.index_copy_(2, self._new_positions, value_states)
        return keys, values

    def end_core(self, steps_run: int) -> None:
        """After the core loop: slots of deeper steps receive the new tokens' latest step (the latest-step rule)."""
        self.frozen = None
        if self.policy == "latest":
            return
        for layer_idx in range(self.prelude, self.prelude + self.core):
            latest = self.slot(layer_idx, steps_run)
            for step in range(steps_run + 1, self.max_steps + 1):
                deeper = self.slot(layer_idx, step)
                for buffer in (self.keys, self.values):
                    buffer[deeper].index_copy_(
                        2, self._new_positions, buffer[latest].index_select(2, self._new_positions)
                    )
        self.steps_stored = max(self.steps_stored, steps_run)

    def end_forward(self) -> None:
        self.length.add_(self._new_positions.numel())

    def keep_final_state(self, state: torch.Tensor) -> None:
        """Keep the last position's s_r (batch, 1, hidden), where the next token's warm start reads it."""
        self.state.copy_(state[:, -1:])
        self.state_kept = True

    @property
    def final_state(self) -> torch.Tensor | None:
        return self.state if self.state_kept else None

    def probe(self, rows=None):
        raise ValueError(
            "StaticRecurrentCache decodes with adaptive exit through its compiled decoder only "
            "(recurfit.model.compiled.decoding_cache)."
        )

    # ------------------------------------------------------------ generation helpers

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (roll back rejected draft tokens): later writes overwrite the rest."""
        self.real[:, length:] = False
        self.length.fill_(length)

    def reset(self) -> None:
        self.real.zero_()
        self.length.zero_()
        self.steps_stored, self.state_kept = 1, False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.length)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_length

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
