"""Nearest-rank percentiles: always a measured value."""

from __future__ import annotations

from rlbus.observe.stats import percentile


def test_percentile_is_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0  # rank ceil(2.5) = 3
    assert percentile(values, 99) == 5.0
    assert percentile(values, 100) == 5.0
    assert percentile([0.5, 1.5], 50) == 0.5  # not interpolated to 1.0
    assert percentile([7.0], 99) == 7.0
