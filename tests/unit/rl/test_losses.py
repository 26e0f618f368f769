"""Clipped policy-gradient loss with hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.rl.losses import clipped_pg_loss

# old log-probs 0 and current log-probs log r make the ratios exactly r = (1.5, 0.5, 1.1).
RATIOS = torch.tensor([[1.5, 0.5, 1.1]])
OLD = torch.zeros(1, 3)
MASK = torch.ones(1, 3, dtype=torch.bool)


def _logp() -> torch.Tensor:
    return RATIOS.log().clone().requires_grad_(True)


def test_positive_advantage_clips_above() -> None:
    # A = +1, eps 0.2: t0 min(1.5, 1.2) = 1.2; t1 min(0.5, 0.8) = 0.5; t2 min(1.1, 1.1) = 1.1
    # L = −(1.2 + 0.5 + 1.1) / 3 = −0.93333
    logp = _logp()
    loss = clipped_pg_loss(logp, OLD, torch.tensor([1.0]), MASK)
    assert loss.item() == pytest.approx(-2.8 / 3, rel=1e-6)
    # gradient: clipped t0 gets none; otherwise dℓ/dlog π = −r·A / N
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 3, -1.1 / 3]]))


def test_negative_advantage_clips_below() -> None:
    # A = −1: t0 min(−1.5, −1.2) = −1.5; t1 min(−0.5, −0.8) = −0.8; t2 −1.1 → L = (1.5 + 0.8 + 1.1) / 3
    loss = clipped_pg_loss(_logp(), OLD, torch.tensor([-1.0]), MASK)
    assert loss.item() == pytest.approx(3.4 / 3, rel=1e-6)


def test_decoupled_upper_bound() -> None:
    # eps_high 0.6 → t0 no longer clipped (1.5 < 1.6): L = −(1.5 + 0.5 + 1.1) / 3
    loss = clipped_pg_loss(_logp(), OLD, torch.tensor([1.0]), MASK, eps_low=0.2, eps_high=0.6)
    assert loss.item() == pytest.approx(-3.1 / 3, rel=1e-6)


def test_masked_tokens_are_excluded_even_when_infinite() -> None:
    # mask t1 and poison it: −inf old log-prob would give r = inf. L = −(1.2 + 1.1) / 2 = −1.15
    old = torch.tensor([[0.0, -math.inf, 0.0]])
    logp = _logp()
    loss = clipped_pg_loss(logp, old, torch.tensor([1.0]), torch.tensor([[True, False, True]]))
    assert loss.item() == pytest.approx(-1.15, rel=1e-6)
    loss.backward()
    assert logp.grad is not None and bool(torch.isfinite(logp.grad).all())


def test_importance_weights_scale_each_token() -> None:
    # w = (2, 1, 0.5): −(2·1.2 + 1·0.5 + 0.5·1.1) / 3 = −3.45 / 3 = −1.15
    w = torch.tensor([[2.0, 1.0, 0.5]])
    loss = clipped_pg_loss(_logp(), OLD, torch.tensor([1.0]), MASK, is_weights=w)
    assert loss.item() == pytest.approx(-1.15, rel=1e-6)


def test_fixed_denominator_for_gradient_accumulation() -> None:
    # −2.8 / 10 instead of / 3
    loss = clipped_pg_loss(_logp(), OLD, torch.tensor([1.0]), MASK, num_tokens=10)
    assert loss.item() == pytest.approx(-0.28, rel=1e-6)


def test_normalisation_is_per_token_not_per_sequence() -> None:
    # r = 1 everywhere. Row 0: 1 token, A = +1 → ℓ = −1. Row 1: 3 tokens, A = −1 → ℓ = +1 each.
    # Token mean: (−1 + 3) / 4 = 0.5. (A mean of per-sequence means would be (−1 + 1) / 2 = 0.)
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    loss = clipped_pg_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    assert loss.item() == pytest.approx(0.5)


def test_per_token_advantages() -> None:
    # A = (1, −1, 2) per token, r = 1: L = −(1 − 1 + 2) / 3
    loss = clipped_pg_loss(torch.zeros(1, 3), OLD, torch.tensor([[1.0, -1.0, 2.0]]), MASK)
    assert loss.item() == pytest.approx(-2 / 3)


def test_no_tokens_gives_zero_that_still_backpropagates() -> None:
    logp = _logp()
    loss = clipped_pg_loss(logp, OLD, torch.tensor([1.0]), torch.zeros(1, 3, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    assert logp.grad is not None and float(logp.grad.abs().sum()) == 0.0


def test_shape_and_bound_errors() -> None:
    with pytest.raises(ValueError, match="one shape"):
        clipped_pg_loss(torch.zeros(1, 3), torch.zeros(1, 2), torch.tensor([1.0]), MASK)
    with pytest.raises(ValueError, match="clip bounds"):
        clipped_pg_loss(torch.zeros(1, 3), OLD, torch.tensor([1.0]), MASK, eps_low=1.0)
