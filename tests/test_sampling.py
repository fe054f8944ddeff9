"""The Poisson-lognormal depth sampler of DESIGN.md §1."""

import pytest
import torch

from recurfit.sampling import parse_num_steps, sample_depth


def draws(mean, depth, count=4000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [sample_depth(mean, depth, generator) for _ in range(count)]


@pytest.mark.parametrize("mean, depth", [(32, 8), (8, 8), (4, 8), (16, 4)])
def test_total_depth_has_the_designed_mean_and_truncation(mean, depth):
    samples = draws(mean, depth)
    totals = torch.tensor([n + k for n, k in samples], dtype=torch.float64)
    expected = max(mean - depth, 0) + depth + 1  # E[T] = r̄ + 1 when r̄ ≥ k̄, k̄ + 1 below
    assert totals.mean().item() == pytest.approx(expected, rel=0.05)
    assert all(k == min(depth, n + k) and n == max(n + k - depth, 0) for n, k in samples)
    assert totals.min().item() >= 1


def test_same_seed_same_depths():
    assert draws(32, 8, 50, seed=7) == draws(32, 8, 50, seed=7)
    assert draws(32, 8, 50, seed=7) != draws(32, 8, 50, seed=8)


def test_parse_num_steps():
    assert parse_num_steps(5) == (0, 5)
    assert parse_num_steps((24, 8)) == (24, 8)
    assert parse_num_steps([0, 1]) == (0, 1)
    assert parse_num_steps(torch.tensor(3)) == (0, 3)
