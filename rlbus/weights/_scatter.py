"""The CPU swap's scatter, compiled: ``flat[positions] = values`` on bit patterns.

``torch.Tensor.index_put_`` costs ~10 ns an element on the CPU (dispatch, index checks, int64 strides per
element); a staged update is millions of elements, and the double-buffered swap scatters it twice. This
loop does ~1 ns an element. Positions come from a decoded chunk and were range-checked there; they are
checked here again, since a bad one would write outside the tensor.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def scatter(flat: np.ndarray, positions: np.ndarray, values: np.ndarray) -> bool:
    """``flat[positions[i]] = values[i]``; False (and nothing written) if a position is out of range."""
    n = flat.shape[0]
    lo = 0
    hi = 0
    for i in range(positions.shape[0]):  # a min/max reduction: vectorised, unlike a branch per element
        lo = min(lo, positions[i])
        hi = max(hi, positions[i])
    if lo < 0 or (positions.shape[0] and hi >= n):
        return False
    for i in range(positions.shape[0]):
        flat[np.uint64(positions[i])] = values[i]  # an unsigned index: no negative-index wrap-around
    return True
