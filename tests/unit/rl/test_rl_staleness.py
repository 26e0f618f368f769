"""Staleness filtering and histogram."""

from __future__ import annotations

import pytest
import torch

from rlbus.rl.staleness import fresh_mask, oldest_version, split_fresh, staleness, staleness_histogram

OLDEST = torch.tensor([10, 9, 7, 6])


def test_staleness_is_current_minus_oldest() -> None:
    assert staleness(10, OLDEST).tolist() == [0, 1, 3, 4]


def test_fresh_within_max_staleness() -> None:
    assert fresh_mask(10, OLDEST, max_staleness=3).tolist() == [True, True, True, False]
    assert fresh_mask(10, OLDEST, max_staleness=0).tolist() == [True, False, False, False]  # on-policy only


def test_oldest_token_decides() -> None:
    # a rollout that spans a swap (versions 7, 7, 8) is as stale as its version-7 tokens
    assert oldest_version([7, 7, 8]) == 7
    with pytest.raises(ValueError):
        oldest_version([])


def test_split_keeps_order() -> None:
    fresh, stale = split_fresh(["a", "b", "c", "d"], [10, 6, 9, 5], 10, max_staleness=1)
    assert (fresh, stale) == (["a", "c"], ["b", "d"])
    with pytest.raises(ValueError):
        split_fresh(["a"], [1, 2], 3, max_staleness=0)


def test_future_versions_and_negative_limits_are_errors() -> None:
    with pytest.raises(ValueError, match="newer"):
        staleness(5, torch.tensor([4, 6]))
    with pytest.raises(ValueError):
        fresh_mask(5, torch.tensor([5]), max_staleness=-1)


def test_histogram() -> None:
    assert staleness_histogram(10, torch.tensor([10, 8, 9, 8, 10, 10])) == {0: 3, 1: 1, 2: 2}
