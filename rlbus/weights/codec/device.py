"""The SPARSE coder's dense passes as torch ops, for records that live on an accelerator.

A record on a GPU is never copied to the host whole: which elements changed, every element's exponent
class, the class sizes, the rank of each changed element within its class (encode) and the positions of
given ranks (decode) are computed where the weights are, and only the compact results — m positions,
ranks and gathered bit patterns for m changed elements, a sampled exponent histogram — cross to the host,
where the entropy stage (:mod:`.sparse`, :mod:`._bits`) codes them. The outputs are exactly those of the
CPU kernels in :mod:`._kernels` (same order, same dtypes), so a delta encodes to the same bytes wherever
its tensors are; the tests run these ops on CPU tensors against the kernels.

Every function takes the flat integer view of a record (`rlbus.weights.bitview.int_flat`: int16 or int32,
signed) and works on any device. Classes are exponent intervals (:mod:`.classes`): the class of an
element is the number of thresholds at or below its biased exponent.
"""

from __future__ import annotations

import numpy as np
import torch

from rlbus.errors import ChunkCorrupt
from rlbus.weights.bitview import NP_UINT
from rlbus.weights.codec.format import _Float


def exponents(bits: torch.Tensor, fmt: _Float) -> torch.Tensor:
    """[n] uint8 biased exponent of every element (the sign bit dropped)."""
    return ((bits >> fmt.mant) & (fmt.exp_count - 1)).to(torch.uint8)


def changed(old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
    """Sorted positions where the bit patterns differ (int64, on the host)."""
    return torch.nonzero(old != new).reshape(-1).cpu().numpy()


def gather(bits: torch.Tensor, pos: np.ndarray, fmt: _Float) -> np.ndarray:
    """The bit patterns at ``pos``, as the host's unsigned view."""
    idx = torch.from_numpy(pos).to(bits.device)
    return bits[idx].cpu().numpy().view(NP_UINT[fmt.bits // 8])


def sampled_histogram(exp: torch.Tensor, stride: int, nbins: int) -> np.ndarray:
    """Histogram of ``exp[::stride]`` scaled by ``stride`` (the CPU kernel's deterministic sample)."""
    return torch.bincount(exp[::stride].to(torch.int64), minlength=256)[:nbins].cpu().numpy() * stride


def classes(exp: torch.Tensor, thresholds: list[int]) -> torch.Tensor:
    """[n] int64 class of every element: how many thresholds its exponent reaches."""
    bounds = torch.tensor(thresholds, dtype=torch.int64, device=exp.device)
    return torch.bucketize(exp.to(torch.int64), bounds, right=True)


def class_counts(cls: torch.Tensor, nclass: int) -> np.ndarray:
    return torch.bincount(cls, minlength=nclass).cpu().numpy()


def class_ranks(cls: torch.Tensor, nclass: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(members per class, class of each sorted ``pos``, its rank within its class), as `_kernels.class_ranks`."""
    idx = torch.from_numpy(pos).to(cls.device)
    at = cls[idx]
    ranks = torch.empty_like(idx)
    for c in range(nclass):  # one running count per class, read at the changed positions of that class
        mine = at == c
        if bool(mine.any()):
            ranks[mine] = (cls == c).cumsum(0)[idx[mine]] - 1
    return class_counts(cls, nclass), at.cpu().numpy(), ranks.cpu().numpy()


def class_select(
    bits: torch.Tensor, cls: torch.Tensor, counts: np.ndarray, ranks: np.ndarray, offsets: np.ndarray, fmt: _Float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Members of the given ranks (class c's strictly increasing ranks in ``ranks[offsets[c]:offsets[c+1]]``):
    (positions ascending, the class-major index of each, the old bit patterns in class-major order), as
    `_kernels.class_select`. Raises ChunkCorrupt for a rank past its class or out of order."""
    device = bits.device
    picked = []
    for c in range(len(counts)):
        want = ranks[offsets[c] : offsets[c + 1]]
        if len(want) == 0:
            continue
        if want[0] < 0 or want[-1] >= counts[c] or (len(want) > 1 and bool((np.diff(want) <= 0).any())):
            raise ChunkCorrupt("run lengths overrun their sequence")
        members = torch.nonzero(cls == c).reshape(-1)
        picked.append(members[torch.from_numpy(want).to(device)])
    if not picked:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=NP_UINT[fmt.bits // 8])
    major = torch.cat(picked)  # positions in class-major order
    pos, cm = torch.sort(major, stable=True)
    old_cm = bits[major].cpu().numpy().view(NP_UINT[fmt.bits // 8])
    return pos.cpu().numpy(), cm.cpu().numpy(), old_cm
