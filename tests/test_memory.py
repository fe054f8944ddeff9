"""The memory plan (recurfit/train/memory.py, `train --dry-run`) and the chunked losses it counts on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recurfit.train import losses
from recurfit.train.config import DistillConfig, SuperviseConfig

# ---------------------------------------------------------------- the chunked losses


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 5 positions of the 97-token vocabulary: a (3, 7) batch spans five chunks, the last partial."""
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 97 * 5)


def logits_and_targets(seed: int = 0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 7, 97, generator=generator)).to(dtype).requires_grad_()
    return logits, torch.randint(0, 97, (3, 7), generator=generator)


def gradient(loss: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, tensor)
    return grad


def test_chunked_cross_entropy_equals_the_plain_one_value_and_gradient(small_chunks):
    logits, targets = logits_and_targets()
    chunked = losses.cross_entropy(logits, targets)
    plain = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gradient(2.5 * chunked, logits), gradient(2.5 * plain, logits), rtol=1e-5, atol=1e-8)


def test_chunked_cross_entropy_of_bf16_logits_upcasts_as_the_plain_one(small_chunks):
    logits, targets = logits_and_targets(dtype=torch.bfloat16)
    chunked = losses.cross_entropy(logits, targets)
    plain = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    grad = gradient(chunked, logits)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, gradient(plain, logits), rtol=0, atol=0)


def test_distillation_and_supervision_equal_the_plain_losses(small_chunks):
    """Every supervised depth is distilled from one set of teacher log-probabilities: the same objective as
    log_softmax and kl_div on the whole vocabulary, value and gradient."""
    depths = [logits_and_targets(seed)[0] for seed in (1, 2)]
    _, targets = logits_and_targets()
    teacher = torch.randn(3, 7, 97, generator=torch.Generator().manual_seed(3))
    alpha, temperature = 0.3, 2.0
    healing = losses.HealingLoss(DistillConfig(alpha=alpha, temperature=temperature), SuperviseConfig())
    chunked = healing(depths, targets, teacher, {})

    def plain(student):
        student_log = F.log_softmax(student.flatten(0, 1) / temperature, dim=-1)
        teacher_log = F.log_softmax(teacher.flatten(0, 1) / temperature, dim=-1)
        kl = F.kl_div(student_log, teacher_log, reduction="batchmean", log_target=True)
        ce = F.cross_entropy(student.flatten(0, 1), targets.flatten())
        return alpha * ce + (1 - alpha) * temperature**2 * kl

    reference = sum(plain(student) / 2 for student in depths)
    torch.testing.assert_close(chunked, reference, rtol=1e-6, atol=1e-6)
    for student in depths:
        torch.testing.assert_close(gradient(chunked, student), gradient(reference, student), rtol=1e-5, atol=1e-8)
