"""Optimisers and the learning-rate schedule, as the paper's authors ran them (appendix "Hyperparameters").

- `muon`: Muon (`torch.optim.Muon`, Keller Jordan's update) for the 2-D hidden matrices (attention, MLP,
  adapter), AdamW for embeddings, the head, norms and biases: the authors' `MuonWithAuxAdam` setup. Paper:
  Muon lr 1e-3, AdamW lr 5e-5, weight decay 1e-4 on both; the auxiliary Adam's ε is Keller's 1e-10.
  `optimizer.muon_fused` orthogonalises each attention's q,k,v and each MLP's gate,up as one matrix, as
  Muon saw them in the authors' checkpoints (fused `Wqkv` and `fc` weights).
- `adamw`: `torch.optim.AdamW` for everything.
- `adamw*`: the AdamW variant of Geiping et al. the paper compares against (`AdamWStar` below).
- Schedule: transformers' warmup-stable-decay (`get_wsd_schedule`): linear warmup from `min_lr_ratio`,
  constant, then a cosine (or linear, 1-sqrt) decay to `min_lr_ratio` over the last `decay` steps.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from transformers.optimization import get_wsd_schedule

from .config import OptimizerConfig

# The auxiliary Adam's ε in Keller Jordan's MuonWithAuxAdam, which the authors' Muon runs used.
MUON_AUX_ADAM_EPS = 1e-10
# torch.optim.AdamW's default, and the authors' `optim_config` ε for their AdamW runs.
ADAMW_EPS = 1e-8

# Projections that the authors' checkpoints stored as one matrix, rows stacked in this order:
# attention `Wqkv` = [q; k; v] and MLP `fc` = [gate; up].
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden matrices for Muon, everything else): embeddings and the head are matrices, but not hidden ones."""
    vocab_matrices = {
        id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
    }
    matrices, others = [], []
    for parameter in model.parameters():
        if not parameter.requires_grad:
            continue
        hidden_matrix = parameter.ndim == 2 and id(parameter) not in vocab_matrices
        (matrices if hidden_matrix else others).append(parameter)
    return matrices, others


def fused_matrices(model: nn.Module, matrices: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Each attention's [q, k, v] and each MLP's [gate, up] weights, where all of them are in `matrices`."""
    members = {id(p) for p in matrices}
    units = []
    for module in model.modules():
        for names in FUSED_PROJECTIONS:
            layers = [getattr(module, name, None) for name in names]
            if not all(isinstance(layer, nn.Linear) for layer in layers):
                continue
            weights = [layer.weight for layer in layers]
            if all(id(w) in members for w in weights) and len({w.shape[1] for w in weights}) == 1:
                units.append(weights)
    return units


def adam_eps(config: OptimizerConfig) -> float:
    if config.eps is not None:
        return config.eps
    return MUON_AUX_ADAM_EPS if config.name == "muon" else ADAMW_EPS


def build_optimizers(model: nn.Module, config: OptimizerConfig) -> list[torch.optim.Optimizer]:
    """The optimizers of the trainable parameters; frozen ones (`requires_grad` False) are in none of them. Under
    muon both optimizers exist even when one has nothing to update (an adapter-only run leaves AdamW empty), so
    the log's LRs and a checkpoint's optimizer list keep one layout."""
    betas = tuple(config.betas)
    adamw = dict(lr=config.lr, betas=betas, eps=adam_eps(config), weight_decay=config.weight_decay)
    if config.name in ("adamw", "adamw*"):
        trainable = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        if config.name == "adamw":
            return [torch.optim.AdamW(trainable, **adamw)]
        return [AdamWStar(trainable, lr=config.lr, betas=betas, weight_decay=config.weight_decay)]
    matrices, others = split_parameters(model)
    # A param group, not a bare list: torch refuses an empty parameter list, but not an empty group.
    muon = BatchedMuon(
        [{"params": matrices}],
        ns_dtype=newton_schulz_dtype(config.muon_dtype, next(model.parameters()).device),
        lr=config.muon_lr,
        weight_decay=config.weight_decay,
        momentum=config.muon_momentum,
        fused=fused_matrices(model, matrices) if config.muon_fused else (),
    )
    return [muon, torch.optim.AdamW([{"params": others}], **adamw)]


def build_schedulers(optimizers, config: OptimizerConfig, total_steps: int) -> list[LambdaLR]:
    """transformers' warmup-stable-decay schedule, one per optimizer (each scales its own base LR).

    The multiplier at 0-based step s, with W warmup and D decay steps out of T, and m = min_lr_ratio:
    m + (1 - m)·s/W while s < W; 1 until T - D; then m + (1 - m)·f(p), p = (s - (T - D))/D, with
    f = (1 + cos πp)/2, 1 - p or 1 - √p. So the first step runs at m·lr (when W > 0), and the last decay
    step just above m·lr. D = 0 keeps the LR constant after warmup.
    """
    warmup, decay = config.schedule_steps(total_steps)
    return [
        get_wsd_schedule(
            optimizer,
            num_warmup_steps=warmup,
            num_decay_steps=decay,
            num_training_steps=total_steps,
            warmup_type="linear",
            decay_type=config.decay_shape,
            min_lr_ratio=config.min_lr_ratio,
        )
        for optimizer in optimizers
    ]


def advance(schedulers: list[LambdaLR], step: int) -> None:
    """Set `schedulers` (and their optimizers' LRs) to where they stand after `step` optimizer steps, as if they had
    stepped that often: a run that continues another's schedule (model.continue_schedule) starts there."""
    for scheduler in schedulers:
        scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": no update is skipped here
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()


class BatchedMuon(torch.optim.Muon):
    """`torch.optim.Muon`'s update, with Newton–Schulz batched over same-shaped matrices, in a chosen precision,
    on groups of matrices fused as one, and on FSDP2 shards.

    - `ns_dtype`: the precision of the orthogonalisation. torch's Muon always uses bfloat16, which CPUs without
      native bf16 matrix instructions emulate about 50–100× slower than float32 (see `newton_schulz_dtype`).
      In bfloat16 the update equals `torch.optim.Muon`'s bit for bit (tested).
    - Batching: every step's matrices of one (oriented) shape go through Newton–Schulz together as one batched
      matmul (`torch.baddbmm`), in chunks of at most `NS_BATCH_ELEMENTS`: fewer, larger kernels.
    - `fused`: lists of parameters (each a list of matrices with the same number of columns, e.g. an
      attention's q, k, v weights) that are updated as their row-wise concatenation: momentum (elementwise,
      so each parameter keeps its own buffer), Newton-Schulz on the concatenated matrix, Muon's
      √max(1, rows/cols) LR scale of the concatenated shape, weight decay. This equals `torch.optim.Muon`
      stepping one parameter that is the concatenation.
    - FSDP2: Newton-Schulz orthogonalises a whole matrix; on a shard it would orthogonalise the wrong thing. For
      DTensor parameters the momentum stays sharded (elementwise: each process updates its shard), each
      momentum-updated matrix is gathered, and one process orthogonalises it, the units dealt out round robin
      (as distributed Muon implementations share the work); the owner then scatters each process its shard of
      the update. Every process orthogonalises 1/W of the matrices, not all of them. Under HSDP the same happens
      within each copy of the model, along the mesh's shard dimension (1/shard size of the matrices each).
    """

    def __init__(self, params, *, fused=(), ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        group_of = {id(p): index for index, group in enumerate(self.param_groups) for p in group["params"]}
        self.fused: list[list[torch.Tensor]] = []
        self._unit_of: dict[int, int] = {}
        for unit in fused:
            unit = list(unit)
            if len(unit) < 2:
                continue
            if any(id(p) not in group_of for p in unit):
                raise ValueError("BatchedMuon: a fused group holds a parameter this optimizer does not update.")
            if len({group_of[id(p)] for p in unit}) != 1 or len({p.shape[1] for p in unit}) != 1:
                raise ValueError("BatchedMuon: a fused group needs one param group and equal column counts.")
            if any(id(p) in self._unit_of for p in unit):
                raise ValueError("BatchedMuon: a parameter is in two fused groups.")
            for p in unit:
                self._unit_of[id(p)] = len(self.fused)
            self.fused.append(unit)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dealt = 0  # units dealt out so far, round robin over the processes
        for group in self.param_groups:
            units = [[p for p in unit if p.grad is not None] for unit in self._units(group)]
            # Chunk by chunk, so the extra memory is one chunk's updates, not one of every matrix.
            for chunk in same_shape_chunks([unit for unit in units if unit]):
                owners = [_owner(unit, dealt + index) for index, unit in enumerate(chunk)]
                dealt += len(chunk)
                updates = [self._momentum_update(group, unit) for unit in chunk]  # FSDP2: gathered everywhere
                mine = [update for update, unit, owner in zip(updates, chunk, owners) if owner == _rank(unit)]
                del updates
                orthogonal = iter(
                    newton_schulz(
                        torch.stack(mine), group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype
                    ).unbind()
                    if mine
                    else ()
                )
                for unit, owner in zip(chunk, owners):
                    update = next(orthogonal) if owner == _rank(unit) else None
                    self._apply(group, unit, update, owner)
        return loss

    def _units(self, group):
        """The group's parameters in order, each fused group once, at its first member."""
        done = set()
        for p in group["params"]:
            index = self._unit_of.get(id(p))
            if index is None:
                yield [p]
            elif index not in done:
                done.add(index)
                yield self.fused[index]

    def _momentum_update(self, group, unit: list[torch.Tensor]) -> torch.Tensor:
        """Nesterov momentum as torch's Muon computes it, per parameter (on its shard, under FSDP2); a fused unit's
        rows concatenated. FSDP2: the whole matrix, gathered (a collective: every process calls it)."""
        momentum, updates = group["momentum"], []
        for p in unit:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buffer = state["momentum_buffer"]
            buffer.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            updates.append(update.full_tensor() if _is_dtensor(update) else update)
        return updates[0] if len(updates) == 1 else torch.cat(updates)

    @staticmethod
    def _apply(group, unit: list[torch.Tensor], update: torch.Tensor | None, owner: int) -> None:
        """Decoupled weight decay, then the update at Muon's shape-adjusted LR (of the unit's whole shape).
        FSDP2: the `owner` process's `update` (None elsewhere) is scattered, each process receiving its shard."""
        lr = float(group["lr"])
        shape = (sum(p.shape[0] for p in unit), unit[0].shape[1])
        adjusted_lr = muon_lr_scale(group["adjust_lr_fn"], shape) * lr
        if update is None:  # another process's: a buffer of the whole shape to receive into
            update = torch.empty(shape, dtype=unit[0].dtype, device=unit[0].device)
        else:  # Newton-Schulz's dtype (bf16) to the parameters': the scatter sends it into buffers of that dtype
            update = update.to(unit[0].dtype)
        for p, part in zip(unit, update.split([p.shape[0] for p in unit])):
            if _is_dtensor(p):
                from torch.distributed.tensor import distribute_tensor

                mesh, placement = _sharding(p)
                part = distribute_tensor(part, mesh, [placement], src_data_rank=owner).to_local()
                p = p.to_local()
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(part, alpha=-adjusted_lr)


# Newton–Schulz stacks at most this many elements per batched matmul (16 MiB in float32). Larger stacks are
# slower on a CPU (measured in docs/results/cpu-training.md): each temporary of hundreds of MB
# is a fresh mapping whose pages the kernel zeroes. A GPU gains from batching small matrices (fewer launches);
# a 1B model's large ones go one at a time either way.
NS_BATCH_ELEMENTS = 2**22


def same_shape_chunks(units: list[list[torch.Tensor]]) -> list[list[list[torch.Tensor]]]:
    """The units (a matrix, or a fused group as its row-wise concatenation) in chunks of one shape and device,
    each of at most NS_BATCH_ELEMENTS elements (one unit if a single one is larger)."""
    by_shape: dict[tuple, list] = {}
    for unit in units:
        shape = (sum(p.shape[0] for p in unit), unit[0].shape[1])
        by_shape.setdefault((shape, unit[0].device), []).append(unit)
    chunks = []
    for (shape, _), members in by_shape.items():
        per_chunk = max(1, NS_BATCH_ELEMENTS // math.prod(shape))
        chunks += [members[start : start + per_chunk] for start in range(0, len(members), per_chunk)]
    return chunks


def newton_schulz(batch: torch.Tensor, coefficients, steps: int, eps: float, dtype) -> torch.Tensor:
    """Orthogonalise each matrix of a (batch, m, n) stack as `torch.optim.Muon` does (its quintic iteration,
    its normalisation, a tall matrix transposed first), as batched matmuls in `dtype`."""
    a, b, c = coefficients
    x = batch.to(dtype)
    tall = batch.shape[-2] > batch.shape[-1]
    if tall:  # a transposed view, as torch's Muon: the matmuls then see the same layout and round the same
        x = x.mT
    # Spectral norm at most 1: divide by the Frobenius norm.
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def newton_schulz_flops(muon: BatchedMuon) -> float:
    """FLOPs of one step's orthogonalisations: per m×n matrix (m ≤ n; a fused unit is one matrix), each
    iteration costs 4m²n (X Xᵀ, and the product with X) + 2m³ (the Gram matrix squared)."""
    total = 0.0
    for group in muon.param_groups:
        for unit in muon._units(group):
            m, n = sorted((sum(p.shape[0] for p in unit), unit[0].shape[1]))
            total += group["ns_steps"] * (4 * m * m * n + 2 * m**3)
    return total


def muon_lr_scale(adjust_lr_fn: str | None, shape) -> float:
    """torch's Muon LR adjustment: √max(1, rows/cols) (Keller Jordan's), or 0.2·√max(rows, cols) (Moonshot's)."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def newton_schulz_dtype(setting: str, device: torch.device) -> torch.dtype:
    """`optimizer.muon_dtype`: `auto` is bfloat16 on GPUs and on CPUs with native bf16 matmul, float32 otherwise."""
    if setting != "auto":
        return getattr(torch, setting)
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.bfloat16


def trains_in_bf16(precision: str, device_type: str) -> bool:
    """`precision`: `auto` is bf16 autocast on GPUs and on CPUs with native bf16 matmul (there the demo trains in
    0.6× fp32's time with the same results: docs/results/cpu.md, "The demo's time per CPU kind"), fp32 on other
    CPUs, where torch would emulate bf16."""
    if precision != "auto":
        return precision == "bf16"
    return device_type != "cpu" or cpu_has_native_bf16()


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below its first ISA with bf16 dot products (AVX512_CORE_BF16).
ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX) and the libraries may use it.
    Without it, torch emulates bf16 matmul, here 100× slower than float32 (AVX2 on an AMD EPYC)."""
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    aten_capped = not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    onednn_capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in ONEDNN_ISAS_WITHOUT_BF16
    return hardware and not aten_capped and not onednn_capped


def _is_dtensor(tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def _sharding(tensor) -> tuple:
    """(the 1-D mesh a DTensor is sharded along, its placement there): FSDP2's mesh, or HSDP's shard dimension. Its
    other dimensions hold equal copies (HSDP's replicate dimension: its gradients are all-reduced before the step),
    which each update alike, so Muon deals its work along the shard dimension within each copy."""
    mesh, placements = tensor.device_mesh, tensor.placements
    if mesh.ndim == 1:
        return mesh, placements[0]
    (dim,) = [dim for dim, placement in enumerate(placements) if placement.is_shard()]
    return mesh[mesh.mesh_dim_names[dim]], placements[dim]


def _rank(unit: list[torch.Tensor]) -> int:
    """This process's rank along the mesh dimension the unit is sharded over (0 for a plain tensor)."""
    return _sharding(unit[0])[0].get_local_rank() if _is_dtensor(unit[0]) else 0


def _owner(unit: list[torch.Tensor], index: int) -> int:
    """The process that orthogonalises the `index`-th unit of a step: round robin along the mesh dimension that
    shards it (FSDP2)."""
    return index % _sharding(unit[0])[0].size() if _is_dtensor(unit[0]) else 0


class AdamWStar(torch.optim.Optimizer):
    """AdamW*: the AdamW variant of Geiping et al. (2025) that the paper compares against, as the authors ran
    it (their `ELLISAdam` with running_init, atan_adam, update_clipping and decouple_wd on).

    Per tensor, at step t (from 1), gradient g, learning rate lr_t, β1, β2, weight decay λ, ε = 1e-6:

    - running init: on the first step the moments start at m = g, v = g² (not at zero);
    - every step: m ← lerp(m, g, 1 - β1), v ← β2·v + (1 - β2)·g², then v ← max(v, ε²) (in place);
    - update clipping (Wortsman et al. 2023): step = lr_t / max(1, √mean(g²/v)) / (1 - β1^t);
    - decoupled decay, scaled by the schedule and not by the LR: p ← p·(1 - λ·lr_t/lr_0), where lr_0 is
      the group's `initial_lr` (the peak LR the schedule scales);
    - no ε in the update (Everett et al. 2024): p ← p - step·atan2(m, √v / √(1 - β2^t)).

    Moments are kept in float32. ε only floors v for the clipping ratio.
    """

    def __init__(self, params, lr: float = 5e-5, betas=(0.9, 0.95), weight_decay: float = 1e-4, eps: float = 1e-6):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps))
        for group in self.param_groups:
            group.setdefault("initial_lr", group["lr"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            initial = float(group.setdefault("initial_lr", lr))
            shrink = 1.0 - (lr / initial if initial else 0.0) * group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = grad.clone()
                    state["exp_avg_sq"] = grad.square()
                state["step"] += 1
                t = int(state["step"].item())
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                clip = grad.square().div_(v.clamp_(min=group["eps"] ** 2)).mean().sqrt().clamp(min=1.0)
                update = torch.atan2(m, v.sqrt().div_(math.sqrt(1 - beta2**t)))
                update.mul_(lr / (1 - beta1**t) / clip)
                p.mul_(shrink)
                p.sub_(update.to(p.dtype))
        return loss


def global_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` (0: no clipping) and return the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm > 0 else math.inf)
