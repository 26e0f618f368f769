"""Context classes of the sparse coder: exponent intervals chosen by dynamic programming.

Both class kinds are contiguous intervals of the old value's biased exponent, so the decoder rebuilds
a class with one compare per boundary. *Position classes* split the whole record by how often its
members change (minimising Σ n_c·H(m_c/n_c)); *value classes* split the changed elements by how far
they move (minimising the coded size of |d|). Each extra class must pay for its header bytes (and, for
position classes, one more pass at decode), which the per-class penalties stand for.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import numpy as np

from rlbus.weights.codec.format import LEVELS, MAX_CLASSES, MAX_VALUE_CLASSES

K = TypeVar("K", bound=Hashable)

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


def _partition(cost: np.ndarray, max_classes: int, penalty: float) -> list[list[int]]:
    """Optimal split of E ordered bins into ≤ max_classes contiguous classes, for a batch of R records with
    the same E.

    ``cost[r, i, j]`` is the cost of one class holding bins i..j-1 of record r (an R×(E+1)×(E+1) array, inf
    below the diagonal). Returns, per record, the first bin index of every class after the first.
    """
    e = cost.shape[1] - 1
    rows = np.arange(cost.shape[0])
    best = np.full((cost.shape[0], e + 1), np.inf)
    best[:, 0] = 0.0
    back = []
    totals = []
    for k in range(min(max_classes, e)):
        cand = best[:, :, None] + cost
        arg = np.argmin(cand, axis=1)
        best = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
        back.append(arg)
        totals.append(best[:, e] + penalty * (k + 1))
    k_best = np.argmin(np.stack(totals, axis=1), axis=1)
    out = []
    for r in rows:
        cuts = []
        j = e
        for k in range(int(k_best[r]), -1, -1):
            j = int(back[k][r, j])
            if k > 0:
                cuts.append(j)
        out.append(sorted(cuts))
    return out


def _range_costs(cum: np.ndarray) -> np.ndarray:
    """cum [R, E+1] prefix sums → [R, E+1, E+1] sums over every bin range i..j-1."""
    return cum[:, None, :] - cum[:, :, None]


def _prefix(x: np.ndarray) -> np.ndarray:
    """[R, E] → [R, E+1] prefix sums starting at 0, in ``x``'s dtype."""
    return np.concatenate([np.zeros((x.shape[0], 1), dtype=x.dtype), np.cumsum(x, axis=1)], axis=1)


def _upper(cost: np.ndarray) -> np.ndarray:
    """``cost`` with every range that is empty or reversed (i ≥ j) impossible."""
    cost = np.asarray(cost, dtype=np.float64)
    cost[:, np.tril_indices(cost.shape[1])[0], np.tril_indices(cost.shape[1])[1]] = np.inf
    return cost


def _groups(keys: Sequence[K]) -> dict[K, list[int]]:
    """Record indices by key: records whose arrays share a shape are computed together."""
    out: dict[K, list[int]] = {}
    for r, key in enumerate(keys):
        out.setdefault(key, []).append(r)
    return out


def choose_thresholds(hist_all: np.ndarray, hist_changed: np.ndarray) -> list[list[int]]:
    """Position classes of R records ([R, E] histograms of all and of changed elements' exponents): the
    exponent boundaries minimising Σ n_c·H(m_c/n_c) + a per-class penalty. Classes are exponent intervals
    so the decoder rebuilds them with one compare per boundary. Records with as many populated exponents
    are solved together: every array has the one-record shape, so each record's numbers are those it gets
    alone."""
    out: list[list[int]] = [[] for _ in range(hist_all.shape[0])]
    pops = [np.flatnonzero((a > 0) | (c > 0)) for a, c in zip(hist_all, hist_changed, strict=True)]
    keys = [(len(p),) if len(p) > 1 and c.sum() > 0 else (0,) for p, c in zip(pops, hist_changed, strict=True)]
    for (e,), rs in _groups(keys).items():
        if e == 0:
            continue
        pop = np.stack([pops[r] for r in rs])
        cum_n = _prefix(np.take_along_axis(hist_all[rs], pop, axis=1))
        cum_m = _prefix(np.take_along_axis(hist_changed[rs], pop, axis=1))
        cost = _upper(_entropy_bits(_range_costs(cum_n), _range_costs(cum_m)))
        for r, p, cuts in zip(rs, pop, _partition(cost, MAX_CLASSES, CLASS_PENALTY_BITS), strict=True):
            out[r] = [int(p[i]) for i in cuts]
    return out


def _choose_thresholds(hist_all: np.ndarray, hist_changed: np.ndarray) -> list[int]:
    """:func:`choose_thresholds` of one record."""
    return choose_thresholds(hist_all[None], hist_changed[None])[0]


def tail_kmax(tmax: int) -> int:
    """The largest Rice k the value-class choice tries for tails up to ``tmax`` (−1: no tail)."""
    return int(np.log2(float(tmax) + 1)) + 2 if tmax >= 0 else -1


def choose_value_thresholds(
    cnt: np.ndarray, above: np.ndarray, tmax: np.ndarray, tail_sums: Callable[[int, int], np.ndarray]
) -> list[list[int]]:
    """Value classes of R records: exponent boundaries minimising the coded size of |d| (levels and Rice
    tail). Step sizes scale like (update size / rounding step), so small weights take larger steps;
    exponents of changed elements are known to the decoder once positions are decoded, so this costs no
    O(n) pass. From the changed elements' statistics per exponent: ``cnt`` [R, E] (int64), ``above``
    [LEVELS, R, E] (those with |d| > l + 1), the largest tail value per record ``tmax`` (−1: none), and
    ``tail_sums(r, kmax)``: [kmax + 1, E] Σ tail >> k of record r per k in 0..kmax and exponent."""
    out: list[list[int]] = [[] for _ in range(cnt.shape[0])]
    pops = [np.flatnonzero(c) for c in cnt]
    keys = [(len(p), tail_kmax(int(t))) if len(p) > 1 else (0, 0) for p, t in zip(pops, tmax, strict=True)]
    for (e, kmax), rs in _groups(keys).items():
        if e == 0:
            continue
        pop = np.stack([pops[r] for r in rs])
        stats = [np.take_along_axis(cnt[rs], pop, axis=1),
                 *(np.take_along_axis(above[level][rs], pop, axis=1).astype(np.float64) for level in range(LEVELS))]
        rng = [_range_costs(_prefix(x)) for x in stats]
        cost = _entropy_bits(rng[0], rng[1])
        for level in range(2, LEVELS + 1):
            cost = cost + _entropy_bits(rng[level - 1], rng[level])
        if kmax >= 0:
            sums_k = np.stack([tail_sums(r, kmax) for r in rs])  # [R, kmax + 1, E]
            tail_best = np.full((len(rs), e + 1, e + 1), np.inf)
            for k in range(kmax + 1):
                sums = _prefix(np.take_along_axis(sums_k[:, k], pop, axis=1).astype(np.float64))
                tail_best = np.minimum(tail_best, _range_costs(sums) + rng[LEVELS] * (1 + k))
            cost = cost + tail_best
        for r, p, cuts in zip(rs, pop, _partition(_upper(cost), MAX_VALUE_CLASSES, VALUE_CLASS_PENALTY_BITS),
                              strict=True):
            out[r] = [int(p[i]) for i in cuts]
    return out


def _choose_value_thresholds(
    cnt: np.ndarray, above: np.ndarray, tmax: int, tail_sums: Callable[[int], np.ndarray]
) -> list[int]:
    """:func:`choose_value_thresholds` of one record (``tail_sums(kmax)``)."""
    return choose_value_thresholds(cnt[None], above[:, None], np.array([tmax]), lambda _, kmax: tail_sums(kmax))[0]
