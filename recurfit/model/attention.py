"""SDPA attention for compiled decoding: one query token per row attends over the key/value heads, not copies.

With grouped-query attention (fewer key/value heads than query heads) transformers' `sdpa_attention_forward`
packs a single query token's heads onto its key/value heads (`pack_gqa`: (batch, heads, 1, d) →
(batch, kv heads, heads / kv heads, d)) only when not compiling (`not is_torchdynamo_compiling()`); under
torch.compile with a mask it calls `repeat_kv`, which copies K and V heads / kv heads times over the whole static
buffer at every layer call: for TinyLlama's shape at r = 32 about 1.1 GB a token, more than the weights.

`packed_sdpa_attention_forward` is that function with the packing kept under compile. It is registered with
transformers' `AttentionInterface` (and, for completeness, `AttentionMaskInterface` with SDPA's masks) under
`PACKED_SDPA`, and selected only while a compiled decoding step runs (`packed_sdpa`, entered by
`recurfit.model.compiled.CompiledDecoder`): training, prefill and eager decoding keep transformers' "sdpa".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

PACKED_SDPA = "recurfit_sdpa"


def packed_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that one query token with a mask shared by the heads (the static
    cache's (batch, 1, 1, length)) attends with its heads packed onto the key/value heads, compiled or not."""
    groups = getattr(module, "num_key_value_groups", 1)
    shared_mask = attention_mask is not None and attention_mask.shape[1] == 1
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if query.shape[2] != 1 or groups == 1 or not shared_mask or not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # transformers packs only outside dynamo (`not is_torchdynamo_compiling()`) and repeats K and V under it; here
    # shapes are static and q_length is 1, so the packing (its `pack_gqa`) is safe compiled too. The group's
    # queries take the place of query positions; the mask, shared by all heads, broadcasts over them.
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, heads // groups, groups, dim)
    output = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    # Unpacked as transformers undoes `pack_gqa`: (batch, kv heads, groups, d) → (batch, 1, heads, d).
    return output.reshape(output.shape[0], -1, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention_forward)
# The name builds SDPA's masks too, so that a forward outside the compiled step meeting it (another thread's, on
# the same model) gets the masks "sdpa" would; transformers gives names it has no mask function for no mask at all.
AttentionMaskInterface.register(PACKED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def packed_sdpa(model) -> Iterator[None]:
    """Within the block, the model's SDPA layers attend through `packed_sdpa_attention_forward` (a model with
    another backend is left as it is)."""
    text = model.config.text_config
    if text._attn_implementation != "sdpa":
        yield
        return
    text._attn_implementation_internal = PACKED_SDPA
    try:
        yield
    finally:
        text._attn_implementation_internal = "sdpa"
