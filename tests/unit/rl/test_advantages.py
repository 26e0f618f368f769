"""Group advantages with hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.rl.advantages import group_advantages


def test_one_group_mean_baseline() -> None:
    # mean(1, 0, 0, 1) = 0.5 → A = r − 0.5
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]


def test_one_group_std_normalised() -> None:
    # population std of (1, 0, 0, 1) = sqrt(mean((±0.5)²)) = 0.5 → A = ±0.5 / (0.5 + 1e-6) ≈ ±0.999998
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), normalize_std=True)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]) * (0.5 / (0.5 + 1e-6)))


def test_several_groups_are_independent() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])
    # group 0: mean 2 → (−1, 0, 1); group 1: all equal → 0 (no signal)
    assert group_advantages(rewards).tolist() == [[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    # group 0 population std = sqrt((1 + 0 + 1) / 3) = 0.81650 → ±1.22474; group 1: 0 / (0 + eps) = 0
    s = math.sqrt(2 / 3)
    expected = torch.tensor([[-1 / (s + 1e-6), 0.0, 1 / (s + 1e-6)], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(group_advantages(rewards, normalize_std=True), expected)


def test_group_of_one_has_zero_advantage() -> None:
    assert group_advantages(torch.tensor([3.0]), normalize_std=True).tolist() == [0.0]


def test_integer_rewards_give_float_advantages() -> None:
    adv = group_advantages(torch.tensor([0, 1]))
    assert adv.dtype == torch.float32 and adv.tolist() == [-0.5, 0.5]


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3, 0))
