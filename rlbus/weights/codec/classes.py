"""Context classes of the sparse coder: exponent intervals chosen by dynamic programming.

Both class kinds are contiguous intervals of the old value's biased exponent, so the decoder rebuilds
a class with one compare per boundary. *Position classes* split the whole record by how often its
members change (minimising Σ n_c·H(m_c/n_c)); *value classes* split the changed elements by how far
they move (minimising the coded size of |d|). Each extra class must pay for its header bytes (and, for
position classes, one more pass at decode), which the per-class penalties stand for.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rlbus.weights.codec.format import LEVELS, MAX_CLASSES, MAX_VALUE_CLASSES

CLASS_PENALTY_BITS = 96  # header bytes of one more class plus one more O(n) bitmap pass at decode
VALUE_CLASS_PENALTY_BITS = 40  # its header bytes


def _class_lut(thresholds: list[int]) -> np.ndarray:
    """Exponent → class, for every byte value."""
    return np.searchsorted(np.asarray(thresholds, dtype=np.int64), np.arange(256), side="right").astype(np.int64)


def _entropy_bits(n: np.ndarray, m: np.ndarray) -> np.ndarray:
    """n·H(m/n) elementwise (0 where n == 0)."""
    n = np.maximum(n, m).astype(np.float64)
    p = np.divide(m, n, out=np.zeros_like(n), where=n > 0)
    q = 1.0 - p
    h = -(p * np.log2(np.where(p > 0, p, 1.0)) + q * np.log2(np.where(q > 0, q, 1.0)))
    return n * h


def _partition(cost: np.ndarray, max_classes: int, penalty: float) -> list[int]:
    """Optimal split of E ordered bins into ≤ max_classes contiguous classes.

    ``cost[i, j]`` is the cost of one class holding bins i..j-1 (an (E+1)×(E+1) matrix, inf below the
    diagonal). Returns the first bin index of every class after the first.
    """
    e = cost.shape[0] - 1
    best = np.full(e + 1, np.inf)
    best[0] = 0.0
    cols = np.arange(e + 1)
    back = []
    totals = []
    for k in range(min(max_classes, e)):
        cand = best[:, None] + cost
        arg = np.argmin(cand, axis=0)
        best = cand[arg, cols]
        back.append(arg)
        totals.append(best[e] + penalty * (k + 1))
    k_best = int(np.argmin(totals))
    cuts = []
    j = e
    for k in range(k_best, -1, -1):
        j = int(back[k][j])
        if k > 0:
            cuts.append(j)
    return sorted(cuts)


def _range_costs(cum: np.ndarray) -> np.ndarray:
    """cum (E+1, ...) prefix sums → (E+1, E+1, ...) sums over every bin range i..j-1."""
    return cum[None, :] - cum[:, None]


def _choose_thresholds(hist_all: np.ndarray, hist_changed: np.ndarray) -> list[int]:
    """Position classes: exponent boundaries minimising Σ n_c·H(m_c/n_c) + a per-class penalty.

    Classes are exponent intervals so the decoder rebuilds them with one compare per boundary.
    """
    pop = np.flatnonzero((hist_all > 0) | (hist_changed > 0))
    if len(pop) <= 1 or hist_changed.sum() == 0:
        return []
    cum_n = np.concatenate([[0], np.cumsum(hist_all[pop])])
    cum_m = np.concatenate([[0], np.cumsum(hist_changed[pop])])
    cost = _entropy_bits(_range_costs(cum_n), _range_costs(cum_m))
    cost[np.tril_indices(len(pop) + 1)] = np.inf
    return [int(pop[i]) for i in _partition(cost, MAX_CLASSES, CLASS_PENALTY_BITS)]


def _choose_value_thresholds(
    cnt: np.ndarray, above: np.ndarray, tmax: int, tail_sums: Callable[[int], np.ndarray]
) -> list[int]:
    """Value classes: exponent boundaries minimising the coded size of |d| (levels and Rice tail).

    Step sizes scale like (update size / rounding step), so small weights take larger steps; exponents
    of changed elements are known to the decoder once positions are decoded, so this costs no O(n) pass.
    From the changed elements' statistics per exponent: ``cnt`` (int64), ``above[l]`` (those with
    |d| > l + 1), the largest tail value ``tmax`` (−1: none), and ``tail_sums(kmax)``: Σ tail >> k per k in
    0..kmax and exponent.
    """
    pop = np.flatnonzero(cnt)
    e = len(pop)
    if e <= 1:
        return []
    stats = [cnt[pop], *(above[level][pop].astype(np.float64) for level in range(LEVELS))]
    cums = [np.concatenate([[0], np.cumsum(s)]) for s in stats]
    rng = [_range_costs(c) for c in cums]
    cost = sum(_entropy_bits(rng[level - 1], rng[level]) for level in range(1, LEVELS + 1))
    if tmax >= 0:
        kmax = int(np.log2(float(tmax) + 1)) + 2
        sums_k = tail_sums(kmax)
        tcum = rng[LEVELS]
        tail_best = np.full((e + 1, e + 1), np.inf)
        for k in range(kmax + 1):
            sums = np.concatenate([[0], np.cumsum(sums_k[k][pop].astype(np.float64))])
            tail_best = np.minimum(tail_best, _range_costs(sums) + tcum * (1 + k))
        cost = cost + tail_best
    cost = np.asarray(cost, dtype=np.float64)
    cost[np.tril_indices(e + 1)] = np.inf
    return [int(pop[i]) for i in _partition(cost, MAX_VALUE_CLASSES, VALUE_CLASS_PENALTY_BITS)]
