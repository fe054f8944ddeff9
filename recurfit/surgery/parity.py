"""Parity: a retrofit against its parent without the dropped layers, max |Δlogit| at each r over real tokens."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..model.layer_inputs import positions_from_mask
from ..model.modeling import RecurrentForCausalLM
from .pruning import pruned_parent

PARITY_TOLERANCE = 1e-4  # max |Δlogit| (fp32) under which a retrofit counts as equal to its pruned parent
PARITY_SAMPLES = (
    "Depth-recurrent language models loop a block of layers to think longer.",
    "The quick brown fox jumps over the lazy dog.",
)


@torch.no_grad()
def parity(parent: PreTrainedModel, model: RecurrentForCausalLM, input_ids, attention_mask=None, steps=(1, 32)):
    """max |Δlogit| between the retrofit at each r and the parent without the dropped layers (real tokens only).

    Low-precision weights are compared through float32 copies: the check is of structure, and a bf16 retrofit keeps
    its stream in float32 (recurfit.model.modeling) where its bf16 parent does not, so the two would differ by
    rounding alone."""
    if model.dtype != torch.float32:
        parent, model = (copy.deepcopy(module).float() for module in (parent, model))
    kept = [i for part in model.config.source_layers.values() for i in part]
    valid = slice(None) if attention_mask is None else attention_mask.bool()
    positions = positions_from_mask(attention_mask, input_ids.shape[1], input_ids.device)
    with pruned_parent(parent, kept) as reference:
        expected = reference(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    expected = expected.logits.float()
    return {
        r: (model(input_ids, attention_mask=attention_mask, num_steps=r).logits.float() - expected)[valid]
        .abs()
        .max()
        .item()
        for r in steps
    }


@dataclass
class ParityCheck:
    """A retrofit against its pruned parent: max |Δlogit| at each r over the real tokens of a padded batch."""

    diffs: dict[int, float]
    rows: int

    @property
    def equal(self) -> bool:
        return max(self.diffs.values()) <= PARITY_TOLERANCE

    def describe(self) -> str:
        per_r = ", ".join(f"r={r}: max |Δlogit| = {d:.1e}" for r, d in self.diffs.items())
        verdict = "✓ equal" if self.equal else "✗ differs"
        return f"Parity with the parent minus its dropped layers (left-padded batch of {self.rows}): {per_r}  {verdict}"


def parity_batch(tokenizer, vocab_size: int) -> dict[str, torch.Tensor]:
    """Two sample sentences, left-padded so the check covers padding; random tokens (one row padded) when there
    is no tokenizer."""
    if tokenizer is None:
        ids = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        return {"input_ids": ids, "attention_mask": mask}
    tokenizer.padding_side = "left"
    return dict(tokenizer(list(PARITY_SAMPLES), return_tensors="pt", padding=True))


@torch.no_grad()
def check_parity(parent: PreTrainedModel, model: RecurrentForCausalLM, tokenizer=None, steps=(1, 32)) -> ParityCheck:
    """`parity` on `parity_batch`: what `recurfit retrofit` and the demo report right after surgery."""
    batch = {
        name: tensor.to(model.device) for name, tensor in parity_batch(tokenizer, parent.config.vocab_size).items()
    }
    return ParityCheck(parity(parent, model, **batch, steps=steps), rows=len(batch["input_ids"]))
