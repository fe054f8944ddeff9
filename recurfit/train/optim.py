"""Optimisers and the learning-rate schedule (paper appendix "Hyperparameters").

- `muon`: `torch.optim.Muon` for the 2-D hidden matrices (attention, MLP, adapter), AdamW for embeddings,
  the head, norms and biases. Paper: Muon lr 1e-3, AdamW lr 5e-5, weight decay 1e-4.
- `adamw`: `torch.optim.AdamW` for everything.
- `adamw*`: the variant of Geiping et al. the paper compares against (`AdamWStar` below).
- Warmup-stable-decay schedule: linear warmup, constant, linear decay over the last fraction of steps.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from .config import OptimizerConfig


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden matrices for Muon, everything else): embeddings and the head are matrices, but not hidden ones."""
    vocab_matrices = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    matrices, others = [], []
    for parameter in model.parameters():
        if not parameter.requires_grad:
            continue
        hidden_matrix = parameter.ndim == 2 and id(parameter) not in vocab_matrices
        (matrices if hidden_matrix else others).append(parameter)
    return matrices, others


def build_optimizers(model: nn.Module, config: OptimizerConfig) -> list[torch.optim.Optimizer]:
    betas = tuple(config.betas)
    if config.name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=config.lr, betas=betas, weight_decay=config.weight_decay)]
    if config.name == "adamw*":
        return [AdamWStar(model.parameters(), lr=config.lr, betas=betas, weight_decay=config.weight_decay)]
    matrices, others = split_parameters(model)
    muon = GatheringMuon(
        matrices, lr=config.muon_lr, weight_decay=config.weight_decay, momentum=config.muon_momentum
    )
    adamw = torch.optim.AdamW(others, lr=config.lr, betas=betas, weight_decay=config.weight_decay)
    return [muon, adamw]


def warmup_stable_decay(step: int, total: int, warmup: float, decay: float, min_ratio: float = 0.0) -> float:
    """LR multiplier at `step` (0-based). `warmup`/`decay` are fractions of `total`, or step counts if >= 1."""
    warmup_steps = warmup if warmup >= 1 else round(warmup * total)
    decay_steps = decay if decay >= 1 else round(decay * total)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_start = total - decay_steps
    if step >= decay_start and decay_steps > 0:
        progress = (step - decay_start + 1) / decay_steps
        return 1.0 - (1.0 - min_ratio) * min(progress, 1.0)
    return 1.0


def build_schedulers(optimizers, config: OptimizerConfig, total_steps: int) -> list[LambdaLR]:
    def multiplier(step: int) -> float:
        return warmup_stable_decay(step, total_steps, config.warmup, config.decay, config.min_lr_ratio)

    return [LambdaLR(optimizer, multiplier) for optimizer in optimizers]


class GatheringMuon(torch.optim.Muon):
    """`torch.optim.Muon` that is also correct on FSDP2-sharded matrices.

    Newton-Schulz orthogonalises a whole matrix; on a shard it would orthogonalise the wrong thing. For a
    DTensor parameter, each rank gathers the full gradient, updates a full copy of the matrix with Muon's own
    step function (the momentum buffer is kept whole), and keeps its shard of the result. Plain tensors go
    through the parent class unchanged.
    """

    @torch.no_grad()
    def step(self, closure=None):
        if not any(_is_dtensor(p) for group in self.param_groups for p in group["params"]):
            return super().step(closure)
        from torch.distributed.tensor import distribute_tensor
        from torch.optim._muon import _single_tensor_muon

        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                full = parameter.full_tensor() if _is_dtensor(parameter) else parameter.detach()
                grad = parameter.grad.full_tensor() if _is_dtensor(parameter.grad) else parameter.grad
                state = self.state[parameter]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                _single_tensor_muon(
                    [full], [grad], [state["momentum_buffer"]],
                    lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                    nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"],
                    ns_steps=group["ns_steps"], eps=group["eps"], adjust_lr_fn=group["adjust_lr_fn"],
                    has_complex=False,
                )  # fmt: skip
                if _is_dtensor(parameter):
                    # Every rank computed the same full matrix: take the local shard, no communication.
                    shard = distribute_tensor(full, parameter.device_mesh, parameter.placements, src_data_rank=None)
                    parameter.to_local().copy_(shard.to_local())
        return loss


def _is_dtensor(tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


class AdamWStar(torch.optim.Optimizer):
    """AdamW* as the paper describes Geiping et al.'s optimiser:

    - no ε: the update is `atan2(m̂, √v̂)` (Everett et al. 2024), bounded and scale-invariant;
    - update clipping (Wortsman et al. 2023): a tensor's step is divided by max(1, RMS(g²/v̂));
    - decoupled weight decay scaled by the schedule, not by the LR: `p ← p·(1 - λ·lr_t/lr_max)`,
      so λ keeps its meaning whatever the LR (the "fully decoupled" form).
    """

    def __init__(self, params, lr: float = 5e-5, betas=(0.9, 0.95), weight_decay: float = 1e-4):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, peak = group["lr"], group.get("initial_lr", group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                rms = torch.sqrt(torch.mean(torch.where(v_hat > 0, grad.square() / v_hat, torch.zeros_like(v_hat))))
                clipped_lr = lr / max(1.0, rms.item())
                p.mul_(1 - group["weight_decay"] * lr / peak)
                p.add_(torch.atan2(m_hat, v_hat.sqrt()).to(p.dtype), alpha=-clipped_lr)
        return loss


def global_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` (0: no clipping) and return the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm > 0 else math.inf)
