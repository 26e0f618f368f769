"""Summary statistics over measured samples, shared by the run report, the demo and the benchmarks.

Nearest-rank percentiles: the value reported is always one that was measured, never an interpolation
between two, so a p99 of swap pauses is a pause that happened.
"""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]
