"""The online estimators (rlbus/rl/online.py): hand-worked advantages, baselines per key with the global
fallback, and the state a restarted trainer restores."""

from __future__ import annotations

import json

import pytest

from rlbus.rl.online import GLOBAL, OnlineBaseline, ema_advantages, loo_advantages


def test_ema_advantage_uses_the_baseline_before_each_reward() -> None:
    # b0 = 0.5, α = 0.5: A1 = 1 − 0.5 = 0.5, b1 = 0.75; A2 = 0 − 0.75, b2 = 0.375; A3 = 1 − 0.375, b3 = 0.6875
    advantages, b = ema_advantages([1.0, 0.0, 1.0], 0.5, 0.5)
    assert advantages == pytest.approx([0.5, -0.75, 0.625])
    assert b == pytest.approx(0.6875)


def test_ema_alpha_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="alpha"):
        ema_advantages([1.0], 0.5, 0.0)


def test_loo_leaves_each_sample_out_of_its_own_baseline() -> None:
    # window [1, 0]; batch [1, 1, 0]: the others of sample 0 are {1, 0, 1, 0} → mean 0.5 → A = 0.5;
    # sample 2 (r = 0): others {1, 0, 1, 1} → 0.75 → A = −0.75
    assert loo_advantages([1.0, 0.0], [1.0, 1.0, 0.0], init=0.5) == pytest.approx([0.5, 0.5, -0.75])
    assert loo_advantages([], [1.0], init=0.3) == pytest.approx([0.7])  # nobody else: the initial baseline


def test_loo_advantages_of_a_window_sum_to_zero_in_expectation() -> None:
    # Over the batch alone (empty window), RLOO's advantages are (G / (G − 1)) · (r − mean): they sum to 0.
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    assert sum(loo_advantages([], rewards, init=0.5)) == pytest.approx(0.0)


def test_sparse_keys_use_the_global_baseline_until_min_count() -> None:
    base = OnlineBaseline(estimator="ema", alpha=0.5, min_count=2, init=0.5)
    # Batch 1: a, a, b. No key has 2 rewards yet → all three use the global EMA in order: 0.5, 0.75, 0.375.
    assert base.advantages(["a", "a", "b"], [1.0, 0.0, 1.0]) == pytest.approx([0.5, -0.75, 0.625])
    assert base.value(GLOBAL) == pytest.approx(0.6875)
    # Key a now has 2 rewards: its own EMA from init 0.5 → 0.75 → 0.375; key b (1 reward) still the global.
    assert base.value("a") == pytest.approx(0.375)
    assert base.value("b") == pytest.approx(0.6875)
    assert base.advantages(["a", "b"], [1.0, 0.0]) == pytest.approx([1 - 0.375, 0 - 0.6875])


def test_loo_baseline_window_slides() -> None:
    base = OnlineBaseline(estimator="loo", window=3, min_count=0, init=0.5)
    assert base.advantages(["k"] * 4, [1.0, 1.0, 1.0, 0.0]) == pytest.approx([1 - 2 / 3, 1 - 2 / 3, 1 - 2 / 3, -1.0])
    assert list(base.keys["k"].window) == [1.0, 1.0, 0.0]  # the last three
    # Next sample: the window [1, 1, 0] is its baseline → 2/3.
    assert base.advantages(["k"], [0.0]) == pytest.approx([-2 / 3])


def test_state_round_trips_through_json() -> None:
    base = OnlineBaseline(estimator="loo", window=4, min_count=1)
    base.advantages(["x", "y", "x"], [1.0, 0.0, 0.0])
    again = OnlineBaseline(estimator="loo", window=4, min_count=1)
    again.restore(json.loads(json.dumps(base.state())))
    assert again.state() == base.state()
    assert again.advantages(["x"], [1.0]) == base.advantages(["x"], [1.0])


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="estimator"):
        OnlineBaseline(estimator="grpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        OnlineBaseline(window=0)
    with pytest.raises(ValueError, match="keys"):
        OnlineBaseline().advantages(["a"], [1.0, 0.0])
