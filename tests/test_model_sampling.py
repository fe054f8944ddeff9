"""Tests of `recurfit/model/sampling.py`."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import small_run

from recurfit.model.sampling import Curriculum, parse_num_steps, sample_depth
from recurfit.train import load_config
from recurfit.train.step_plan import depth_schedule


def draws(mean, depth, count=4000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [sample_depth(mean, depth, generator) for _ in range(count)]


def test_curricula_follow_the_authors_scheduler(tmp_path, workspace):
    from transformers import get_wsd_schedule

    def authors(target, fraction, steps, start_ratio, values_wanted=None):
        # The authors drive each curriculum with transformers' WSD scheduler on a dummy optimizer whose LR is
        # the target depth: warmup ceil(fraction · steps), no decay, `min_lr_ratio` the starting fraction.
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(target))
        schedule = get_wsd_schedule(
            optimizer, math.ceil(fraction * steps), 0, num_training_steps=steps, min_lr_ratio=start_ratio
        )
        values = []
        for _ in range(values_wanted or steps):
            values.append(schedule.get_last_lr()[0])
            optimizer.step()  # no gradients: a no-op, in the order torch expects
            schedule.step()
        return values

    config = load_config(
        None,
        [
            "depth.mean_recurrence=32",
            "depth.backprop_depth=8",
            "depth.curriculum=linear",
            "depth.curriculum_fraction=0.25",
            "depth.backprop_curriculum=linear",
            "depth.backprop_curriculum_fraction=0.1",
        ],
        base=small_run(workspace, tmp_path / "run", steps=200),
    )
    schedule = depth_schedule(config)
    mean = [max(1, math.ceil(v)) for v in authors(32, 0.25, 200, 0.0)]
    # Their backprop scheduler starts at 1/k̄ of k̄ and is stepped once before the first training step.
    backprop = [math.ceil(v) for v in authors(8, 0.1, 200, 1 / 8, values_wanted=201)[1:]]
    assert [schedule.mean_recurrence.at(t) for t in range(200)] == mean
    # (Stepped once ahead, their scheduler runs off its end on the last step and falls back to 1; not copied.)
    assert [schedule.backprop_depth.at(t) for t in range(199)] == backprop[:199]
    assert backprop[0] == 2 and mean[0] == 1 and mean[-1] == 32
    assert Curriculum(8, "linear", 20, start=1, lead=1).at(0) == 2


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


def test_curricula_are_staircases_from_one_to_the_target():
    from recurfit.model.sampling import Curriculum

    linear = Curriculum(32, "linear", ramp_steps=100)
    one_minus_sqrt = Curriculum(32, "1-sqrt", ramp_steps=100)
    assert [linear.at(t) for t in (0, 1, 50, 99, 100, 500)] == [1, 1, 16, 32, 32, 32]
    assert [one_minus_sqrt.at(t) for t in (0, 50, 75, 100)] == [1, 10, 16, 32]
    for curriculum in (linear, one_minus_sqrt):
        depths = [curriculum.at(t) for t in range(120)]
        assert depths == sorted(depths) and set(depths) <= set(range(1, 33))
    # 1-sqrt spends less depth early on: the paper's cheaper curriculum.
    assert sum(one_minus_sqrt.at(t) for t in range(100)) < sum(linear.at(t) for t in range(100))
    assert Curriculum(8).at(0) == 8


def test_curriculum_rejects_bad_settings():
    from recurfit.model.sampling import Curriculum

    with pytest.raises(ValueError, match="curriculum must be one of"):
        Curriculum(8, "cosine", 10)
    with pytest.raises(ValueError, match="target >= 1"):
        Curriculum(0, "linear", 10)


def test_depth_schedule_draws_depend_only_on_seed_and_step():
    from recurfit.model.sampling import Curriculum, DepthSchedule

    schedule = DepthSchedule(Curriculum(16, "linear", 50), Curriculum(4), seed=3)
    first = [schedule.at(step) for step in range(80)]
    assert first == [schedule.at(step) for step in range(80)]  # a resumed run redraws the same depths
    assert [schedule.at(step) for step in range(60, 80)] == first[60:]
    assert first != [DepthSchedule(schedule.mean_recurrence, schedule.backprop_depth, seed=4).at(s) for s in range(80)]
    assert all(k <= 4 for _, k in first)
    early = sum(n + k for n, k in first[:10]) / 10
    late = sum(n + k for n, k in first[60:]) / 20
    assert early < late  # the mean ramps up


def test_one_schedule_decides_the_depth_the_model_runs_and_the_flops_count():
    from recurfit.model.accounting import training_flops, training_flops_per_token
    from recurfit.model.sampling import Curriculum, DepthSchedule

    counts = {"prelude": 10, "core": 100, "coda": 10, "adapter": 5, "final_norm": 1, "body": 120}
    # Early in a curriculum r̄ = 2 < k̄ = 8: the step runs (0, 2), and the paper's FLOPs rule counts the same.
    schedule = DepthSchedule(Curriculum(32, "linear", 16), Curriculum(8), fixed=True)
    assert schedule.mean_recurrence.at(1) == 2 and schedule.at(1) == schedule.mean_depth(1) == (0, 2)
    assert training_flops(counts, 7, 2, 8) == 7 * training_flops_per_token(counts, schedule.mean_depth(1))
    assert schedule.at(100) == (24, 8)  # after the ramp: r̄ = 32 split into n = 24 without gradient, k = 8 with
    sampled = DepthSchedule(Curriculum(32, "linear", 16), Curriculum(8), seed=1)
    assert all(k <= sampled.mean_recurrence.at(step) for step in range(16) for _, k in [sampled.at(step)])
