"""TIS / MIS importance corrections at token and sequence level, hand-worked."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.rl.correction import log_importance_ratio, masked_is, truncated_is

# ρ = π / μ = (1.5, 0.25, 4) per token
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -3.0]])
RHO = torch.tensor([[1.5, 0.25, 4.0]])
TRAINER = BEHAVIOUR + RHO.log()
ALL = torch.ones(1, 3, dtype=torch.bool)
FIRST_TWO = torch.tensor([[True, True, False]])


def test_token_tis_truncates_at_cap() -> None:
    # min(ρ, 2) = (1.5, 0.25, 2)
    c = truncated_is(TRAINER, BEHAVIOUR, ALL, cap=2.0)
    torch.testing.assert_close(c.weights, torch.tensor([[1.5, 0.25, 2.0]]))
    assert torch.equal(c.keep, ALL)
    torch.testing.assert_close(c.log_ratio, RHO.log())


def test_token_mis_masks_outside_the_band() -> None:
    # band [0.5, 2]: 1.5 kept; 0.25 and 4 dropped
    c = masked_is(TRAINER, BEHAVIOUR, ALL, low=0.5, high=2.0)
    assert c.keep.tolist() == [[True, False, False]]
    torch.testing.assert_close(c.weights, torch.tensor([[1.5, 0.0, 0.0]]))


def test_sequence_product_and_geometric_mean() -> None:
    # product: 1.5 · 0.25 · 4 = 1.5 ; geometric: 1.5^(1/3) = 1.14471
    prod = truncated_is(TRAINER, BEHAVIOUR, ALL, cap=2.0, level="sequence", seq_agg="product")
    torch.testing.assert_close(prod.weights, torch.full((1, 3), 1.5))
    geo = truncated_is(TRAINER, BEHAVIOUR, ALL, cap=2.0, level="sequence", seq_agg="geometric")
    torch.testing.assert_close(geo.weights, torch.full((1, 3), 1.5 ** (1 / 3)))


def test_sequence_level_uses_only_loss_tokens() -> None:
    # mask (1, 1, 0): product 1.5 · 0.25 = 0.375 ; geometric sqrt(0.375) = 0.61237 ; masked token weight 0
    prod = truncated_is(TRAINER, BEHAVIOUR, FIRST_TWO, level="sequence", seq_agg="product")
    torch.testing.assert_close(prod.weights, torch.tensor([[0.375, 0.375, 0.0]]))
    geo = truncated_is(TRAINER, BEHAVIOUR, FIRST_TWO, level="sequence", seq_agg="geometric")
    torch.testing.assert_close(geo.weights, torch.tensor([[math.sqrt(0.375)] * 2 + [0.0]]))
    # MIS on the product: 0.375 < 0.5 → the whole sequence leaves the loss
    mis = masked_is(TRAINER, BEHAVIOUR, FIRST_TWO, low=0.5, high=2.0, level="sequence", seq_agg="product")
    assert not bool(mis.keep.any()) and float(mis.weights.abs().sum()) == 0.0


def test_rows_are_separate_sequences() -> None:
    # row 0: ρ = (2, 2) → product 4 → TIS cap 3 → 3 ; row 1: ρ = (0.5, 1) → product 0.5
    behaviour = torch.zeros(2, 2)
    trainer = torch.tensor([[2.0, 2.0], [0.5, 1.0]]).log()
    c = truncated_is(
        trainer, behaviour, torch.ones(2, 2, dtype=torch.bool), cap=3.0, level="sequence", seq_agg="product"
    )
    torch.testing.assert_close(c.weights, torch.tensor([[3.0, 3.0], [0.5, 0.5]]))


def test_long_products_stay_finite() -> None:
    # 200 tokens of ρ = e: the product is e^200 (overflows float32), handled in log space
    trainer, behaviour = torch.ones(1, 200), torch.zeros(1, 200)
    mask = torch.ones(1, 200, dtype=torch.bool)
    tis = truncated_is(trainer, behaviour, mask, cap=2.0, level="sequence", seq_agg="product")
    torch.testing.assert_close(tis.weights, torch.full((1, 200), 2.0))
    mis = masked_is(trainer, behaviour, mask, level="sequence", seq_agg="product")
    assert bool(torch.isfinite(mis.weights).all()) and not bool(mis.keep.any())


def test_weights_are_detached() -> None:
    trainer = TRAINER.clone().requires_grad_(True)
    assert not truncated_is(trainer, BEHAVIOUR, ALL).weights.requires_grad


def test_argument_errors() -> None:
    with pytest.raises(ValueError):
        truncated_is(TRAINER, BEHAVIOUR, ALL, cap=0.0)
    with pytest.raises(ValueError):
        masked_is(TRAINER, BEHAVIOUR, ALL, low=2.0, high=1.0)
    with pytest.raises(ValueError):
        log_importance_ratio(TRAINER, BEHAVIOUR, torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError):
        log_importance_ratio(TRAINER, BEHAVIOUR, ALL, level="batch")  # type: ignore[arg-type]
