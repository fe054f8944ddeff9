"""Healing losses for a retrofitted model: distillation from its parent, and depth supervision.

    distillation:       loss = α·CE + (1 - α)·T²·KL(p_teacher,T ‖ p_student,T)
    depth supervision:  loss = Σ_d w_d · loss_d over the last m recurrences with gradient, Σ w_d = 1

KL is taken between the next-token distributions at temperature T (softmax of logits / T), averaged over
tokens; T² keeps its gradient's scale independent of T (Hinton et al., 2015). With `data.assistant_only_loss`,
every term is averaged over the assistant's tokens alone (`micro_batch_weights`). With both on, every supervised
depth is distilled from the same teacher. docs/how-to/healing.md gives the settings and costs.

Every loss is read from final hidden states through the head a chunk of positions at a time (`head.HeadLoss`):
neither the student's logits at any depth nor the teacher's exist whole, nor their gradient.
"""

from __future__ import annotations

import torch

from ..errors import RecurfitError
from ..model.accounting import count_parameters, inference_flops_per_token
from ..model.loading import load_model, meta_model
from ..model.modeling import RecurrentForCausalLM
from .config import DistillConfig, ModelConfig, SuperviseConfig
from .distributed import fill_from_main, fsdp_units
from .head import final_hidden_states, head_losses


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
        self,
        hidden: list[torch.Tensor],
        weight: torch.Tensor,
        targets: torch.Tensor,
        teacher: tuple[torch.Tensor, torch.Tensor] | None,
        terms: dict,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss from each supervised depth's final `hidden` states (shallowest first, the final one last) read
        through the head `weight`, and the `teacher`'s (final hidden states, head weight); `terms` receives the
        final depth's `ce` (and `kl`), and with supervision the weighted means `ce_supervised` (and
        `kl_supervised`), detached; with `mask` (bool per target), every term over the masked targets alone.
        Call it under the forward's autocast: the head multiplies in its dtype."""
        weights = depth_weights(len(hidden), self.supervise.weighting if self.supervise else "uniform")
        temperature = self.distill.temperature if self.distill is not None else 1.0
        pairs = [head_losses(depth, weight, targets, teacher, temperature, mask) for depth in hidden]
        by_depth = {"ce": [ce for ce, _ in pairs]}
        if self.distill is None:
            losses = by_depth["ce"]
        else:
            by_depth["kl"] = [kl for _, kl in pairs]
            alpha = self.distill.alpha
            losses = [alpha * ce + (1 - alpha) * temperature**2 * kl for ce, kl in pairs]
        for name, values in by_depth.items():
            terms[name] = values[-1].detach()
            if self.supervise is not None:
                terms[f"{name}_supervised"] = sum(w * v.detach() for w, v in zip(weights, values))
        return sum(weight * loss for weight, loss in zip(weights, losses))


def micro_batch_weights(share: int, masks: torch.Tensor | None, micro: int, processes) -> list:
    """Each micro-batch's weight in this process's loss, given its share of the global batch as rows (and with
    `data.assistant_only_loss` the rows' assistant masks): micro-batch means weighted so, and averaged over the
    processes as DDP and FSDP2 average gradients, make the mean over every counted target of the global batch.

    Without masks every target counts and every row has as many: a micro-batch weighs its rows / the share's.
    With them a micro-batch's mean is over its assistant targets (`head.HeadLoss`), and it weighs its count of
    them × processes / the global batch's count (summed over the processes); a batch without any gives 0."""
    if masks is None:
        return [min(micro, share - start) / share for start in range(0, share, micro)]
    counts = masks[:, 1:].to(processes.device).sum(dim=1, dtype=torch.float32)
    per_micro = torch.stack([part.sum() for part in counts.split(micro)])
    total = processes.sum(per_micro.sum()).clamp(min=1)
    return list(per_micro * processes.world / total)


class Teacher:
    """The model to distil from: loaded once per (re)start, never trained or saved, placed as the student.

    Under FSDP2 it is sharded as the student is, and held as the student is built: the main process loads it on
    the CPU, every other process makes its structure on the meta device, and each receives its own shards
    (`fill_from_main`); no GPU ever holds it whole. Every unit, its root (the head) too, is resharded after its
    forward, as it has no backward; the loss gathers the head's weight for itself (`hidden_states`)."""

    def __init__(self, config: DistillConfig, model: ModelConfig, vocab_size: int, processes, strategy: str):
        source, revision = config.source(model)
        self.name = source or "the embedded SmolLM2-135M"
        dtype = teacher_dtype(config, processes.device)
        self.sharded = strategy == "fsdp" and processes.grouped
        built = None
        if processes.is_main or not self.sharded:
            built = load_model(source, dtype=dtype, revision=revision).requires_grad_(False)
        structure = processes.broadcast(built.config if built is not None else None) if self.sharded else built.config
        if structure.vocab_size != vocab_size:
            raise RecurfitError(
                f"distill.teacher {self.name} has a {structure.vocab_size}-token vocabulary and the model "
                f"{vocab_size}: distillation compares next-token distributions token by token, so the teacher "
                "needs the model's tokenizer; distil from the model's parent (distill.teacher: null)."
            )
        teacher = meta_model(structure).to(dtype).requires_grad_(False) if self.sharded else built
        self.recurrent = isinstance(teacher, RecurrentForCausalLM)
        # Forward FLOPs per token, as the student's count: non-embedding parameters, a recurrent teacher at r̄.
        depth = teacher.config.mean_recurrence if self.recurrent else 1
        self.flops_per_token = inference_flops_per_token(count_parameters(teacher), depth)
        if self.sharded:
            fsdp_units(teacher, mixed_precision=False, trained=False, mesh=processes.mesh)
            fill_from_main(teacher, built, processes)
        else:  # DDP replicates it as it is (no gradients to reduce)
            teacher = teacher.to(processes.device)
        self.model = teacher.eval()

    @torch.no_grad()
    def hidden_states(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(its final hidden states at `inputs`, its head's weight): what the loss reads its distribution from.
        Sharded, the head's weight is gathered afresh (every process calls this as often: `Processes.deal`), and
        freed once the loss that holds it is done: FSDP2 resharded the root after its forward."""
        hidden, weight = final_hidden_states(self.model, self.model, inputs)
        if self.sharded:
            weight = self.model.get_output_embeddings().weight.full_tensor()
        return hidden[-1], weight


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
