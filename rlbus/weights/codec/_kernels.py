"""Compiled (numba) kernels of the SPARSE coder: a record's whole encode in four calls, its decode in one.

Encoding a record runs :func:`scan_changes` (old and new 64 elements a word: at each changed element its
position, old exponent and step d = ord(new) − ord(old), and the statistics both class choices need), then
the class choices (numpy, :mod:`.classes`), :func:`class_major` (each change's rank within its position
class, filed straight into class-major order), :func:`sequences` (every Bernoulli sequence's coded gaps
and the Rice tails) and :func:`rice_streams` (each sequence's k, the two bit streams). Decoding is
:func:`decode_sparse`: the header (:func:`parse_head`, the class sizes from one mask pass,
:func:`parse_sequences`, :func:`parse_streams`), every Rice symbol straight into the position classes'
rank bitmaps and the level lists (:func:`decode_symbols`), the changed positions in one pass
(:func:`select`) and the new bit patterns (:func:`values`). No symbol, gap or (sequence, position) array
is materialised between passes and nothing runs in Python per element or per sequence.

The O(n) passes work a word of 64 elements at a time (:mod:`._simd`): one vector compare per class
boundary gives the boundary's mask, a class's members are the difference of two masks, and ranks and
selects are popcounts and bit deposits on words. Each pass makes the masks of a block of words first (a
loop of vector compares only, which LLVM keeps vectorised) and then does the scalar work, one class at a
time so that a class's running count is the only dependency; work per changed element gets loops of its
own (mixing them into the mask loop costs 2–3× here).

Every kernel is ``nogil`` (workers decode in threads next to generation) and ``cache=True`` (the first
process compiles, later ones load machine code from ``__pycache__``; :mod:`.warm`). Kernels that read
untrusted bytes bounds-check everything themselves and return an error code (``ERR_*``, non-zero) instead
of raising; :func:`rlbus.weights.codec._bits.check` turns it into :class:`~rlbus.errors.ChunkCorrupt`.
Bit order is LSB-first throughout. The byte layout is the SPARSE table in :mod:`.format`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from rlbus.weights.codec._bits import (  # the error codes the kernels return
    ERR_CLASSES,
    ERR_COUNTS,
    ERR_FIELDS,
    ERR_OK,
    ERR_OVERRUN,
    ERR_PADDING,
    ERR_PARAM,
    ERR_POPULATION,
    ERR_RANGE,
    ERR_TRUNCATED,
    ERR_UNARY,
    ERR_VALUE,
    ERR_VARINT,
)
from rlbus.weights.codec._simd import ge_mask64, ne_mask64, pdep, popcount, tzcnt
from rlbus.weights.codec.format import MAX_CLASSES, MAX_VALUE_CLASSES

_LOW_MASKS = np.array([(1 << k) - 1 for k in range(64)] + [(1 << 64) - 1], dtype=np.uint64)


@njit(cache=True, nogil=True, inline="always")
def _class_of(v: np.int64, thr: np.ndarray) -> int:
    c = 0
    for j in range(thr.shape[0]):
        c += v >= thr[j]
    return c


@njit(cache=True, nogil=True, inline="always")
def _take_bits(bm: np.ndarray, at: int, count: int) -> np.uint64:
    """``count`` (0..64) bits of the bitmap ``bm`` starting at bit ``at``; bm has a word past the end."""
    w = at >> 6
    s = np.uint64(at & 63)
    x = (bm[w] >> s) | ((bm[w + 1] << np.uint64(1)) << (np.uint64(63) - s))
    return x & _LOW_MASKS[count]


@njit(cache=True, nogil=True, inline="always")
def _ord(b: np.int64, sign_bit: int, mag_mask: int) -> np.int64:
    """Sign-magnitude bits → an integer monotone in the float value (−0.0 → −1, +0.0 → 0)."""
    return -(b & mag_mask) - 1 if (b >> sign_bit) & 1 else b


_BLOCK = 64  # words of 64 elements whose masks are made before the scalar work on them


@njit(cache=True, nogil=True, inline="always")
def _class_words(nthr: int) -> np.ndarray:
    """Scratch for a block's class masks: row j + 1 = mask(key & magmask ≥ thr[j]), row 0 all ones, the
    last row none, so class c's members in a word are ``row c & ~row c + 1``."""
    gw = np.zeros((nthr + 2, _BLOCK), dtype=np.uint64)
    gw[0, :] = ~np.uint64(0)
    return gw


@njit(cache=True, nogil=True, inline="always")
def _fill_class_words(key: np.ndarray, w0: int, w1: int, magmask: np.integer, thr: np.ndarray, gw: np.ndarray) -> None:
    """The threshold masks of words ``w0 .. w1 - 1`` (vector compares only, one threshold at a time)."""
    for t in range(thr.shape[0]):
        for w in range(w0, w1):
            gw[t + 1, w - w0] = ge_mask64(key, 64 * w, magmask, thr[t])

@njit(cache=True, nogil=True)
def class_counts(key: np.ndarray, magmask: np.integer, thr: np.ndarray) -> np.ndarray:
    """Members per class (``thr``: the K-1 ascending thresholds, shifted to compare with ``key & magmask``)."""
    n = key.shape[0]
    nthr = thr.shape[0]
    gw = _class_words(nthr)
    counts = np.zeros(nthr + 1, dtype=np.int64)
    nw = n // 64
    for w0 in range(0, nw, _BLOCK):
        w1 = min(w0 + _BLOCK, nw)
        _fill_class_words(key, w0, w1, magmask, thr, gw)
        for c in range(nthr + 1):
            run = counts[c]
            for col in range(w1 - w0):
                run += popcount(gw[c, col] & ~gw[c + 1, col])
            counts[c] = run
    for i in range(nw * 64, n):
        counts[_class_of(np.int64(key[i] & magmask), thr)] += 1
    return counts


@njit(cache=True, nogil=True)
def class_masks(key: np.ndarray, magmask: np.integer, thr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Members per class, and every word's threshold masks (row j + 1: mask of ``key & magmask ≥ thr[j]``,
    row 0 all ones, the last row none) for :func:`select` to reuse instead of comparing again."""
    n = key.shape[0]
    nthr = thr.shape[0]
    nw = n // 64
    gw = np.zeros((nthr + 2, max(nw, 1)), dtype=np.uint64)
    gw[0, :] = ~np.uint64(0)
    counts = np.zeros(nthr + 1, dtype=np.int64)
    for t in range(nthr):
        for w in range(nw):
            gw[t + 1, w] = ge_mask64(key, 64 * w, magmask, thr[t])
    for c in range(nthr + 1):
        run = 0
        for w in range(nw):
            run += popcount(gw[c, w] & ~gw[c + 1, w])
        counts[c] = run
    for i in range(nw * 64, n):
        counts[_class_of(np.int64(key[i] & magmask), thr)] += 1
    return counts, gw


# ------------------------------------------------------------------------------------------ encode


@njit(cache=True, nogil=True)
def scan_changes(
    old: np.ndarray, new: np.ndarray, magmask: int, mant: int, sign_bit: int, exp_count: int, levels: int, stride: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """One pass over a record: the changed elements and what the class choices need.

    Returns (positions ascending, old exponent of each, d = ord(new) − ord(old) of each, histogram of the
    changed elements' exponents, ``above[l, e]`` = changed elements of exponent e with |d| > l + 1, the
    histogram of every ``stride``-th old exponent times ``stride`` (256 bins), the largest |d| − levels − 1).
    """
    n = old.shape[0]
    nw = n // 64
    words = np.empty(_BLOCK + 1, dtype=np.uint64)
    cap = 1024
    pos = np.empty(cap, dtype=np.int64)
    exps = np.empty(cap, dtype=np.uint8)
    dd = np.empty(cap, dtype=np.int64)
    hist = np.zeros(exp_count, dtype=np.int64)
    above = np.zeros((levels, exp_count), dtype=np.int64)
    sampled = np.zeros(256, dtype=np.int64)
    tmax = -1
    nxt = 0
    j = 0
    for w0 in range(0, nw + 1, _BLOCK):
        # Masks of a block of words first (vector compares only: LLVM keeps this loop vectorised), then
        # the scalar work at the changed elements while the block is still in cache.
        w1 = min(w0 + _BLOCK, nw + 1)
        found = 0
        for w in range(w0, w1):
            if w < nw:
                x = ne_mask64(old, new, 64 * w)
            else:
                x = np.uint64(0)
                for i in range(64 * nw, n):
                    if old[i] != new[i]:
                        x |= np.uint64(1) << np.uint64(i - 64 * nw)
            words[w - w0] = x
            found += popcount(x)
        top = min(64 * w1, n)
        while nxt < top:
            sampled[(np.int64(old[nxt]) & magmask) >> mant] += 1
            nxt += stride
        if j + found > cap:
            cap = max(2 * cap, j + found)
            pos2 = np.empty(cap, dtype=np.int64)
            exps2 = np.empty(cap, dtype=np.uint8)
            dd2 = np.empty(cap, dtype=np.int64)
            pos2[:j] = pos[:j]
            exps2[:j] = exps[:j]
            dd2[:j] = dd[:j]
            pos, exps, dd = pos2, exps2, dd2
        for w in range(w0, w1):
            x = words[w - w0]
            b = 64 * w
            while x:
                p = b + tzcnt(x)
                x &= x - np.uint64(1)
                o = np.int64(old[p])
                e = (o & magmask) >> mant
                d = _ord(np.int64(new[p]), sign_bit, magmask) - _ord(o, sign_bit, magmask)
                pos[j] = p
                exps[j] = e
                dd[j] = d
                j += 1
                hist[e] += 1
                mag = int(abs(d))
                for lv in range(levels):
                    if mag > lv + 1:
                        above[lv, e] += 1
                if mag - levels - 1 > tmax:
                    tmax = mag - levels - 1
    return pos[:j], exps[:j], dd[:j], hist, above, sampled * stride, tmax


@njit(cache=True, nogil=True)
def tail_sums(exps: np.ndarray, d: np.ndarray, nexp: int, levels: int, kmax: int) -> np.ndarray:
    """Σ (|d| − levels − 1) >> k over the changed elements with |d| > levels, per k in 0..kmax and exponent."""
    out = np.zeros((kmax + 1, nexp), dtype=np.int64)
    for i in range(d.shape[0]):
        mag = abs(d[i])
        if mag > levels:
            tv = mag - levels - 1
            for k in range(kmax + 1):
                out[k, exps[i]] += tv >> k
    return out


@njit(cache=True, nogil=True)
def class_major(
    key: np.ndarray,
    magmask: np.integer,
    thr: np.ndarray,
    lut: np.ndarray,
    pos: np.ndarray,
    exps: np.ndarray,
    d: np.ndarray,
    offsets: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rank every change within its position class and file it in class-major order.

    ``thr``: the K-1 class thresholds shifted to compare with ``key & magmask``; ``offsets``: where each
    class's changes start in class-major order (from the changed exponent histogram). Returns (members
    per class, rank of each change within its class, its exponent, |d|, sign bits of d packed LSB-first),
    all but the first in class-major order.
    """
    n = key.shape[0]
    nthr = thr.shape[0]
    m = pos.shape[0]
    ncls = nthr + 1
    gw = _class_words(nthr)
    before = np.zeros((ncls, _BLOCK), dtype=np.int64)  # members of each class before each word of a block
    counts = np.zeros(ncls, dtype=np.int64)  # members of each class before the block
    rank = np.empty(m, dtype=np.int64)
    nw = n // 64
    j = 0
    for w0 in range(0, nw, _BLOCK):
        w1 = min(w0 + _BLOCK, nw)
        _fill_class_words(key, w0, w1, magmask, thr, gw)
        for c in range(ncls):  # one class at a time: its running count is the only dependency
            run = counts[c]
            for col in range(w1 - w0):
                before[c, col] = run
                run += popcount(gw[c, col] & ~gw[c + 1, col])
            counts[c] = run
        while j < m and pos[j] < 64 * w1:
            col = (pos[j] >> 6) - w0
            c = lut[exps[j]]
            below = (np.uint64(1) << np.uint64(pos[j] & 63)) - np.uint64(1)
            rank[j] = before[c, col] + popcount(gw[c, col] & ~gw[c + 1, col] & below)
            j += 1
    for i in range(nw * 64, n):
        c = _class_of(np.int64(key[i] & magmask), thr)
        if j < m and pos[j] == i:
            rank[j] = counts[c]
            j += 1
        counts[c] += 1
    # Filed into class-major order in a loop of its own (faster than inside the one above).
    ranks = np.empty(m, dtype=np.int64)
    cm_exp = np.empty(m, dtype=np.uint8)
    cm_mag = np.empty(m, dtype=np.int64)
    neg = np.zeros((m + 7) >> 3, dtype=np.uint8)
    ptr = offsets[:-1].copy()
    for j in range(m):
        e = exps[j]
        c = lut[e]
        q = ptr[c]
        ptr[c] = q + 1
        ranks[q] = rank[j]
        cm_exp[q] = e
        cm_mag[q] = abs(d[j])
        if d[j] < 0:
            neg[q >> 3] |= np.uint8(1 << (q & 7))
    return counts, ranks, cm_exp, cm_mag, neg


@njit(cache=True, nogil=True, inline="always")
def _gaps_of(
    listed: np.ndarray, lo: int, hi: int, length: int, invert: bool, gaps: np.ndarray, g: int
) -> tuple[int, int, int]:
    """Coded gaps of one sequence whose ones are ``listed[lo:hi]`` (ascending, < length): the gaps between
    its ones, or between its zeros when ``invert``. Appends to ``gaps`` from ``g``; returns (new g, count,
    sum of the gaps)."""
    start = g
    tot = 0
    prev = -1
    if invert:
        p = 0
        for t in range(lo, hi + 1):
            stop = listed[t] if t < hi else length
            while p < stop:
                gaps[g] = p - prev - 1
                tot += p - prev - 1
                g += 1
                prev = p
                p += 1
            p = stop + 1
    else:
        for t in range(lo, hi):
            gaps[g] = listed[t] - prev - 1
            tot += listed[t] - prev - 1
            g += 1
            prev = listed[t]
    return g, g - start, tot


@njit(cache=True, nogil=True)
def sequences(
    counts: np.ndarray,
    offsets: np.ndarray,
    ranks: np.ndarray,
    cm_exp: np.ndarray,
    cm_mag: np.ndarray,
    vlut: np.ndarray,
    nv: int,
    levels: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
           np.ndarray, np.ndarray, np.ndarray]:
    """Every Bernoulli sequence of a record and its coded gaps, then the Rice tails.

    Sequences: the K position classes (length: members, ones: changed members at their ranks), then level
    l = 1..levels of each value class v (length: its changes with |d| ≥ l in value-class-major order, ones:
    those with |d| > l). Returns (lengths, ones, invert flags, coded gaps of every sequence in order, gaps
    per sequence, their sums, tail values |d| − levels − 1 in value-class-major order, their value classes,
    tails per value class and their sums, changes per value class).
    """
    k = counts.shape[0]
    m = ranks.shape[0]
    nseq = k + levels * nv
    lengths = np.zeros(nseq, dtype=np.int64)
    ones = np.zeros(nseq, dtype=np.int64)
    invert = np.zeros(nseq, dtype=np.bool_)
    gcount = np.zeros(nseq, dtype=np.int64)
    gsum = np.zeros(nseq, dtype=np.int64)
    gaps = np.empty(4 * m + 1, dtype=np.int64)
    g = 0
    for c in range(k):
        lengths[c] = counts[c]
        ones[c] = offsets[c + 1] - offsets[c]
        invert[c] = 2 * ones[c] > lengths[c]
        g, gcount[c], gsum[c] = _gaps_of(ranks, offsets[c], offsets[c + 1], lengths[c], invert[c], gaps, g)
    # value-class-major regrouping of |d| (stable)
    start = np.zeros(nv + 1, dtype=np.int64)
    for q in range(m):
        start[vlut[cm_exp[q]] + 1] += 1
    n_v = start[1:].copy()
    for c in range(nv):
        start[c + 1] += start[c]
    fill = start[:-1].copy()
    vmag = np.empty(m, dtype=np.int64)
    for q in range(m):
        c = vlut[cm_exp[q]]
        vmag[fill[c]] = cm_mag[q]
        fill[c] += 1
    listed = np.empty(m + 1, dtype=np.int64)
    ntail = 0
    for lv in range(1, levels + 1):
        for c in range(nv):
            s = k + (lv - 1) * nv + c
            member = 0
            on = 0
            for i in range(start[c], start[c + 1]):
                if vmag[i] >= lv:
                    if vmag[i] > lv:
                        listed[on] = member
                        on += 1
                    member += 1
            lengths[s] = member
            ones[s] = on
            invert[s] = 2 * on > member
            g, gcount[s], gsum[s] = _gaps_of(listed, 0, on, member, invert[s], gaps, g)
            if lv == levels:
                ntail += on
    tail = np.empty(ntail, dtype=np.int64)
    tcls = np.empty(ntail, dtype=np.int64)
    tcount = np.zeros(nv, dtype=np.int64)
    tsum = np.zeros(nv, dtype=np.int64)
    t = 0
    for c in range(nv):
        for i in range(start[c], start[c + 1]):
            if vmag[i] > levels:
                tail[t] = vmag[i] - levels - 1
                tcls[t] = c
                tcount[c] += 1
                tsum[c] += tail[t]
                t += 1
    return lengths, ones, invert, gaps[:g], gcount, gsum, tail, tcls, tcount, tsum, n_v


@njit(cache=True, nogil=True, inline="always")
def _best_of(values: np.ndarray, lo: int, hi: int, cand: np.ndarray, row: int) -> int:
    """The candidate k of ``cand[row]`` that codes ``values[lo:hi]`` in the fewest bits (first on ties)."""
    best = -1
    kbest = 0
    for t in range(cand.shape[1]):
        k = cand[row, t]
        cost = 0
        for i in range(lo, hi):
            cost += (values[i] >> k) + 1 + k
        if best < 0 or cost < best:
            best = cost
            kbest = k
    return kbest


@njit(cache=True, nogil=True)
def rice_streams(
    gaps: np.ndarray, gcount: np.ndarray, cand: np.ndarray, tail: np.ndarray, tcls: np.ndarray, tcand: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pick every sequence's and value class's Rice k among its candidates and write the streams: every
    gap in sequence order, then the tails. Returns (unary bytes, remainder bytes, k per sequence, k per
    value class)."""
    nseq = gcount.shape[0]
    nv = tcand.shape[0]
    ks = np.zeros(nseq, dtype=np.int64)
    tk = np.zeros(nv, dtype=np.int64)
    lo = 0
    for s in range(nseq):
        ks[s] = _best_of(gaps, lo, lo + gcount[s], cand, s)
        lo += gcount[s]
    tstart = np.zeros(nv + 1, dtype=np.int64)
    for i in range(tcls.shape[0]):
        tstart[tcls[i] + 1] += 1
    for c in range(nv):
        tstart[c + 1] += tstart[c]
        tk[c] = _best_of(tail, tstart[c], tstart[c + 1], tcand, c)
    ubits = 0
    rbits = 0
    lo = 0
    for s in range(nseq):
        for i in range(lo, lo + gcount[s]):
            ubits += (gaps[i] >> ks[s]) + 1
        rbits += gcount[s] * ks[s]
        lo += gcount[s]
    for i in range(tail.shape[0]):
        ubits += (tail[i] >> tk[tcls[i]]) + 1
        rbits += tk[tcls[i]]
    unary = np.zeros((ubits + 7) >> 3, dtype=np.uint8)
    words = np.zeros((rbits >> 6) + 2, dtype=np.uint64)
    bit = -1
    off = 0
    lo = 0
    for s in range(nseq + 1):
        if s < nseq:
            k = ks[s]
            a, z = lo, lo + gcount[s]
            lo = z
            vals = gaps
        else:
            k = 0
            a, z = 0, tail.shape[0]
            vals = tail
        for i in range(a, z):
            v = vals[i]
            if s == nseq:
                k = tk[tcls[i]]
            bit += (v >> k) + 1
            unary[bit >> 3] |= np.uint8(1 << (bit & 7))
            if k:
                r = np.uint64(v) & _LOW_MASKS[k]
                w = off >> 6
                sh = off & 63
                words[w] |= r << np.uint64(sh)
                if sh + k > 64:
                    words[w + 1] |= r >> np.uint64(64 - sh)
                off += k
    return unary, words.view(np.uint8)[: (rbits + 7) >> 3].copy(), ks, tk


# ------------------------------------------------------------------------------------------ decode


@njit(cache=True, nogil=True, inline="always")
def _varint(buf: np.ndarray, at: int, end: int, limit: int) -> tuple[int, int, int]:
    """(value, next offset, error) of the LEB128 varint at ``at``; values above ``limit`` are an error."""
    value = 0
    shift = 0
    while True:
        if at >= end:
            return 0, at, ERR_TRUNCATED
        b = int(buf[at])
        at += 1
        if shift == 63 and (b & 0x7F) != 0:
            return 0, at, ERR_VARINT
        value |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
        if shift > 63:
            return 0, at, ERR_VARINT
    if value > limit:
        return 0, at, ERR_VARINT
    return value, at, ERR_OK


@njit(cache=True, nogil=True, inline="always")
def _thresholds(buf: np.ndarray, at: int, end: int, max_count: int, exp_count: int) -> tuple[np.ndarray, int, int]:
    """A class table: u8 count, then count − 1 strictly increasing thresholds below ``exp_count``."""
    if at >= end:
        return np.zeros(0, dtype=np.int64), at, ERR_TRUNCATED
    count = int(buf[at])
    at += 1
    if count < 1 or count > max_count:
        return np.zeros(0, dtype=np.int64), at, ERR_CLASSES
    if at + count - 1 > end:
        return np.zeros(0, dtype=np.int64), at, ERR_TRUNCATED
    thr = np.empty(count - 1, dtype=np.int64)
    for j in range(count - 1):
        thr[j] = buf[at + j]
        if thr[j] >= exp_count or (j and thr[j] <= thr[j - 1]):
            return thr, at, ERR_CLASSES
    return thr, at + count - 1, ERR_OK


@njit(cache=True, nogil=True, inline="always")
def _words(buf: np.ndarray, at: int, length: int) -> np.ndarray:
    """``buf[at:at + length]`` as zero-padded little-endian uint64 words (one spare word at the end)."""
    words = np.zeros((length >> 3) + 2, dtype=np.uint64)
    raw = words.view(np.uint8)
    raw[:length] = buf[at : at + length]
    return words


@njit(cache=True, nogil=True, inline="always")
def _next_one(uw: np.ndarray, wi: int, cur: np.uint64) -> tuple[int, int, np.uint64]:
    """Bit index of the next set bit of the unary stream (−1 past its end) and the reader's new state."""
    while cur == 0:
        wi += 1
        if wi >= uw.shape[0]:
            return -1, wi, cur
        cur = uw[wi]
    return wi * 64 + tzcnt(cur), wi, cur & (cur - np.uint64(1))


@njit(cache=True, nogil=True, inline="always")
def _symbol(
    uw: np.ndarray, rw: np.ndarray, wi: int, cur: np.uint64, prev: int, off: int, k: int
) -> tuple[int, int, np.uint64, int, int, int]:
    """The next Rice symbol of parameter ``k`` (≤ 62): its quotient from the unary stream (the zeros
    before the next one), its remainder from the remainder stream. Returns (value, the unary reader's word
    and bits left, the last one's bit, the remainder offset, error)."""
    while cur == 0:
        wi += 1
        if wi >= uw.shape[0]:
            return 0, wi, cur, prev, off, ERR_UNARY
        cur = uw[wi]
    bit = wi * 64 + tzcnt(cur)
    cur &= cur - np.uint64(1)
    q = bit - prev - 1
    if (q >> (62 - k)) != 0:
        return 0, wi, cur, bit, off, ERR_RANGE
    if k == 0:
        return q, wi, cur, bit, off, ERR_OK
    return (q << k) | _bits_at(rw, off, k), wi, cur, bit, off + k, ERR_OK


@njit(cache=True, nogil=True, inline="always")
def _bits_at(rw: np.ndarray, off: int, k: int) -> int:
    """``k`` (0..62) bits of the remainder stream from bit ``off``."""
    w = off >> 6
    s = off & 63
    v = rw[w] >> np.uint64(s)
    if s and s + k > 64:
        v |= rw[w + 1] << np.uint64(64 - s)
    return int(v & _LOW_MASKS[k])


@njit(cache=True, nogil=True)
def parse_head(
    buf: np.ndarray, at: int, end: int, n: int, exp_count: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """The part of a SPARSE header read before the class sizes are known: (position thresholds, value
    thresholds, changes per value class, next offset, error)."""
    none = np.zeros(0, dtype=np.int64)
    thr, at, err = _thresholds(buf, at, end, MAX_CLASSES, exp_count)
    if err:
        return none, none, none, at, err
    vthr, at, err = _thresholds(buf, at, end, MAX_VALUE_CLASSES, exp_count)
    if err:
        return none, none, none, at, err
    nv = vthr.shape[0] + 1
    n_v = np.zeros(nv, dtype=np.int64)
    m = 0
    for c in range(nv):
        n_v[c], at, err = _varint(buf, at, end, n)
        if err:
            return none, none, none, at, err
        m += n_v[c]
    if m > n:
        return none, none, none, at, ERR_COUNTS
    return thr, vthr, n_v, at, ERR_OK


@njit(cache=True, nogil=True)
def parse_sequences(
    buf: np.ndarray, at: int, end: int, counts: np.ndarray, n_v: np.ndarray, levels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]:
    """The rest of the header, given the position classes' sizes ``counts``: every sequence's (length,
    ones, parameter byte or −1), the value classes' tail k, next offset, error."""
    k = counts.shape[0]
    nv = n_v.shape[0]
    nseq = k + levels * nv
    lengths = np.zeros(nseq, dtype=np.int64)
    ones = np.zeros(nseq, dtype=np.int64)
    params = np.full(nseq, -1, dtype=np.int64)
    tail_k = np.zeros(nv, dtype=np.int64)
    pops = n_v.copy()
    m = 0
    for c in range(nv):
        m += n_v[c]
    for i in range(nseq):
        if i < k:
            lengths[i] = counts[i]
        else:
            lengths[i] = pops[(i - k) % nv]
            if lengths[i] == 0:
                continue
        ones[i], at, err = _varint(buf, at, end, lengths[i])
        if err:
            return lengths, ones, params, tail_k, at, err
        if 0 < ones[i] < lengths[i]:
            if at >= end:
                return lengths, ones, params, tail_k, at, ERR_TRUNCATED
            params[i] = buf[at]
            at += 1
            if params[i] & 0x40:
                return lengths, ones, params, tail_k, at, ERR_PARAM
        if i >= k:
            pops[(i - k) % nv] = ones[i]
    for c in range(nv):
        if pops[c]:
            if at >= end:
                return lengths, ones, params, tail_k, at, ERR_TRUNCATED
            tail_k[c] = buf[at]
            at += 1
    total = 0
    for c in range(k):
        total += ones[c]
    if total != m:
        return lengths, ones, params, tail_k, at, ERR_COUNTS
    return lengths, ones, params, tail_k, at, ERR_OK


@njit(cache=True, nogil=True, inline="always")
def _seq_code(length: int, ones: int, param: int) -> tuple[bool, int, int]:
    """(invert, coded symbols, Rice k) of a sequence from its header fields."""
    if param < 0:
        return ones == length and length > 0, 0, 0
    invert = (param & 0x80) != 0
    return invert, (length - ones) if invert else ones, param & 0x3F


@njit(cache=True, nogil=True)
def parse_streams(
    buf: np.ndarray, at: int, end: int, m: int, k: int, lengths: np.ndarray, ones: np.ndarray, params: np.ndarray,
    tail_k: np.ndarray, levels: int,
) -> tuple[np.ndarray, int, int]:
    """The payload's tail: the unary and remainder streams and the m sign bits, checked against the symbol
    counts and widths the header implies. Returns ([unary at, unary bytes, remainder at, remainder bytes,
    signs at, symbols, remainder bits], next offset, error)."""
    spans = np.zeros(7, dtype=np.int64)
    for b in range(2):
        length, at, err = _varint(buf, at, end, end - at)
        if err:
            return spans, at, err
        if at + length > end:
            return spans, at, ERR_TRUNCATED
        spans[2 * b] = at
        spans[2 * b + 1] = length
        at += length
    if at + ((m + 7) >> 3) > end:
        return spans, at, ERR_TRUNCATED
    spans[4] = at
    at += (m + 7) >> 3
    if m & 7 and (buf[at - 1] >> (m & 7)) != 0:
        return spans, at, ERR_PADDING
    nv = tail_k.shape[0]
    symbols = 0
    rbits = 0
    for s in range(lengths.shape[0]):
        _, cnt, kk = _seq_code(lengths[s], ones[s], params[s])
        symbols += cnt
        rbits += cnt * kk
    for c in range(nv):
        symbols += ones[k + (levels - 1) * nv + c]
        rbits += ones[k + (levels - 1) * nv + c] * tail_k[c]
    spans[5] = symbols
    spans[6] = rbits
    if symbols == 0:
        if spans[1] or spans[3]:
            return spans, at, ERR_UNARY
    elif spans[3] != (rbits + 7) >> 3:
        return spans, at, ERR_FIELDS
    elif rbits & 7 and (buf[spans[2] + spans[3] - 1] >> (rbits & 7)) != 0:
        return spans, at, ERR_PADDING
    return spans, at, ERR_OK


@njit(cache=True, nogil=True)
def decode_symbols(
    buf: np.ndarray, spans: np.ndarray, counts: np.ndarray, lengths: np.ndarray, ones: np.ndarray,
    params: np.ndarray, tail_k: np.ndarray, levels: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Every Rice symbol, straight into what the select and value passes read: the position classes'
    rank bitmaps (class c's bits from ``start[c]``, word aligned), the level sequences' ones (sequence s's
    from ``lvl_start[s]``) and the tail values. Returns (start, bitmaps, lvl, lvl_start, tails, error)."""
    k = counts.shape[0]
    nv = tail_k.shape[0]
    nseq = lengths.shape[0]
    uw = _words(buf, spans[0], spans[1])
    rw = _words(buf, spans[2], spans[3])
    wi = 0
    cur = uw[0]
    prev = -1
    off = 0
    start = np.zeros(k + 1, dtype=np.int64)
    for c in range(k):
        start[c + 1] = start[c] + 64 * ((counts[c] + 63) // 64 + 1)
    bm = np.zeros(start[k] // 64 + 1, dtype=np.uint64)
    nlv = levels * nv
    lvl_start = np.zeros(nlv + 1, dtype=np.int64)
    total = 0
    for s in range(k, nseq):
        total += ones[s]
    lvl = np.empty(total, dtype=np.int64)
    ntail = 0
    for c in range(nv):
        ntail += ones[k + (levels - 1) * nv + c]
    tails = np.empty(ntail, dtype=np.int64)
    ti = 0
    o = 0
    err = ERR_OK
    for s in range(nseq + nv):
        if s < nseq:
            length = lengths[s]
            invert, cnt, kk = _seq_code(length, ones[s], params[s])
        else:  # the tails of value class s - nseq, after every sequence
            length, invert, cnt, kk = 0, False, ones[k + (levels - 1) * nv + s - nseq], tail_k[s - nseq]
        if cnt and kk > 62:
            return start, bm, lvl, lvl_start, tails, ERR_RANGE
        if k <= s < nseq:
            lvl_start[s - k] = o
        p = -1
        if s < k:  # position class: ranks into its bitmap (the ones, or the coded zeros of a dense class)
            base = start[s]
            if invert:
                for i in range(base >> 6, (base + length) >> 6):
                    bm[i] = ~np.uint64(0)
                if length & 63:
                    bm[(base + length) >> 6] = _LOW_MASKS[length & 63]
            for _ in range(cnt):
                g, wi, cur, prev, off, err = _symbol(uw, rw, wi, cur, prev, off, kk)
                p += g + 1
                if err or p >= length:
                    return start, bm, lvl, lvl_start, tails, err or ERR_OVERRUN
                bit = base + p
                bm[bit >> 6] ^= np.uint64(1) << np.uint64(bit & 63)
        elif s >= nseq:
            for _ in range(cnt):
                g, wi, cur, prev, off, err = _symbol(uw, rw, wi, cur, prev, off, kk)
                if err:
                    return start, bm, lvl, lvl_start, tails, err
                tails[ti] = g
                ti += 1
        elif invert:  # level sequence denser than 1/2: its ones are the ranks between coded zeros
            nxt = 0
            for _ in range(cnt):
                g, wi, cur, prev, off, err = _symbol(uw, rw, wi, cur, prev, off, kk)
                p += g + 1
                if err or p >= length:
                    return start, bm, lvl, lvl_start, tails, err or ERR_OVERRUN
                for x in range(nxt, p):
                    lvl[o] = x
                    o += 1
                nxt = p + 1
            for x in range(nxt, length):
                lvl[o] = x
                o += 1
        else:
            for _ in range(cnt):
                g, wi, cur, prev, off, err = _symbol(uw, rw, wi, cur, prev, off, kk)
                p += g + 1
                if err or p >= length:
                    return start, bm, lvl, lvl_start, tails, err or ERR_OVERRUN
                lvl[o] = p
                o += 1
    lvl_start[nlv] = o
    if spans[5]:
        bit, wi, cur = _next_one(uw, wi, cur)
        if bit >= 0 or (prev >> 3) != spans[1] - 1:
            return start, bm, lvl, lvl_start, tails, ERR_UNARY
    return start, bm, lvl, lvl_start, tails, ERR_OK


@njit(cache=True, nogil=True, inline="always")
def _lut(thr: np.ndarray) -> np.ndarray:
    """Exponent → class for every byte value: how many thresholds it reaches."""
    lut = np.zeros(256, dtype=np.int64)
    for e in range(256):
        for j in range(thr.shape[0]):
            lut[e] += e >= thr[j]
    return lut


@njit(cache=True, nogil=True)
def decode_sparse(
    key: np.ndarray, buf: np.ndarray, at: int, end: int, magmask: int, mant: int, sign_bit: int, exp_count: int,
    levels: int,
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Decode one SPARSE payload against the old bit patterns ``key``: (positions ascending, new bit
    patterns, offset after the payload, error)."""
    n = key.shape[0]
    no_pos = np.zeros(0, dtype=np.int64)
    no_bits = np.zeros(0, dtype=key.dtype)
    thr, vthr, n_v, at, err = parse_head(buf, at, end, n, exp_count)
    if err:
        return no_pos, no_bits, at, err
    k = thr.shape[0] + 1
    bounds = np.empty(k - 1, dtype=key.dtype)
    for j in range(k - 1):
        bounds[j] = thr[j] << mant
    typed = np.empty(1, dtype=key.dtype)
    typed[0] = magmask
    counts, gw = class_masks(key, typed[0], bounds)
    lengths, ones, params, tail_k, at, err = parse_sequences(buf, at, end, counts, n_v, levels)
    if err:
        return no_pos, no_bits, at, err
    m = 0
    for c in range(n_v.shape[0]):
        m += n_v[c]
    spans, at, err = parse_streams(buf, at, end, m, k, lengths, ones, params, tail_k, levels)
    if err:
        return no_pos, no_bits, at, err
    start, bm, lvl, lvl_start, tails, err = decode_symbols(buf, spans, counts, lengths, ones, params, tail_k, levels)
    if err:
        return no_pos, no_bits, at, err
    offsets = np.zeros(k + 1, dtype=np.int64)
    for c in range(k):
        offsets[c + 1] = offsets[c] + ones[c]
    pos, cm, old_cm, err = select(key, typed[0], mant, bounds, _lut(thr), counts, gw, start, bm, offsets)
    if err:
        return no_pos, no_bits, at, err
    bits, err = values(old_cm, cm, _lut(vthr), n_v, lvl, lvl_start, tails, buf, spans[4], levels, mant, sign_bit,
                        magmask)
    if err:
        return no_pos, no_bits, at, err
    return pos, bits, at, ERR_OK


@njit(cache=True, nogil=True)
def select(
    key: np.ndarray,
    magmask: np.integer,
    shift: int,
    bounds: np.ndarray,
    lut: np.ndarray,
    counts: np.ndarray,
    gw: np.ndarray,
    start: np.ndarray,
    bm: np.ndarray,
    offsets: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The changed elements from the position classes' rank bitmaps, in one pass over words: each class's
    next bits are deposited onto its member mask (``pdep``; ``gw``: the masks of :func:`class_masks`) and the
    union's set bits are the positions. Returns (positions ascending, class-major index of each, old bit
    patterns in class-major order, error)."""
    n = key.shape[0]
    ncls = bounds.shape[0] + 1
    m = offsets[ncls]
    pos = np.empty(m, dtype=np.int64)
    cm = np.empty(m, dtype=np.int64)
    old_cm = np.empty(m, dtype=key.dtype)
    at = start[:ncls].copy()
    hits = np.zeros(_BLOCK, dtype=np.uint64)
    nw = n // 64
    j = 0  # every class's bitmap holds exactly its ones (decode_symbols), so j never passes m
    for w0 in range(0, nw, _BLOCK):
        w1 = min(w0 + _BLOCK, nw)
        for c in range(ncls):  # one class at a time: its bitmap cursor is the only dependency
            a = at[c]
            for w in range(w0, w1):
                members = gw[c, w] & ~gw[c + 1, w]
                cnt = popcount(members)
                hits[w - w0] = (hits[w - w0] if c else np.uint64(0)) | pdep(_take_bits(bm, a, cnt), members)
                a += cnt
            at[c] = a
        for col in range(w1 - w0):
            b = 64 * (w0 + col)
            x = hits[col]
            while x:
                pos[j] = b + tzcnt(x)
                x &= x - np.uint64(1)
                j += 1
    for i in range(nw * 64, n):
        c = _class_of(np.int64(key[i] & magmask), bounds)
        if (bm[at[c] >> 6] >> np.uint64(at[c] & 63)) & np.uint64(1):
            pos[j] = i
            j += 1
        at[c] += 1
    ptr = offsets[:ncls].copy()
    for j in range(m):  # class-major index and old bits of each, in a loop of its own
        v = key[pos[j]]
        c = lut[(v & magmask) >> shift]
        q = ptr[c]
        ptr[c] = q + 1
        cm[j] = q
        old_cm[q] = v
    for c in range(ncls):
        if at[c] != start[c] + counts[c] or ptr[c] != offsets[c + 1]:
            return pos, cm, old_cm, ERR_POPULATION
    return pos, cm, old_cm, ERR_OK


@njit(cache=True, nogil=True)
def values(
    old_cm: np.ndarray,
    cm: np.ndarray,
    vlut: np.ndarray,
    n_v: np.ndarray,
    lvl: np.ndarray,
    lvl_start: np.ndarray,
    tails: np.ndarray,
    buf: np.ndarray,
    neg_at: int,
    levels: int,
    mant: int,
    sign_bit: int,
    mag_mask: int,
) -> tuple[np.ndarray, int]:
    """New bit patterns in position order (element j is class-major element ``cm[j]``) from the old ones,
    the level lists (ranks among the previous level's ones of the value class), tails and sign bits."""
    m = old_cm.shape[0]
    nv = n_v.shape[0]
    out = np.empty(m, dtype=old_cm.dtype)
    start = np.zeros(nv + 1, dtype=np.int64)
    vidx = np.empty(m, dtype=np.int64)
    for i in range(m):
        start[vlut[(np.int64(old_cm[i]) & mag_mask) >> mant] + 1] += 1
    for c in range(nv):
        if start[c + 1] != n_v[c]:
            return out, ERR_POPULATION
        start[c + 1] += start[c]
    fill = start[:-1].copy()
    for i in range(m):
        c = vlut[(np.int64(old_cm[i]) & mag_mask) >> mant]
        vidx[i] = fill[c]
        fill[c] += 1
    vmag = np.ones(m, dtype=np.int64)
    members = np.empty(m, dtype=np.int64)
    ones = np.empty(m, dtype=np.int64)
    moff = start.copy()
    ooff = np.zeros(nv + 1, dtype=np.int64)
    for lv in range(levels):
        o = 0
        for c in range(nv):
            ooff[c] = o
            s = lv * nv + c
            size = moff[c + 1] - moff[c]
            for i in range(lvl_start[s], lvl_start[s + 1]):
                r = lvl[i]
                if r >= size:
                    return out, ERR_OVERRUN
                p = moff[c] + r if lv == 0 else members[moff[c] + r]
                vmag[p] += 1
                ones[o] = p
                o += 1
        ooff[nv] = o
        members, ones = ones, members
        moff[:] = ooff
    if moff[nv] != tails.shape[0]:
        return out, ERR_OVERRUN
    for t in range(tails.shape[0]):
        vmag[members[t]] += tails[t]
    lo = -mag_mask - 1
    for j in range(m):
        i = cm[j]
        mag = vmag[vidx[i]]
        d = -mag if (buf[neg_at + (i >> 3)] >> (i & 7)) & 1 else mag
        o = _ord(np.int64(old_cm[i]), sign_bit, mag_mask) + d
        if o > mag_mask or o < lo:
            return out, ERR_VALUE
        out[j] = ((-o - 1) | (1 << sign_bit)) if o < 0 else o
    return out, ERR_OK
