"""Healing losses for a retrofitted model: distillation from its parent, and depth supervision.

    distillation:       loss = α·CE + (1 - α)·T²·KL(p_teacher,T ‖ p_student,T)
    depth supervision:  loss = Σ_d w_d · loss_d over the last m recurrences with gradient, Σ w_d = 1

KL is taken between the next-token distributions at temperature T (softmax of logits / T), averaged over
tokens; T² keeps its gradient's scale independent of T (Hinton et al., 2015). With both on, every supervised
depth is distilled from the same teacher logits. docs/training.md ("Healing") gives the settings and costs.
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


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in float32 whatever the logits' precision."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def distillation_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher_T ‖ student_T) per token, averaged over tokens, in float32 (not scaled by T²)."""
    student_log = F.log_softmax(student.float().flatten(0, 1) / temperature, dim=-1)
    teacher_log = F.log_softmax(teacher.float().flatten(0, 1) / temperature, dim=-1)
    return F.kl_div(student_log, teacher_log, reduction="batchmean", log_target=True)


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
        self, logits: list[torch.Tensor], targets: torch.Tensor, teacher: torch.Tensor | None, parts: dict
    ) -> torch.Tensor:
        """The loss from each supervised depth's `logits` (shallowest first, the final one last) and the teacher's
        logits; `parts` receives the final depth's `ce` (and `kl`), and with supervision the weighted means
        `ce_supervised` (and `kl_supervised`), detached."""
        weights = depth_weights(len(logits), self.supervise.weighting if self.supervise else "uniform")
        terms = {"ce": [cross_entropy(depth_logits, targets) for depth_logits in logits]}
        losses = terms["ce"]
        if self.distill is not None:
            alpha, temperature = self.distill.alpha, self.distill.temperature
            terms["kl"] = [distillation_kl(depth_logits, teacher, temperature) for depth_logits in logits]
            losses = [alpha * ce + (1 - alpha) * temperature**2 * kl for ce, kl in zip(losses, terms["kl"])]
        for name, values in terms.items():
            parts[name] = values[-1].detach()
            if self.supervise is not None:
                parts[f"{name}_supervised"] = sum(w * v.detach() for w, v in zip(weights, values))
        return sum(weight * loss for weight, loss in zip(weights, losses))


class Teacher:
    """The model to distil from: loaded once per (re)start, never trained or saved, placed as the student."""

    def __init__(self, config: DistillConfig, model: ModelConfig, vocab_size: int, processes, strategy: str):
        source, revision = config.source(model)
        self.name = source or "the embedded SmolLM2-135M"
        teacher = load_model(source, dtype=torch.float32, revision=revision).requires_grad_(False)
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
