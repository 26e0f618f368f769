"""SPARSE mode: a float record's changes coded against the old weights the receiver holds.

A version is the inference-dtype snapshot S_v (bf16, fp16 or fp32). Between RL steps only a few percent
of its elements change, mostly by ±1 unit in the last place. The codec spends its bits on what the
receiver cannot predict from what it already holds, the old weights S_{v-1}:

1. **Where.** Whether an element changes depends on its magnitude: Adam moves every weight by roughly
   the same absolute step, while the rounding step of the cast grows with the exponent, so small weights
   cross a rounding boundary far more often than large ones. Positions are coded per *position class*
   (an interval of biased exponents of the old value): within class c the class-local changed mask is a
   Bernoulli sequence with its own rate p_c, coded as Rice-coded gaps, ≈ Σ n_c·H(p_c) bits instead of
   the order-blind n·H(p). The encoder picks ≤ 8 classes by dynamic programming over the exponent
   histogram; the decoder rebuilds them from its old weights with one compare per boundary.
2. **How much.** d = ord(new) − ord(old), where ord maps sign-magnitude bits to a monotone integer (so
   crossing zero is a small step), is ±1 for most changes. Each change costs one raw sign bit (update
   directions are balanced) plus |d|, binarised into the decisions "> 1", "> 2", "> 3" (each a
   Bernoulli sequence, gap-coded) and a Rice-coded tail. Step sizes scale like update/rounding-step, so
   |d| is modelled per *value class* (exponent intervals again, ≤ 16, chosen by a second DP on the
   changed elements only, which the decoder knows once positions are decoded: no extra O(n) pass).

On the bench corpus (all-MiniLM-L6-v2, Adam at lr 3e-6, step 10) this costs 6.6 bits per changed element
against 9.3 for the order-blind entropy bound and ≥ 21 for the peers named in :mod:`rlbus.weights.codec`,
i.e. 0.66 % of the bf16 model. The per-element loops run in compiled kernels (``_kernels``, behind
``_bits``), none in Python.

The payload's byte layout is the SPARSE table in :mod:`rlbus.weights.codec.format`.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

import rlbus.weights.codec._kernels as _kernels
from rlbus.errors import ChunkCorrupt
from rlbus.weights.bitview import int_flat, np_bits
from rlbus.weights.codec import device
from rlbus.weights.codec._bits import (
    NO_PARAM,
    Reader,
    as_u8,
    best_rice_k,
    check,
    check_params,
    coded_counts,
    pack_bools,
    put_bytes,
    put_varint,
    rice_decode,
    rice_encode,
    seq_decode,
    seq_encode,
)
from rlbus.weights.codec.classes import _choose_thresholds, _choose_value_thresholds, _class_lut
from rlbus.weights.codec.format import LEVELS, MAX_CLASSES, MAX_VALUE_CLASSES, _Float

#: Run the accelerator path (:mod:`.device`, torch ops) on CPU tensors too: the tests compare it with the kernels.
FORCE_TORCH_OPS = False


class _Bits:
    """One record's bit patterns, the input of the O(n) passes (records are ≤ 2 M elements).

    CPU tensors are read in place by the compiled kernels. Accelerator tensors stay on their device, where
    torch ops (:mod:`.device`) find the changed positions, the exponent classes, their sizes, ranks and
    selects; only compact results (m positions, ranks, gathered values, a sampled histogram) reach the host.
    """

    def __init__(self, t: torch.Tensor, fmt: _Float) -> None:
        self.fmt = fmt
        self.n = t.numel()
        self.np: np.ndarray | None = None
        self.dev: torch.Tensor | None = None
        self._exp: torch.Tensor | None = None
        self._cls: tuple[list[int], torch.Tensor] | None = None
        if t.device.type == "cpu" and not FORCE_TORCH_OPS:
            self.np = np_bits(t)
        else:
            self.dev = int_flat(t)

    def changed(self, other: _Bits) -> np.ndarray:
        """Sorted positions where the bit patterns differ."""
        if self.np is not None and other.np is not None:
            return _kernels.changed_positions(self.np, other.np)
        return device.changed(self._device(), other._device())

    def gather(self, pos: np.ndarray) -> np.ndarray:
        if self.np is not None:
            return self.np[pos]
        return device.gather(self._device(), pos, self.fmt)

    def key(self) -> tuple[np.ndarray, int, int]:
        """(array, magmask, shift) of a host record: ``(array & magmask) >> shift`` is each element's biased
        exponent, and ``array & magmask`` orders elements by it (the class boundaries compare against that)."""
        assert self.np is not None
        return self.np, self.fmt.mag_mask, self.fmt.mant

    def boundaries(self, thresholds: list[int]) -> np.ndarray:
        """Class thresholds on exponents, shifted to compare with ``array & magmask``."""
        key, _, shift = self.key()
        return np.asarray(thresholds, dtype=np.int64).astype(key.dtype) << key.dtype.type(shift)

    def exp_histogram(self) -> np.ndarray:
        """Exponent histogram of (a deterministic ~64 K sample of) the elements, scaled to n."""
        stride = max(1, self.n // 65536)
        if self.np is None:
            return device.sampled_histogram(self._exponents(), stride, self.fmt.exp_count)
        key, magmask, shift = self.key()
        return _kernels.sampled_histogram(key, magmask, shift, 256, stride)[: self.fmt.exp_count]

    def class_ranks(self, thresholds: list[int], pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(members per position class, class of each sorted ``pos``, its rank within its class)."""
        if self.np is None:
            return device.class_ranks(self._classes(thresholds), len(thresholds) + 1, pos)
        key, magmask, shift = self.key()
        lut = _class_lut(thresholds)
        return _kernels.class_ranks(key, key.dtype.type(magmask), key.dtype.type(shift), self.boundaries(thresholds),
                                    lut, pos)

    def class_counts(self, thresholds: list[int]) -> np.ndarray:
        if self.np is None:
            return device.class_counts(self._classes(thresholds), len(thresholds) + 1)
        key, magmask, _ = self.key()
        return _kernels.class_counts(key, key.dtype.type(magmask), self.boundaries(thresholds))

    def class_select(
        self, thresholds: list[int], counts: np.ndarray, ranks: np.ndarray, offsets: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Members of the given ranks (class c's in ``offsets[c]:offsets[c+1]``, ``counts[c]`` members):
        (positions ascending, the class-major index of each, the old bit patterns in class-major order)."""
        if self.np is None:
            return device.class_select(self._device(), self._classes(thresholds), counts, ranks, offsets, self.fmt)
        key, magmask, shift = self.key()
        kind = key.dtype.type
        bounds, lut = self.boundaries(thresholds), _class_lut(thresholds)
        found = _kernels.class_select(key, kind(magmask), kind(shift), bounds, lut, counts, ranks, offsets)
        pos, cm, old_cm, err = found
        check(err)
        return pos, cm, old_cm

    def _exponents(self) -> torch.Tensor:
        if self._exp is None:
            self._exp = device.exponents(self._device(), self.fmt)
        return self._exp

    def _classes(self, thresholds: list[int]) -> torch.Tensor:
        if self._cls is None or self._cls[0] != thresholds:
            self._cls = (list(thresholds), device.classes(self._exponents(), thresholds))
        return self._cls[1]

    def _device(self) -> torch.Tensor:
        if self.dev is None:
            assert self.np is not None
            signed = {16: np.int16, 32: np.int32}[self.fmt.bits]
            self.dev = torch.from_numpy(self.np.view(signed))
        return self.dev


def _encode_sparse(old: _Bits, new: _Bits, changed: np.ndarray) -> bytes:
    fmt = old.fmt
    old_c = old.gather(changed)
    new_c = new.gather(changed)
    hist_changed = np.bincount((old_c & fmt.mag_mask) >> fmt.mant, minlength=fmt.exp_count)
    thresholds = _choose_thresholds(old.exp_histogram(), hist_changed)
    k = len(thresholds) + 1
    counts, cls, ranks = old.class_ranks(thresholds, changed)

    # Changed elements in class-major order (by position within a class), d = ord(new) − ord(old).
    order, exp_c, d = _kernels.sparse_encode_order(cls, old_c, new_c, k, fmt.mant, fmt.bits - 1, fmt.mag_mask)
    mag = np.abs(d)

    # Value classes, elements regrouped value-class-major; the level sequences of |d| and its tail.
    vthr = _choose_value_thresholds(exp_c, mag, fmt.exp_count)
    v = len(vthr) + 1
    vlut = _class_lut(vthr)
    lv_lengths, lv_seq, lv_local, tail, tcls, n_v = _kernels.level_sequences(vlut[exp_c], mag, v, k, LEVELS)

    # All Bernoulli sequences: K position masks, then V sequences for each of the three levels.
    all_lengths = np.concatenate([counts, lv_lengths])
    ones, params, gaps, ks = seq_encode(
        all_lengths, np.concatenate([cls[order], lv_seq]), np.concatenate([ranks[order], lv_local])
    )
    tail_k = best_rice_k(tail, tcls, v)

    out = bytearray([k, *thresholds, v, *vthr])
    for c in range(v):
        put_varint(out, int(n_v[c]))
    for i, (length, count, param) in enumerate(zip(all_lengths.tolist(), ones.tolist(), params.tolist(), strict=True)):
        if i >= k and length == 0:
            continue  # a level sequence of an empty population is not written at all
        put_varint(out, count)
        if param != NO_PARAM:
            out.append(param)
    for c in range(v):
        if ones[k + (LEVELS - 1) * v + c]:
            out.append(int(tail_k[c]))
    unary, rem = rice_encode(np.concatenate([gaps, tail]), np.concatenate([ks, tail_k[tcls]]))
    put_bytes(out, unary)
    put_bytes(out, rem)
    out += pack_bools(d < 0)
    return bytes(out)


def _read_thresholds(r: Reader, max_count: int, exp_count: int) -> list[int]:
    count = r.u8()
    if not 1 <= count <= max_count:
        raise ChunkCorrupt(f"bad class count {count}")
    thresholds = [r.u8() for _ in range(count - 1)]
    if any(b <= a for a, b in itertools.pairwise(thresholds)) or any(t >= exp_count for t in thresholds):
        raise ChunkCorrupt("bad class thresholds")
    return thresholds


def _decode_sparse(old: _Bits, r: Reader) -> tuple[np.ndarray, np.ndarray]:
    """(positions ascending, new bit patterns) of the changed elements."""
    fmt = old.fmt
    thresholds = _read_thresholds(r, MAX_CLASSES, fmt.exp_count)
    k = len(thresholds) + 1
    vthr = _read_thresholds(r, MAX_VALUE_CLASSES, fmt.exp_count)
    v = len(vthr) + 1
    n_v = np.array([r.varint(old.n) for _ in range(v)], dtype=np.int64)
    if n_v.sum() > old.n:
        raise ChunkCorrupt("more changes than elements")

    # Header: every sequence's length, ones and parameter, in stream order.
    lengths = old.class_counts(thresholds).tolist() + [0] * (LEVELS * v)
    ones = [0] * len(lengths)
    params = [NO_PARAM] * len(lengths)
    pops = n_v.tolist()
    for i in range(len(lengths)):
        if i >= k:
            c = (i - k) % v
            lengths[i] = pops[c]
            if lengths[i] == 0:
                continue
        ones[i] = r.varint(lengths[i])
        if 0 < ones[i] < lengths[i]:
            params[i] = r.u8()
        if i >= k:
            pops[(i - k) % v] = ones[i]
    tail_k = np.array([r.u8() if pops[c] else 0 for c in range(v)], dtype=np.int64)
    la, oa, pa = (np.asarray(x, dtype=np.int64) for x in (lengths, ones, params))
    check_params(la, oa, pa)
    m = int(n_v.sum())
    if int(oa[:k].sum()) != m:
        raise ChunkCorrupt("position and value counts disagree")
    counts = coded_counts(la, oa, pa)
    pk = np.where(pa >= 0, pa & 0x3F, 0)
    sym_k = np.concatenate([np.repeat(pk, counts), np.repeat(tail_k, np.asarray(pops, dtype=np.int64))])
    symbols = rice_decode(r.blob(), r.blob(), sym_k)
    neg = r.take((m + 7) // 8)
    nseq_sym = int(counts.sum())
    seq, local = seq_decode(la, oa, pa, symbols[:nseq_sym])

    # Positions: class-local ranks → positions (class-major order), then the new values.
    offsets = np.concatenate([[0], np.cumsum(oa[:k])])
    pos, cm, old_cm = old.class_select(thresholds, la[:k], local[:m], offsets)
    vlut = _class_lut(vthr)
    bits, err = _kernels.sparse_decode_values(
        old_cm,
        cm,
        vlut,
        n_v,
        seq[m:] - k,
        local[m:],
        symbols[nseq_sym:],
        as_u8(neg),
        LEVELS,
        fmt.mant,
        fmt.bits - 1,
        fmt.mag_mask,
    )
    check(err)
    return pos, bits
