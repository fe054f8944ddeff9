"""The head without the whole logits: a forward that stops at the final hidden states, and the head's loss
computed from them a chunk of positions at a time.

At a 128 k vocabulary, a micro-batch of 8 × 4,096 tokens has 8.4 GB of bf16 logits, as much again for their
gradient, and each supervised depth (and the teacher) adds as much. `HeadLoss` never holds more than one
chunk of positions' logits: forward keeps the hidden states (hidden size, not vocabulary, wide) and one
float32 log-sum-exp per position, and backward computes each chunk's logits again.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# Positions whose logits exist at once: 2**24 elements (64 MiB in float32), whatever the vocabulary.
CHUNK_ELEMENTS = 2**24


def chunk_rows(vocab_size: int) -> int:
    """Positions per chunk of the head's losses at this vocabulary size."""
    return max(1, CHUNK_ELEMENTS // vocab_size)


def final_hidden_states(call, model: nn.Module, input_ids: torch.Tensor, **kwargs) -> Readout:
    """`call(input_ids=..., **kwargs)` (the model, or its DDP/FSDP2 wrapper) run without its head's logits: the final
    hidden states (after the final norm), each supervised depth's first (`readout_steps`) and the last depth's
    last, flattened to (positions, hidden), and the head's weight as that forward handed it out (`headless`).

    The body's output is taken from a hook on it, so the same wrapped call serves DDP (whose forward prepares the
    gradients' reduction) and FSDP2 (whose root unit holds the head), for a recurrent model and a baseline."""
    captured = []
    hook = model.get_decoder().register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        with headless(model):
            # No KV cache: a transformers parent builds one whenever its config's use_cache is set, training too, and
            # under torch.compile each layer then recompiles on the cache's state.
            weight = call(input_ids=input_ids, use_cache=False, **kwargs).logits
    finally:
        hook.remove()
    (output,) = captured
    hidden = [*(output.get("readout_hidden_states") or ()), output.last_hidden_state]
    return Readout([states.flatten(0, 1) for states in hidden], weight)


class Readout(NamedTuple):
    hidden: list[torch.Tensor]  # (positions, hidden) per depth read out, the last depth last
    weight: torch.Tensor  # the head's weight as the model's forward handed it out: the loss's path to its gradient


@contextmanager
def headless(model: nn.Module):
    """The model's head computes no logits for the block: it returns its own weight (`HandedOut`), which the model
    hands out as its `logits`, and the loss reads the hidden states through it (`HeadLoss`). Even logits of no
    position would have autocast cast the head's weight and keep that copy for backward.

    The weight comes out of the forward rather than being read off the module afterwards because FSDP2's root
    unit (which holds the head) reduces the head's gradient only after a backward that reaches its forward's
    output: its pre-backward hook sits on that output and queues the reduction of every unit at the backward's
    end. Read off the module, the weight is the same gathered tensor, but when nothing else trains
    (`model.trainable: [head]`) no unit's hook fires, the head's gradient is never reduced and it never trains."""
    head = model.get_output_embeddings()
    head.forward = lambda hidden: HandedOut.apply(head.weight)
    try:
        yield
    finally:
        del head.forward  # the class's forward again


class HandedOut(torch.autograd.Function):
    """A tensor's storage as a tensor of its own, whose gradient is the tensor's: no copy, and not a view (FSDP2
    warns of a view among a unit's outputs, which an in-place operation would cut from its backward hook)."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype the head multiplies in here: autocast's, when autocast is on for this device."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


class HeadLoss(torch.autograd.Function):
    """Mean next-token cross-entropy of `hidden @ weight.T`, and with a teacher (its hidden states and head
    weight) the mean KL(teacher_T ‖ student_T), over chunks of positions, in float32 whatever the logits' dtype.
    With `mask` (bool per position), both are means over the masked positions alone (0 when none is), and the
    others get no gradient: `positions` below is then their count.

    The logits of a chunk are computed in `dtype` (the run's autocast dtype, as `lm_head` under autocast), upcast,
    and dropped; the teacher's log-probabilities likewise, in its own weight's dtype. Backward recomputes them and
    applies, chunk by chunk, what autograd computes through `lm_head` and `log_softmax`:

        d CE / d z   = (softmax(z) - onehot(target)) / positions
        d KL / d z   = (softmax(z / T) · Σ p_teacher - p_teacher) / (T · positions)
        d / d hidden = (d / d z) @ weight,   d / d weight = Σ over chunks (d / d z)ᵀ @ hidden   (float32 sum)
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, teacher_hidden, teacher_weight, temperature: float, dtype, mask=None):
        with torch.autocast(hidden.device.type, enabled=False):
            matrix = weight.to(dtype)
            ce, kl = hidden.new_zeros((), dtype=torch.float32), hidden.new_zeros((), dtype=torch.float32)
            for chunk, logits, teacher in _chunks(hidden, matrix, teacher_hidden, teacher_weight, temperature):
                each = logits.logsumexp(-1) - logits.gather(-1, targets[chunk, None]).squeeze(-1)
                ce += _counted(each, mask, chunk).sum()
                if teacher is not None:
                    each = (teacher.exp() * (teacher - F.log_softmax(logits / temperature, dim=-1))).sum(-1)
                    kl += _counted(each, mask, chunk).sum()
        # Kept for backward in the head's dtype, as autocast's linear keeps its input
        ctx.save_for_backward(hidden.to(dtype), matrix, targets, teacher_hidden, teacher_weight, mask)
        ctx.temperature, ctx.weight_dtype, ctx.hidden_dtype = temperature, weight.dtype, hidden.dtype
        count = _count(hidden, mask)
        return ce / count, kl / count

    @staticmethod
    def backward(ctx, grad_ce, grad_kl):
        hidden, matrix, targets, teacher_hidden, teacher_weight, mask = ctx.saved_tensors
        temperature, count = ctx.temperature, _count(hidden, mask)
        grad_hidden = torch.empty_like(hidden, dtype=ctx.hidden_dtype) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(matrix.shape, dtype=torch.float32, device=matrix.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for chunk, logits, teacher in _chunks(hidden, matrix, teacher_hidden, teacher_weight, temperature):
                grad = logits.softmax(-1)
                grad[torch.arange(grad.shape[0], device=grad.device), targets[chunk]] -= 1
                grad *= grad_ce / count
                if teacher is not None:
                    teacher = teacher.exp()
                    student = (logits / temperature).softmax(-1) * teacher.sum(-1, keepdim=True)
                    grad += (student - teacher) * (grad_kl / (temperature * count))
                if mask is not None:
                    grad.masked_fill_(~mask[chunk, None], 0)
                grad = grad.to(matrix.dtype)  # as autograd's: the gradient of logits in their dtype
                if grad_hidden is not None:
                    grad_hidden[chunk] = grad @ matrix
                if grad_weight is not None:
                    grad_weight += grad.mT @ hidden[chunk]  # summed in float32 over the chunks
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _counted(values: torch.Tensor, mask: torch.Tensor | None, chunk: slice) -> torch.Tensor:
    """A chunk's per-position losses, 0 where `mask` leaves a position out (where, not a product: 0 · inf)."""
    return values if mask is None else values.where(mask[chunk], 0.0)


def _count(hidden: torch.Tensor, mask: torch.Tensor | None):
    """The positions a mean is over: all of them, or the masked ones (at least 1: none gives a loss of 0)."""
    return hidden.shape[0] if mask is None else mask.sum().clamp(min=1).float()


def _chunks(hidden, matrix, teacher_hidden, teacher_weight, temperature):
    """(positions, float32 logits, float32 teacher log-probabilities at `temperature` or None) per chunk."""
    rows = chunk_rows(matrix.shape[0])
    for start in range(0, hidden.shape[0], rows):
        chunk = slice(start, start + rows)
        logits = (hidden[chunk].to(matrix.dtype) @ matrix.mT).float()
        teacher = None
        if teacher_hidden is not None:
            teacher_logits = (teacher_hidden[chunk].to(teacher_weight.dtype) @ teacher_weight.mT).float()
            teacher = F.log_softmax(teacher_logits / temperature, dim=-1)
        yield chunk, logits, teacher


def head_losses(
    hidden, weight, targets, teacher=None, temperature: float = 1.0, mask=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE, KL(teacher_T ‖ student_T)) of the head `weight` read at `hidden` (positions × hidden), per token, in
    float32 (KL not scaled by T², and 0 without a `teacher` = (its hidden states, its head weight)); with `mask`
    (bool per position), the means over the masked positions alone."""
    teacher_hidden, teacher_weight = teacher if teacher is not None else (None, None)
    if teacher_hidden is not None:
        teacher_hidden, teacher_weight = teacher_hidden.detach(), teacher_weight.detach()
    return HeadLoss.apply(
        hidden, weight, targets.flatten(), teacher_hidden, teacher_weight, temperature, compute_dtype(weight), mask
    )
