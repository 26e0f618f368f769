"""Triton kernels for the SPARSE coder's O(n) passes over a batch of records on a device.

A batch is many records (≤ 2 M elements each) laid end to end in one flat integer buffer and cut into
blocks of ``BLOCK`` elements that never cross a record (:class:`Blocks`); one launch covers every block of
every record, so a whole version of a model is a handful of launches, not a few dozen per record. Each
program reads its block once and keeps what it derives in registers:

* :func:`changes` — which elements differ between old and new: per block their count, then (with the
  blocks' output offsets) their positions and bit patterns, compacted in position order;
* :func:`class_counts` — members of each position class per block (the class of an element is how many of
  its record's thresholds its magnitude bits reach);
* :func:`class_ranks` — each changed element's rank within its class: the class's members before the block
  (a prefix over the block counts) plus those before it in the block, an exclusive scan of four 16-bit
  counters packed in an int64 (two scans for up to eight classes);
* :func:`select` — the decoder's inverse: an element is changed iff its (class, rank) is set in the
  record's rank map; per block the count, then the positions, compacted in position order.

The results are exactly those of the CPU kernels (:mod:`._kernels`). On a GPU the kernels are compiled; in
a process started with ``TRITON_INTERPRET=1`` Triton's interpreter runs them on CPU tensors, which is how
the tests check them against the CPU coder bit for bit. Triton is imported when a device batch is first
coded, never by CPU-only use of the codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements a program handles: < 2**16, so the packed 16-bit prefix counters cannot overflow
WARPS = 8  # a block's scans are 4096 wide: spread over 256 threads
NCLS = 8  # position classes a record may have (the format's limit)


@dataclass(frozen=True)
class Blocks:
    """Records cut into blocks: element offset, length and record of each block (int64, on the device)."""

    start: torch.Tensor
    length: torch.Tensor
    record: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.start.shape[0])

    @staticmethod
    def of(starts: list[int], sizes: list[int], device: torch.device) -> Blocks:
        """Blocks of records laid at ``starts`` with ``sizes`` elements each."""
        size = np.asarray(sizes, dtype=np.int64)
        per = (size + BLOCK - 1) // BLOCK
        rec = np.repeat(np.arange(len(size)), per)
        within = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)
        start = np.asarray(starts, dtype=np.int64)[rec] + within * BLOCK
        length = np.minimum(BLOCK, size[rec] - within * BLOCK)
        return Blocks(*(torch.from_numpy(a).to(device) for a in (start, length, rec)))


@triton.jit
def _classes(mag, bounds_ptr, r):
    """Class of each element: how many of record r's seven shifted thresholds its magnitude reaches (unused
    thresholds are above any magnitude)."""
    cls = (mag >= tl.load(bounds_ptr + r * 7)).to(tl.int32)
    for j in tl.static_range(1, 7):
        cls += (mag >= tl.load(bounds_ptr + r * 7 + j)).to(tl.int32)
    return cls


@triton.jit
def _class_prefix(cls, valid, BLOCK: tl.constexpr):
    """Members of each element's class before it in the block: four 16-bit counters packed in an int64, so
    two scans cover eight classes."""
    shift = (16 * (cls & 3)).to(tl.int64)
    one = tl.full([BLOCK], 1, tl.int64) << shift
    lo = tl.where(valid & (cls < 4), one, 0)
    hi = tl.where(valid & (cls >= 4), one, 0)
    return (tl.where(cls < 4, tl.cumsum(lo, 0) - lo, tl.cumsum(hi, 0) - hi) >> shift) & 0xFFFF


@triton.jit
def _changes_kernel(old_ptr, new_ptr, start_ptr, len_ptr, count_ptr, slot_ptr, pos_ptr, oldc_ptr, newc_ptr,
                    WRITE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    s = tl.load(start_ptr + b)
    n = tl.load(len_ptr + b)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    o = tl.load(old_ptr + s + offs, mask=valid, other=0)
    w = tl.load(new_ptr + s + offs, mask=valid, other=0)
    chg = valid & (o != w)
    if WRITE:
        c = chg.to(tl.int32)
        slot = tl.load(slot_ptr + b) + tl.cumsum(c, 0) - c
        tl.store(pos_ptr + slot, s + offs, mask=chg)
        tl.store(oldc_ptr + slot, o, mask=chg)
        tl.store(newc_ptr + slot, w, mask=chg)
    else:
        tl.store(count_ptr + b, tl.sum(chg.to(tl.int32), 0))


@triton.jit
def _class_counts_kernel(key_ptr, start_ptr, len_ptr, rec_ptr, bounds_ptr, magmask, out_ptr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    s = tl.load(start_ptr + b)
    n = tl.load(len_ptr + b)
    r = tl.load(rec_ptr + b)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    mag = tl.load(key_ptr + s + offs, mask=valid, other=0) & magmask
    cls = _classes(mag, bounds_ptr, r)
    for c in tl.static_range(8):
        tl.store(out_ptr + b * 8 + c, tl.sum((valid & (cls == c)).to(tl.int32), 0))


@triton.jit
def _class_ranks_kernel(old_ptr, new_ptr, start_ptr, len_ptr, rec_ptr, bounds_ptr, magmask, base_ptr, slot_ptr,
                        rank_ptr, cls_ptr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    s = tl.load(start_ptr + b)
    n = tl.load(len_ptr + b)
    r = tl.load(rec_ptr + b)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    o = tl.load(old_ptr + s + offs, mask=valid, other=0)
    w = tl.load(new_ptr + s + offs, mask=valid, other=0)
    mag = o & magmask
    cls = _classes(mag, bounds_ptr, r)
    before = _class_prefix(cls, valid, BLOCK)
    rank = tl.load(base_ptr + b * 8 + cls, mask=valid, other=0) + before
    chg = valid & (o != w)
    c = chg.to(tl.int32)
    slot = tl.load(slot_ptr + b) + tl.cumsum(c, 0) - c
    tl.store(rank_ptr + slot, rank, mask=chg)
    tl.store(cls_ptr + slot, cls, mask=chg)


@triton.jit
def _select_kernel(key_ptr, start_ptr, len_ptr, rec_ptr, bounds_ptr, magmask, base_ptr, mapstart_ptr, map_ptr,
                   count_ptr, slot_ptr, pos_ptr, cls_ptr, WRITE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    s = tl.load(start_ptr + b)
    n = tl.load(len_ptr + b)
    r = tl.load(rec_ptr + b)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    mag = tl.load(key_ptr + s + offs, mask=valid, other=0) & magmask
    cls = _classes(mag, bounds_ptr, r)
    before = _class_prefix(cls, valid, BLOCK)
    rank = tl.load(base_ptr + b * 8 + cls, mask=valid, other=0) + before
    at = tl.load(mapstart_ptr + r * 8 + cls, mask=valid, other=0) + rank
    hit = valid & (tl.load(map_ptr + at, mask=valid, other=0) != 0)
    if WRITE:
        h = hit.to(tl.int32)
        slot = tl.load(slot_ptr + b) + tl.cumsum(h, 0) - h
        tl.store(pos_ptr + slot, s + offs, mask=hit)
        tl.store(cls_ptr + slot, cls, mask=hit)
    else:
        tl.store(count_ptr + b, tl.sum(hit.to(tl.int32), 0))


_KERNELS = {k.fn.__name__: k for k in (_changes_kernel, _class_counts_kernel, _class_ranks_kernel, _select_kernel)}


def _kernel(name: str, t: torch.Tensor) -> Any:
    if t.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("Triton kernels run on CPU tensors only under its interpreter (TRITON_INTERPRET=1 set "
                           "before triton is imported)")
    return _KERNELS[name]


def _slots(counts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Exclusive prefix of per-block counts (where each block writes) and their total."""
    ends = torch.cumsum(counts.to(torch.int64), 0)
    total = int(ends[-1]) if ends.numel() else 0
    return ends - counts.to(torch.int64), total


def changes(
    old: torch.Tensor, new: torch.Tensor, blocks: Blocks
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions in the flat buffer, old bits, new bits) of every element that differs, ascending, and where
    each block's changes start among them (for :func:`class_ranks`)."""
    kernel = _kernel("_changes_kernel", old)
    grid = (blocks.count,)
    counts = torch.empty(blocks.count, dtype=torch.int32, device=old.device)
    kernel[grid](old, new, blocks.start, blocks.length, counts, counts, counts, counts, counts, WRITE=False,
                 BLOCK=BLOCK, num_warps=WARPS)
    slots, m = _slots(counts)
    pos = torch.empty(m, dtype=torch.int64, device=old.device)
    old_c = torch.empty(m, dtype=old.dtype, device=old.device)
    new_c = torch.empty(m, dtype=old.dtype, device=old.device)
    if m:
        kernel[grid](old, new, blocks.start, blocks.length, counts, slots, pos, old_c, new_c, WRITE=True, BLOCK=BLOCK,
                     num_warps=WARPS)
    return pos, old_c, new_c, slots


def class_counts(key: torch.Tensor, blocks: Blocks, bounds: torch.Tensor, magmask: int) -> torch.Tensor:
    """[blocks, 8] int32 members of each class per block; ``bounds``: [records, 7] shifted thresholds."""
    out = torch.empty((blocks.count, NCLS), dtype=torch.int32, device=key.device)
    _kernel("_class_counts_kernel", key)[(blocks.count,)](key, blocks.start, blocks.length, blocks.record, bounds,
                                                          magmask, out, BLOCK=BLOCK, num_warps=WARPS)
    return out


def class_bases(counts: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """[blocks, 8] members of each class in the block's record before the block (int64)."""
    c = counts.to(torch.int64)
    excl = torch.cumsum(c, 0) - c
    first = torch.ones(blocks.count, dtype=torch.bool, device=c.device)
    first[1:] = blocks.record[1:] != blocks.record[:-1]
    start_of = torch.cummax(torch.where(first, torch.arange(blocks.count, device=c.device), 0), 0).values
    return excl - excl[start_of]


def class_ranks(
    old: torch.Tensor, new: torch.Tensor, blocks: Blocks, bounds: torch.Tensor, magmask: int, bases: torch.Tensor,
    slots: torch.Tensor, m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank within its class, class) of every changed element, in position order (``slots``, ``m``: from
    :func:`changes`)."""
    rank = torch.empty(m, dtype=torch.int64, device=old.device)
    cls = torch.empty(m, dtype=torch.int32, device=old.device)
    if m:
        _kernel("_class_ranks_kernel", old)[(blocks.count,)](old, new, blocks.start, blocks.length, blocks.record,
                                                             bounds, magmask, bases, slots, rank, cls, BLOCK=BLOCK,
                                                             num_warps=WARPS)
    return rank, cls


def select(
    key: torch.Tensor, blocks: Blocks, bounds: torch.Tensor, magmask: int, bases: torch.Tensor,
    map_start: torch.Tensor, rank_map: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in the flat buffer, class) of the elements whose (class, rank) is set in the rank map
    (``map_start[r, c]``: where record r's class c starts in ``rank_map``), ascending."""
    kernel = _kernel("_select_kernel", key)
    grid = (blocks.count,)
    counts = torch.empty(blocks.count, dtype=torch.int32, device=key.device)
    args = (key, blocks.start, blocks.length, blocks.record, bounds, magmask, bases, map_start, rank_map)
    kernel[grid](*args, counts, counts, counts, counts, WRITE=False, BLOCK=BLOCK, num_warps=WARPS)
    slots, m = _slots(counts)
    pos = torch.empty(m, dtype=torch.int64, device=key.device)
    cls = torch.empty(m, dtype=torch.int32, device=key.device)
    if m:
        kernel[grid](*args, counts, slots, pos, cls, WRITE=True, BLOCK=BLOCK, num_warps=WARPS)
    return pos, cls
