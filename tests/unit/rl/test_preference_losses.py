"""DPO and IPO losses against hand-worked values: h = 0 gives log 2, label smoothing mixes in the flipped
pair, IPO regresses h onto 1/(2β), the rewards are β·(policy − reference), and the reference is a constant."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.rl.preference import preference_loss


def t(*values: float, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, requires_grad=grad)


def test_policy_equal_to_reference_gives_log_2_for_any_smoothing() -> None:
    for eps in (0.0, 0.1, 0.3):
        terms = preference_loss(t(-3.0, -7.0), t(-4.0, -1.0), t(-3.0, -7.0), t(-4.0, -1.0), beta=0.1,
                                label_smoothing=eps)
        assert float(terms.loss) == pytest.approx(math.log(2))
        assert terms.margins.tolist() == [0.0, 0.0]
        assert float(terms.accuracy) == 0.0  # a tie is not a win


def test_sigmoid_value_rewards_and_margin() -> None:
    # chosen: −1 − (−2) = 1, rejected: −3 − (−2) = −1, h = 2, βh = 1 → −log σ(1) = log(1 + e⁻¹) = 0.313262
    terms = preference_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5)
    assert float(terms.loss) == pytest.approx(0.313262, abs=1e-6)
    assert terms.chosen_rewards.tolist() == [0.5]
    assert terms.rejected_rewards.tolist() == [-0.5]
    assert terms.margins.tolist() == [1.0]
    assert float(terms.accuracy) == 1.0


def test_label_smoothing_adds_the_flipped_pair() -> None:
    # −log σ(−1) = 1 + (−log σ(1)): 0.9 · 0.313262 + 0.1 · 1.313262 = 0.413262
    terms = preference_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5, label_smoothing=0.1)
    assert float(terms.loss) == pytest.approx(0.413262, abs=1e-6)


def test_ipo_regresses_h_onto_one_over_two_beta() -> None:
    # h = 2: β = 0.5 → (2 − 1)² = 1; β = 0.1 → (2 − 5)² = 9; h = 0, β = 0.5 → 1
    assert float(preference_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5, kind="ipo").loss) == pytest.approx(1.0)
    assert float(preference_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.1, kind="ipo").loss) == pytest.approx(9.0)
    assert float(preference_loss(t(-2.0), t(-2.0), t(-2.0), t(-2.0), beta=0.5, kind="ipo").loss) == pytest.approx(1.0)


def test_loss_is_the_mean_over_pairs_and_accuracy_counts_wins() -> None:
    # pair 0: h = 2 (βh = 1), pair 1: h = −2 (βh = −1): (0.313262 + 1.313262) / 2
    terms = preference_loss(t(-1.0, -3.0), t(-3.0, -1.0), t(-2.0, -2.0), t(-2.0, -2.0), beta=0.5)
    assert float(terms.loss) == pytest.approx(0.813262, abs=1e-6)
    assert float(terms.accuracy) == 0.5


def test_gradients_flow_to_the_policy_only() -> None:
    # sigmoid at h = 0: ∂ℓ/∂pc = −β σ(−βh) = −β/2; IPO at h = 2, β = 0.5: ∂ℓ/∂pc = 2 (h − 1) = 2
    pc, pr, rc, rr = t(-2.0, grad=True), t(-2.0, grad=True), t(-2.0, grad=True), t(-2.0, grad=True)
    preference_loss(pc, pr, rc, rr, beta=0.5).loss.backward()
    assert pc.grad is not None and pr.grad is not None
    assert float(pc.grad) == pytest.approx(-0.25) and float(pr.grad) == pytest.approx(0.25)
    assert rc.grad is None and rr.grad is None
    pc, pr = t(-1.0, grad=True), t(-3.0, grad=True)
    preference_loss(pc, pr, t(-2.0), t(-2.0), beta=0.5, kind="ipo").loss.backward()
    assert pc.grad is not None and pr.grad is not None
    assert float(pc.grad) == pytest.approx(2.0) and float(pr.grad) == pytest.approx(-2.0)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"\[P\]"):
        preference_loss(t(0.0, 0.0), t(0.0), t(0.0), t(0.0), beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        preference_loss(t(0.0), t(0.0), t(0.0), t(0.0), beta=0.0)
    with pytest.raises(ValueError, match="sigmoid"):
        preference_loss(t(0.0), t(0.0), t(0.0), t(0.0), beta=0.1, kind="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="unknown"):
        preference_loss(t(0.0), t(0.0), t(0.0), t(0.0), beta=0.1, kind="hinge")  # type: ignore[arg-type]
