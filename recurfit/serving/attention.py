"""A core layer's attention at any step: one compiled core step runs whichever step's vLLM `Attention` (KV cache) the
step loop chose, and attends for the requests still short of their depth only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.utils import PAD_SLOT_ID

from .depth import runs_model_runner_v2

# The core layers' attention op: which step's KV cache it uses is chosen when it runs, so vLLM's piecewise graphs
# split there, as at its own attention (`pieces.split_at_stepped_attention`).
STEPPED_ATTENTION = "recurfit::stepped_attention"
# The attention backends whose metadata `RecurringRequests` narrows to some of a batch's requests (its fields read,
# its builder run, as the tests check), by backend name, with their metadata's type; a backend not named here
# attends over every token of the batch at every step.
NARROWED_BACKENDS = {
    "CPU_ATTN": "CPUAttentionMetadata",
    "FLASH_ATTN": "FlashAttentionMetadata",
    "TRITON_ATTN": "TritonAttentionMetadata",
}


def check_v1_backend(vllm_config: VllmConfig, per_request: bool, backend: str) -> None:
    """Under the V1 runner each token's depth comes from its request's offsets in the attention metadata
    (`query_start_loc`), which these backends' metadata carries and others' (FlashInfer's) does not: refused at
    model load when requests have depths of their own, rather than failing on the first request."""
    if per_request and not runs_model_runner_v2(vllm_config) and backend not in NARROWED_BACKENDS:
        raise ValueError(
            f"recurfit on vLLM: the V1 runner finds each token's request in the attention metadata's "
            f"query_start_loc, which {backend}'s lacks: serve with --attention-backend FLASH_ATTN (or TRITON_ATTN), "
            "or on Model Runner V2 (unset VLLM_USE_V2_MODEL_RUNNER=0)."
        )


@torch.library.custom_op(STEPPED_ATTENTION, mutates_args=("output",))
def stepped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer: str
) -> None:
    """A core layer's attention at the current step, written into `output`: opaque to the compiler, so that one
    compiled core step runs whichever step's `Attention` (KV cache) the step loop chose (`SteppedAttention.step`)
    when it is called.

    It runs between two segments of vLLM's piecewise CUDA graphs, and a segment's graph replays reading the
    addresses it was captured with. So, as vLLM's own `unified_attention_with_output`, it returns nothing and writes
    into an `output` allocated inside the compiled region (a fixed address under graphs); a tensor it returned would
    be allocated anew at each replay, and the next segment would read the one of its capture."""
    attended = get_forward_context().no_compile_layers[layer].attend(query, key, value)
    output[: attended.shape[0]].copy_(attended)  # a padded step's padding rows: never read


@stepped_attention.register_fake
def _(query, key, value, output, layer) -> None:
    return None


class SteppedAttention(nn.Module):
    """Stands in for a core layer's vLLM `Attention`: runs the one for the current step (`step`, 0-based), through
    `stepped_attention`, which finds it by its `layer_name` in the engine's forward context.

    A step that runs the core on some rows only (`rows`: the tokens not yet at their depth) gets their queries,
    keys and values; where the backend's metadata is not narrowed, attention runs on every token of the batch, the
    other tokens with the keys and values they had at their last step (`keep`), so what they write is what they
    wrote then (recurfit's latest-step rule), and only the rows' outputs go back."""

    def __init__(self, steps: list[nn.Module], vllm_config: VllmConfig):
        super().__init__()
        self.steps = nn.ModuleList(steps)
        self.layer_name = f"{steps[0].layer_name}.stepped"
        vllm_config.compilation_config.static_forward_context[self.layer_name] = self
        self.step = 0
        self.rows: torch.Tensor | None = None
        self.keep: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tracking = False  # keep each token's latest keys and values (steps on some rows only, or exit)
        self.tracked: torch.Tensor | None = None  # narrowed: the rows of the batch a step's keys are (None: all)
        self.owned = False  # under CUDA graphs: a graph's outputs are overwritten by the next replay, `keep` copies
        self.frozen: torch.Tensor | None = None  # a bool per row: stopped by its exit rule, kept as it was (exit)

    def forward(self, query, key, value):
        output = torch.empty_like(query)  # attention's output has the queries' shape (heads × head size)
        stepped_attention(query, key, value, output, self.layer_name)
        return output

    def attend(self, query, key, value):
        """The step's attention; a step padded to a captured graph size gets its tokens in the first rows (`rows`
        or `tracked` of them), the rest padding, which the narrowed metadata leaves out (`num_actual_tokens`)."""
        attention = self.steps[self.step]
        if self.frozen is not None and self.keep is not None:  # (none is frozen before a first step has run)
            key, value = self._frozen_keep_theirs(key, value)
        if self.rows is None:
            if self.tracking and self.tracked is not None:
                tokens = self.tracked.numel()
                key_value = zip(self.keep, (key[:tokens], value[:tokens]))
                self.keep = tuple(kept.index_copy(0, self.tracked, new) for kept, new in key_value)
            elif self.tracking:
                self.keep = (key.clone(), value.clone()) if self.owned else (key, value)
            return attention(query, key, value)
        rows, (kept_key, kept_value) = self.rows, self.keep
        tokens = rows.numel()
        key = kept_key.index_copy(0, rows, key[:tokens])
        value = kept_value.index_copy(0, rows, value[:tokens])
        self.keep = (key, value)
        full_query = query.new_zeros((key.shape[0], *query.shape[1:])).index_copy(0, rows, query[:tokens])
        return attention(full_query, key, value)[rows]

    def _frozen_keep_theirs(self, key, value):
        """`key` and `value` with the tokens that stopped by their exit rule but are still in the step's rows
        (`frozen`, a bool per row) given the keys and values of their last step, so that what they write and what
        later tokens read is that step's (recurfit's latest-step rule)."""
        tokens = self.frozen.numel()
        chosen = self.tracked if self.tracked is not None else self.rows
        mask = self.frozen.view(-1, *([1] * (key.dim() - 1)))
        theirs = []
        for new, kept in zip((key, value), self.keep):
            last = kept[:tokens] if chosen is None else kept[chosen]
            theirs.append(torch.cat([torch.where(mask, last, new[:tokens]), new[tokens:]]))
        return theirs


class RecurringRequests:
    """Recurrence steps' attention over the requests still short of their depth only (eager forwards).

    vLLM describes a batch to its attention backend once per forward: per layer, in the forward context, the
    backend's metadata (requests' query offsets, context lengths, block tables) and the cache slot of each token.
    Once some requests have reached their depth (`narrow_to`), `only` puts in place a description of the others,
    built from the batch's by the backend's own metadata builder: the requests past their depth then neither attend
    nor write keys and values, and their caches keep what their last step wrote (recurfit's cache policies: a step
    past a request's depth is never read by it, and a cached prefix is never shared between depths)."""

    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config
        self.builders: dict = {}
        self.narrowed: dict[int, object] = {}  # per KV cache group (its layers share metadata and slots), built once
        self.depths = self.rows = self.size = None
        self.step = 0

    @staticmethod
    def narrowable(layer_name: str) -> bool:
        """Whether this forward's metadata for `layer_name` is of a backend `only` can narrow."""
        metadata = get_forward_context().attn_metadata
        return isinstance(metadata, dict) and type(metadata.get(layer_name)).__name__ in NARROWED_BACKENDS.values()

    def narrow_to(self, depths: torch.Tensor, step: int, rows: torch.Tensor, size: int | None = None) -> None:
        """From now on, `only` describes the requests deeper than `step` (their tokens: `rows`), for steps padded
        to `size` tokens (a captured graph's) when given."""
        self.depths, self.step, self.rows, self.size, self.narrowed = depths, step, rows, size, {}

    @contextlib.contextmanager
    def only(self, layer_names: list[str]) -> Iterator[None]:
        """Within the block, `layer_names` attend for the requests `narrow_to` chose."""
        context = get_forward_context()
        metadata, slots = context.attn_metadata, context.slot_mapping
        saved = {name: (metadata[name], slots.get(name)) for name in layer_names}
        try:
            for name, (whole, slot) in saved.items():
                if id(whole) not in self.narrowed:
                    self.narrowed[id(whole)] = self._narrow(name, whole, self.depths, self.step, self.rows)
                metadata[name] = self.narrowed[id(whole)]
                if slot is not None:
                    if id(slot) not in self.narrowed:
                        self.narrowed[id(slot)] = self._slots(slot)
                    slots[name] = self.narrowed[id(slot)]
            yield
        finally:
            for name, (whole, slot) in saved.items():
                metadata[name] = whole
                if slot is not None:
                    slots[name] = slot

    def _slots(self, slot: torch.Tensor) -> torch.Tensor:
        """The cache slots of the rows' tokens, then `PAD_SLOT_ID` for a padded step's padding tokens, which the
        cache writes skip: vLLM's runner pads a batch's slots so (`BlockTable`'s slot mapping), and a backend may
        write as many tokens as the keys it is handed (the CPU backend's `cpu_attn_reshape_and_cache` does)."""
        narrowed = slot[self.rows]
        padding = (self.size or 0) - narrowed.numel()
        return narrowed if padding <= 0 else torch.cat([narrowed, narrowed.new_full((padding,), PAD_SLOT_ID)])

    def _narrow(self, layer_name: str, whole, depths: torch.Tensor, step: int, rows: torch.Tensor):
        """`whole`'s metadata for the requests whose depth exceeds `step`, built by the backend's own builder."""
        common = narrowed_description(whole, depths, step, rows)
        return self._builder(layer_name, whole).build(common_prefix_len=0, common_attn_metadata=common)

    def _builder(self, layer_name: str, whole):
        """The backend's metadata builder for layers like `layer_name` (one per metadata type and window)."""
        layer = get_forward_context().no_compile_layers[layer_name]
        key = (type(whole), layer.sliding_window)
        if key not in self.builders:
            spec = layer.get_kv_cache_spec(self.vllm_config)
            builder = layer.attn_backend.get_builder_cls()
            self.builders[key] = builder(spec, [layer_name], self.vllm_config, whole.query_start_loc.device)
        return self.builders[key]


def narrowed_description(whole, depths: torch.Tensor, step: int, rows: torch.Tensor) -> CommonAttentionMetadata:
    """The description vLLM's builders take (`CommonAttentionMetadata`) of the requests of a batch whose depth exceeds
    `step`, from the batch's backend metadata `whole` (its `query_start_loc`, `seq_lens`, `block_table`,
    `slot_mapping` and `causal`, which the backends of `NARROWED_BACKENDS` all keep): each request's tokens are
    contiguous, `depths` gives each token's depth and `rows` lists the kept requests' tokens in order."""
    starts = whole.query_start_loc
    requests = (depths[starts[:-1]] > step).nonzero().squeeze(1)
    lengths = (starts[1:] - starts[:-1])[requests]
    query_start_loc = starts.new_zeros(requests.numel() + 1)
    torch.cumsum(lengths, 0, out=query_start_loc[1:])
    seq_lens = whole.seq_lens[requests]
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.cpu(),
        seq_lens=seq_lens,
        num_reqs=requests.numel(),
        num_actual_tokens=rows.numel(),
        max_query_len=int(lengths.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=whole.block_table[requests],
        slot_mapping=whole.slot_mapping[rows],
        causal=whole.causal,
    )
