"""Depth per request under vLLM's Model Runner V2 (its default runner on CUDA): the model's own `ModelState`.

Model Runner V2 asks a model for the state it keeps per request (`get_model_state_cls`) and calls it around
every forward: `add_request` with each new request's sampling parameters, `prepare_inputs` with each batch (its
requests' slots and token offsets, on the host), and `prepare_dummy_inputs` for the CUDA-graph capture runs.
`RecurfitModelState` keeps each slot's depth and hands the model each token's depth, and the batch's distinct
depths, as forward arguments (`token_depths`, `depth_stops`). Imported by vLLM's V2 runner only (the V1 runner
carries the depths through recurfit.serving.depth.RequestDepth).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from .depth import TokenDepths, depth_stops, engine_limits


class RecurfitModelState(DefaultModelState):
    """vLLM's default model state, plus each request slot's depth (checked at the frontend, see
    recurfit.serving.depth) and each batch's token depths."""

    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.limits = engine_limits(vllm_config)
        self.slot_depths = np.full(self.max_num_reqs, self.limits.default, dtype=np.int64)
        self.slots: dict[str, int] = {}  # the live requests' slots, by request id
        self.tokens = TokenDepths(self.max_num_tokens, device)

    def add_request(self, req_index: int, new_req_data) -> None:
        super().add_request(req_index, new_req_data)
        params = new_req_data.sampling_params
        self.slot_depths[req_index] = self.limits.served_depth(params.extra_args if params is not None else None)
        self.slots[new_req_data.req_id] = req_index

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        self.slots.pop(req_id, None)

    def prepare_inputs(self, input_batch, req_states) -> dict[str, Any]:
        """The default inputs, and each token's depth from its request's slot (`idx_mapping_np`) and offsets
        (`query_start_loc_np`), both on the host: no device sync. A batch of no live request is one of vLLM's
        dummy runs (profiling, warm-up, data-parallel padding): one step. A batch that mixes
        live requests with unknown ones is an error, not a warm-up."""
        inputs = super().prepare_inputs(input_batch, req_states)
        num_reqs, padded = input_batch.num_reqs, input_batch.num_tokens_after_padding
        known = [req_id in self.slots for req_id in input_batch.req_ids[:num_reqs]]
        if not any(known):
            return {**inputs, "token_depths": self.tokens.warm_up(padded), "depth_stops": None}
        if not all(known):
            unknown = [r for r, k in zip(input_batch.req_ids, known) if not k]
            raise RuntimeError(f"recurfit on vLLM: a batch holds requests this model state never saw: {unknown}.")
        rows = self.slot_depths[input_batch.idx_mapping_np[:num_reqs]]
        lengths = np.diff(input_batch.query_start_loc_np[: num_reqs + 1])
        per_token = np.repeat(rows, lengths)[: input_batch.num_tokens]
        return {**inputs, "token_depths": self.tokens.write(per_token, padded), "depth_stops": depth_stops(rows)}

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        """CUDA-graph capture: one step (every piece captured), depths in the buffer real batches write."""
        inputs = super().prepare_dummy_inputs(num_reqs, num_tokens)
        return {**inputs, "token_depths": self.tokens.warm_up(num_tokens), "depth_stops": None}
