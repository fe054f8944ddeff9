"""Healing losses for a retrofitted model: distillation from its parent, and depth supervision.

    distillation:       loss = α·CE + (1 - α)·T²·KL(p_teacher,T ‖ p_student,T)
    depth supervision:  loss = Σ_d w_d · loss_d over the last m recurrences with gradient, Σ w_d = 1

KL is taken between the next-token distributions at temperature T (softmax of logits / T), averaged over
tokens; T² keeps its gradient's scale independent of T (Hinton et al., 2015). With both on, every supervised
depth is distilled from the same teacher log-probabilities, computed once per micro-batch. docs/training.md
("Healing") gives the settings and costs.

Both losses are computed over chunks of rows (`ChunkedLoss`): the float32 upcast of a large vocabulary's
logits exists one chunk at a time, never for the whole micro-batch, and backward recomputes each chunk's
softmax instead of keeping a float32 log-softmax of every position (docs/training.md, "The memory plan").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import RecurfitError
from ..model.accounting import count_parameters, inference_flops_per_token
from ..model.loading import load_model
from ..model.modeling import RecurrentForCausalLM
from .config import DistillConfig, ModelConfig, SuperviseConfig
from .distributed import fsdp_units

# Rows of logits (positions) upcast to float32 at once: 2**24 elements, 64 MiB, whatever the vocabulary.
CHUNK_ELEMENTS = 2**24


def chunk_rows(vocab_size: int) -> int:
    """Positions per chunk of the chunked losses at this vocabulary size."""
    return max(1, CHUNK_ELEMENTS // vocab_size)


class ChunkedLoss(torch.autograd.Function):
    """Mean next-token cross-entropy, and with teacher log-probabilities the mean KL(teacher_T ‖ student_T), over
    rows of `logits` (positions × vocabulary) in chunks, in float32 whatever the logits' precision.

    Forward keeps the logits as they are (a reference, not a copy) and one float32 log-sum-exp per row; backward
    recomputes each chunk's softmax and writes its gradient, in the logits' dtype, into one buffer:

        d CE / d z   = (softmax(z) - onehot(target)) / rows
        d KL / d z   = (softmax(z / T) · Σ p_teacher - p_teacher) / (T · rows)

    which is what autograd computes through log_softmax, so the chunked losses equal the plain ones (tested).
    """

    @staticmethod
    def forward(ctx, logits, targets, teacher_log_probs, temperature: float):
        rows = chunk_rows(logits.shape[-1])
        ce, kl = logits.new_zeros((), dtype=torch.float32), logits.new_zeros((), dtype=torch.float32)
        for start in range(0, logits.shape[0], rows):
            chunk = logits[start : start + rows].float()
            target = targets[start : start + rows]
            ce += (chunk.logsumexp(-1) - chunk.gather(-1, target[:, None]).squeeze(-1)).sum()
            if teacher_log_probs is not None:
                student = F.log_softmax(chunk / temperature, dim=-1)
                teacher = teacher_log_probs[start : start + rows]
                kl += (teacher.exp() * (teacher - student)).sum()
        ctx.save_for_backward(logits, targets, teacher_log_probs)
        ctx.temperature = temperature
        count = logits.shape[0]
        return ce / count, kl / count

    @staticmethod
    def backward(ctx, grad_ce, grad_kl):
        logits, targets, teacher_log_probs = ctx.saved_tensors
        temperature, count = ctx.temperature, logits.shape[0]
        grad = torch.empty_like(logits)
        rows = chunk_rows(logits.shape[-1])
        for start in range(0, count, rows):
            chunk = logits[start : start + rows].float()
            target = targets[start : start + rows]
            part = chunk.softmax(-1)
            part[torch.arange(len(target), device=part.device), target] -= 1
            part *= grad_ce / count
            if teacher_log_probs is not None:
                teacher = teacher_log_probs[start : start + rows].exp()
                student = (chunk / temperature).softmax(-1) * teacher.sum(-1, keepdim=True)
                part += (student - teacher) * (grad_kl / (temperature * count))
            grad[start : start + rows] = part
        return grad, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in float32 whatever the logits' precision, chunked (`ChunkedLoss`)."""
    ce, _ = ChunkedLoss.apply(logits.flatten(0, 1), targets.flatten(), None, 1.0)
    return ce


def teacher_log_probs(teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """The teacher's float32 log-probabilities at temperature T, one row per position (no gradient), computed
    a chunk at a time: the float32 result is the only copy of the whole."""
    flat = teacher.detach().flatten(0, 1)
    result = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    rows = chunk_rows(flat.shape[-1])
    for start in range(0, flat.shape[0], rows):
        result[start : start + rows] = F.log_softmax(flat[start : start + rows].float() / temperature, dim=-1)
    return result


def distillation_losses(
    student: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE, KL(teacher_T ‖ student_T)) per token, averaged over tokens, in float32 (KL not scaled by T²);
    `teacher` holds `teacher_log_probs`."""
    return ChunkedLoss.apply(student.flatten(0, 1), targets.flatten(), teacher, temperature)


def supervised_steps(num_steps: tuple[int, int], supervise: SuperviseConfig | None) -> list[int]:
    """The recurrences (1-based, increasing) whose readouts the loss takes: the last `supervise.last` of the k
    with gradient (at most k), or only the final one."""
    n, k = num_steps
    count = 1 if supervise is None else min(supervise.last or k, k)
    return list(range(n + k - count + 1, n + k + 1))


def depth_weights(count: int, weighting: str) -> list[float]:
    """Weights of `count` supervised depths, shallowest first, summing to 1: equal, or ∝ 1, 2, …, count."""
    raw = [1.0] * count if weighting == "uniform" else [float(i) for i in range(1, count + 1)]
    return [w / sum(raw) for w in raw]


class HealingLoss:
    """The training objective of one micro-batch: plain CE, distillation, depth supervision, or both."""

    def __init__(self, distill: DistillConfig | None, supervise: SuperviseConfig | None):
        self.distill, self.supervise = distill, supervise

    @property
    def active(self) -> bool:
        return self.distill is not None or self.supervise is not None

    def readout_steps(self, num_steps: tuple[int, int]) -> list[int]:
        """The supervised recurrences before the last, which the forward reads out on the way."""
        return supervised_steps(num_steps, self.supervise)[:-1]

    def readout_flops_per_token(self, counts: dict, num_steps: tuple[int, int]) -> int:
        """Training FLOPs per token of those extra readouts: coda and final norm, forward and backward (6·N)."""
        readouts = len(self.readout_steps(num_steps))  # none for a baseline: depth.supervise needs recurrence
        return 6 * readouts * (counts["coda"] + counts["final_norm"]) if readouts else 0

    def __call__(
        self, logits: list[torch.Tensor], targets: torch.Tensor, teacher: torch.Tensor | None, terms: dict
    ) -> torch.Tensor:
        """The loss from each supervised depth's `logits` (shallowest first, the final one last) and the teacher's
        logits; `terms` receives the final depth's `ce` (and `kl`), and with supervision the weighted means
        `ce_supervised` (and `kl_supervised`), detached."""
        weights = depth_weights(len(logits), self.supervise.weighting if self.supervise else "uniform")
        if self.distill is None:
            by_depth = {"ce": [cross_entropy(depth_logits, targets) for depth_logits in logits]}
            losses = by_depth["ce"]
        else:
            alpha, temperature = self.distill.alpha, self.distill.temperature
            target = teacher_log_probs(teacher, temperature)  # once per micro-batch, whatever the depths
            pairs = [distillation_losses(depth_logits, targets, target, temperature) for depth_logits in logits]
            by_depth = {"ce": [ce for ce, _ in pairs], "kl": [kl for _, kl in pairs]}
            losses = [alpha * ce + (1 - alpha) * temperature**2 * kl for ce, kl in pairs]
        for name, values in by_depth.items():
            terms[name] = values[-1].detach()
            if self.supervise is not None:
                terms[f"{name}_supervised"] = sum(w * v.detach() for w, v in zip(weights, values))
        return sum(weight * loss for weight, loss in zip(weights, losses))


class Teacher:
    """The model to distil from: loaded once per (re)start, never trained or saved, placed as the student."""

    def __init__(self, config: DistillConfig, model: ModelConfig, vocab_size: int, processes, strategy: str):
        source, revision = config.source(model)
        self.name = source or "the embedded SmolLM2-135M"
        dtype = teacher_dtype(config, processes.device)
        teacher = load_model(source, dtype=dtype, revision=revision).requires_grad_(False)
        if teacher.config.vocab_size != vocab_size:
            raise RecurfitError(
                f"distill.teacher {self.name} has a {teacher.config.vocab_size}-token vocabulary and the model "
                f"{vocab_size}: distillation compares next-token distributions token by token, so the teacher "
                "needs the model's tokenizer; distil from the model's parent (distill.teacher: null)."
            )
        self.recurrent = isinstance(teacher, RecurrentForCausalLM)
        # Forward FLOPs per token, as the student's count: non-embedding parameters, a recurrent teacher at r̄.
        depth = teacher.config.mean_recurrence if self.recurrent else 1
        self.flops_per_token = inference_flops_per_token(count_parameters(teacher), depth)
        self.model = teacher.to(processes.device).eval()
        # DDP replicates it as it is (no gradients to reduce); FSDP2 shards it as the student's layers.
        if strategy == "fsdp" and processes.grouped:
            fsdp_units(self.model, mixed_precision=False, trained=False)

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=inputs).logits


def teacher_dtype(config: DistillConfig, device: torch.device) -> torch.dtype:
    """`distill.dtype`: auto holds the teacher in bfloat16 on a GPU and in float32 elsewhere."""
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if config.dtype == "bf16" else torch.float32


def describe(distill: DistillConfig | None, supervise: SuperviseConfig | None, teacher: Teacher | None) -> list[str]:
    """What the start of a run says about its healing losses."""
    lines = []
    if teacher is not None:
        lines.append(
            f"Distilling from {teacher.name}: loss = {distill.alpha}·CE + {1 - distill.alpha:g}·"
            f"{distill.temperature:g}²·KL (T {distill.temperature:g}); the teacher's forward adds "
            f"{teacher.flops_per_token:,} FLOPs per token (flops_teacher in log.jsonl)."
        )
    if supervise is not None:
        which = f"last {supervise.last}" if supervise.last else "all"
        lines.append(
            f"Depth supervision: the loss at the {which} recurrences with gradient, {supervise.weighting} weights."
        )
    return lines
