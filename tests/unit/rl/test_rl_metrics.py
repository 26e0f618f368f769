"""Off-policy diagnostics with hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.rl.metrics import (
    clip_fraction,
    is_ess,
    kl_k3,
    mask_fraction,
    max_abs_logprob_diff,
    router_flip_rate,
)

EMPTY = torch.zeros(1, 2, dtype=torch.bool)


def test_kl_k3() -> None:
    # μ = (0.5, 0.5), π = (0.25, 1) → ρ = (0.5, 2)
    # k3 = ρ − 1 − log ρ: 0.5 − 1 + log 2 = 0.19315 ; 2 − 1 − log 2 = 0.30685 ; mean = 0.25 exactly
    behaviour = torch.tensor([[0.5, 0.5]]).log()
    trainer = torch.tensor([[0.25, 1.0]]).log()
    assert kl_k3(behaviour, trainer, torch.ones(1, 2, dtype=torch.bool)) == pytest.approx(0.25, rel=1e-6)
    assert kl_k3(behaviour, behaviour, torch.ones(1, 2, dtype=torch.bool)) == 0.0


def test_max_abs_logprob_diff_ignores_masked_tokens() -> None:
    # |−1 − (−1.5)| = 0.5, |−2 − (−2)| = 0, the masked |−3 − (−1)| = 2 is ignored
    a, b = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -2.0, -1.0]])
    assert max_abs_logprob_diff(a, b, torch.tensor([[True, True, False]])) == pytest.approx(0.5)


def test_is_ess() -> None:
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert is_ess(torch.ones(1, 4), mask) == pytest.approx(1.0)  # all equal
    assert is_ess(torch.tensor([[4.0, 0.0, 0.0, 0.0]]), mask) == pytest.approx(0.25)  # 16 / (4 · 16) = 1/N
    # (1 + 2 + 3)² / (3 · (1 + 4 + 9)) = 36 / 42
    assert is_ess(torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1, 1, 1, 0]])) == pytest.approx(36 / 42)
    assert is_ess(torch.zeros(1, 4), mask) == 0.0


def test_clip_fraction() -> None:
    # r = (1.5, 0.5, 1.1, 0.7), A = (+, +, −, −), eps 0.2:
    # t0 A>0, r > 1.2 → clipped ; t1 A>0, r < 0.8 → not (the bound that binds for A>0 is the upper)
    # t2 A<0, r = 1.1 → not ; t3 A<0, r < 0.8 → clipped  ⇒ 2/4 ; without t3 ⇒ 1/3
    ratio = torch.tensor([[1.5, 0.5, 1.1, 0.7]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    assert clip_fraction(ratio, adv, torch.ones(1, 4), eps_low=0.2, eps_high=0.2) == pytest.approx(0.5)
    mask = torch.tensor([[1, 1, 1, 0]])
    assert clip_fraction(ratio, adv, mask, eps_low=0.2, eps_high=0.2) == pytest.approx(1 / 3)
    # per-sequence advantages broadcast over tokens
    assert clip_fraction(ratio, torch.tensor([1.0]), torch.ones(1, 4), eps_low=0.2, eps_high=0.2) == 0.25


def test_mask_fraction() -> None:
    # loss tokens t0..t2; MIS kept only t0 of them → 2/3 dropped (t3 is not a loss token)
    keep = torch.tensor([[True, False, False, True]])
    mask = torch.tensor([[True, True, True, False]])
    assert mask_fraction(keep, mask) == pytest.approx(2 / 3)


def test_router_flip_rate() -> None:
    # L = 2 layers, B = 1, T = 2, k = 2. Sets: (l0,t0) {0,1}={0,1}; (l0,t1) {2,3}≠{1,2};
    # (l1,t0) {0,1}={0,1} (order differs, same set); (l1,t1) {0,2}≠{0,3}  ⇒ 2/4
    own = torch.tensor([[[[0, 1], [2, 3]]], [[[1, 0], [0, 2]]]])
    replayed = torch.tensor([[[[1, 0], [2, 1]]], [[[0, 1], [0, 3]]]])
    assert router_flip_rate(own, replayed, torch.ones(1, 2)) == pytest.approx(0.5)
    assert router_flip_rate(own, replayed, torch.tensor([[1, 0]])) == 0.0  # only t0 counted
    with pytest.raises(ValueError):
        router_flip_rate(own, replayed[:1], torch.ones(1, 2))


def test_everything_is_zero_without_loss_tokens() -> None:
    z = torch.zeros(1, 2)
    assert kl_k3(z, z + 1, EMPTY) == 0.0
    assert max_abs_logprob_diff(z, z + 1, EMPTY) == 0.0
    assert is_ess(z + 1, EMPTY) == 0.0
    assert clip_fraction(z + 2, z + 1, EMPTY, eps_low=0.2, eps_high=0.2) == 0.0
    assert mask_fraction(EMPTY, EMPTY) == 0.0
    e = torch.zeros(1, 1, 2, 1, dtype=torch.long)
    assert router_flip_rate(e, e + 1, EMPTY) == 0.0
    assert not math.isnan(kl_k3(z, z, EMPTY))
