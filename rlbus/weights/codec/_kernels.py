"""Compiled (numba) kernels behind the weight codec's hot paths; the byte format lives in ``format``.

The exponent-conditioned position coding needs, per record of n elements, the position class of every
old element (an interval of its biased exponent), and per changed element its rank among the members
of its class (encode) or the position of the member with a given rank (decode). These O(n) passes run
a word of 64 elements at a time (:mod:`._simd`): one vector compare per class boundary gives the
boundary's mask, a class's members are the difference of two masks, and ranks and selects are popcounts
and bit deposits on words, so the per-element work is a few vector instructions with no branch; the
work per changed element (ranks, values, Rice codes) is scalar and O(m).

Every kernel is ``nogil`` (workers decode in threads next to generation) and ``cache=True`` (the first
process compiles, later ones load machine code from ``__pycache__``). Kernels that read untrusted bytes
bounds-check everything themselves and return an error code (``ERR_*``, non-zero) instead of raising;
the Python side turns it into :class:`~rlbus.errors.ChunkCorrupt`. Bit order is LSB-first throughout.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from rlbus.weights.codec._simd import ge_mask64, ne_mask64, pdep, popcount, tzcnt

ERR_OK = 0
ERR_UNARY = 1
ERR_RANGE = 2
ERR_FIELDS = 3
ERR_PADDING = 4
ERR_OVERRUN = 5
ERR_POPULATION = 6
ERR_VALUE = 7

ERRORS = {
    ERR_UNARY: "unary stream does not match the symbol count",
    ERR_RANGE: "Rice value out of range",
    ERR_FIELDS: "field stream has the wrong length",
    ERR_PADDING: "non-zero padding bits",
    ERR_OVERRUN: "run lengths overrun their sequence",
    ERR_POPULATION: "value class populations disagree with the header",
    ERR_VALUE: "decoded value out of range",
}

_LOW_MASKS = np.array([(1 << k) - 1 for k in range(64)] + [(1 << 64) - 1], dtype=np.uint64)
_LOW_BIT = np.array([8] + [(v & -v).bit_length() - 1 for v in range(1, 256)], dtype=np.int64)

# ------------------------------------------------------------------------------------ O(n) passes
#
# An element's class is the number of thresholds its magnitude bits reach: with ``mag = key & magmask``
# and ascending thresholds T_1 < … < T_{K-1} (exponent thresholds shifted into place), class c holds
# T_c ≤ mag < T_{c+1}. Per word of 64 elements G_j = mask(mag ≥ T_j) and the members of class c are
# G_c & ~G_{c+1} (G_0 = all, G_K = none), so counting, ranking and selecting members are popcounts and
# bit deposits on those words; only the last n % 64 elements take a scalar path.


@njit(cache=True, nogil=True)
def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted positions where the bit patterns differ: one compare mask per word, then its set bits."""
    n = old.shape[0]
    nw = n // 64
    words = np.empty(nw + 1, dtype=np.uint64)
    m = 0
    for w in range(nw):
        x = ne_mask64(old, new, w * 64)
        words[w] = x
        m += popcount(x)
    x = np.uint64(0)
    for i in range(nw * 64, n):
        if old[i] != new[i]:
            x |= np.uint64(1) << np.uint64(i - nw * 64)
    words[nw] = x
    m += popcount(x)
    out = np.empty(m, dtype=np.int64)
    j = 0
    for w in range(nw + 1):
        x = words[w]
        while x:
            out[j] = 64 * w + tzcnt(x)
            j += 1
            x &= x - np.uint64(1)
    return out


@njit(cache=True, nogil=True)
def sampled_histogram(key: np.ndarray, magmask: int, shift: int, nbins: int, stride: int) -> np.ndarray:
    """Histogram of the exponents ``(key & magmask) >> shift`` of ``key[::stride]``, scaled by ``stride``."""
    hist = np.zeros(nbins, dtype=np.int64)
    for i in range(0, key.shape[0], stride):
        hist[(np.int64(key[i]) & magmask) >> shift] += 1
    return hist * stride


@njit(cache=True, nogil=True, inline="always")
def _class_of(v: np.int64, thr: np.ndarray) -> int:
    c = 0
    for j in range(thr.shape[0]):
        c += v >= thr[j]
    return c


@njit(cache=True, nogil=True, inline="always")
def _ge_words(key: np.ndarray, start: int, magmask: np.integer, thr: np.ndarray, ge: np.ndarray) -> None:
    """ge[j + 1] = mask(key & magmask ≥ thr[j]) for the word at ``start``; ge[0] and ge[K] stay as set."""
    for j in range(thr.shape[0]):
        ge[j + 1] = ge_mask64(key, start, magmask, thr[j])


@njit(cache=True, nogil=True)
def class_counts(key: np.ndarray, magmask: np.integer, thr: np.ndarray) -> np.ndarray:
    """Members per class (``thr``: the K-1 ascending thresholds, of ``key``'s dtype)."""
    n = key.shape[0]
    nthr = thr.shape[0]
    above = np.zeros(nthr + 2, dtype=np.int64)  # above[j + 1]: elements ≥ thr[j]
    ge = np.zeros(nthr + 2, dtype=np.uint64)
    nw = n // 64
    for w in range(nw):
        _ge_words(key, 64 * w, magmask, thr, ge)
        for j in range(1, nthr + 1):
            above[j] += popcount(ge[j])
    for i in range(nw * 64, n):
        c = _class_of(np.int64(key[i] & magmask), thr)
        for j in range(1, c + 1):
            above[j] += 1
    above[0] = n
    return above[: nthr + 1] - above[1:]


@njit(cache=True, nogil=True)
def class_ranks(
    key: np.ndarray, magmask: np.integer, shift: np.integer, thr: np.ndarray, lut: np.ndarray, pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(members per class, class of each ``pos``, its rank within the class); ``pos`` sorted ascending."""
    n = key.shape[0]
    nthr = thr.shape[0]
    m = pos.shape[0]
    above = np.zeros(nthr + 2, dtype=np.int64)  # members ≥ thr[j - 1] before the current word
    ge = np.zeros(nthr + 2, dtype=np.uint64)
    ge[0] = ~np.uint64(0)
    cls = np.empty(m, dtype=np.int64)
    ranks = np.empty(m, dtype=np.int64)
    nw = n // 64
    j = 0
    for w in range(nw):
        b = 64 * w
        _ge_words(key, b, magmask, thr, ge)
        while j < m and pos[j] < b + 64:
            p = pos[j]
            c = lut[(key[p] & magmask) >> shift]
            below = (np.uint64(1) << np.uint64(p - b)) - np.uint64(1)
            cls[j] = c
            # members of c before the word, then in it below p
            ranks[j] = (b - above[1] if c == 0 else above[c] - above[c + 1]) + popcount(ge[c] & ~ge[c + 1] & below)
            j += 1
        for t in range(1, nthr + 1):
            above[t] += popcount(ge[t])
    counts = np.zeros(nthr + 1, dtype=np.int64)
    for c in range(nthr + 1):
        counts[c] = (nw * 64 - above[1]) if c == 0 else above[c] - above[c + 1]
    for i in range(nw * 64, n):
        c = _class_of(np.int64(key[i] & magmask), thr)
        if j < m and pos[j] == i:
            cls[j] = c
            ranks[j] = counts[c]
            j += 1
        counts[c] += 1
    return counts, cls, ranks


@njit(cache=True, nogil=True, inline="always")
def _take_bits(bm: np.ndarray, at: int, count: int) -> np.uint64:
    """``count`` (0..64) bits of the bitmap ``bm`` starting at bit ``at``; bm has a word past the end."""
    w = at >> 6
    s = np.uint64(at & 63)
    x = (bm[w] >> s) | ((bm[w + 1] << np.uint64(1)) << (np.uint64(63) - s))
    return x & _LOW_MASKS[count]


@njit(cache=True, nogil=True)
def class_select(
    key: np.ndarray,
    magmask: np.integer,
    shift: np.integer,
    thr: np.ndarray,
    lut: np.ndarray,
    counts: np.ndarray,
    ranks: np.ndarray,
    offsets: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The class members with the given ranks (class c's strictly increasing ranks in
    ``ranks[offsets[c]:offsets[c+1]]``, ``counts[c]`` members), found in one pass over words.

    Each class's ranks become a bitmap over its members; per word, every class's next bits are deposited
    onto its member mask (``pdep``), and the union's set bits are the positions, in position order.
    Returns (positions ascending, index of each in the class-major order of ``ranks``, the old bit
    patterns in class-major order, error code)."""
    n = key.shape[0]
    nthr = thr.shape[0]
    ncls = nthr + 1
    m = ranks.shape[0]
    pos = np.empty(m, dtype=np.int64)
    cm = np.empty(m, dtype=np.int64)
    old_cm = np.empty(m, dtype=key.dtype)
    start = np.zeros(ncls + 1, dtype=np.int64)  # first bit of class c's bitmap (word aligned)
    for c in range(ncls):
        start[c + 1] = start[c] + 64 * ((counts[c] + 63) // 64 + 1)
    bm = np.zeros(start[ncls] // 64 + 1, dtype=np.uint64)
    for c in range(ncls):
        last = -1
        for i in range(offsets[c], offsets[c + 1]):
            r = ranks[i]
            if r <= last or r >= counts[c]:
                return pos, cm, old_cm, ERR_OVERRUN
            last = r
            bit = start[c] + r
            bm[bit >> 6] |= np.uint64(1) << np.uint64(bit & 63)
    at = start[:ncls].copy()  # next unread bit of each class's bitmap
    ptr = offsets[:ncls].copy()  # next class-major slot of each class
    ge = np.zeros(ncls + 1, dtype=np.uint64)
    ge[0] = ~np.uint64(0)
    nw = n // 64
    j = 0
    for w in range(nw):
        b = 64 * w
        _ge_words(key, b, magmask, thr, ge)
        x = np.uint64(0)
        for c in range(ncls):
            members = ge[c] & ~ge[c + 1]
            cnt = popcount(members)
            x |= pdep(_take_bits(bm, at[c], cnt), members)
            at[c] += cnt
        while x:
            p = b + tzcnt(x)
            x &= x - np.uint64(1)
            v = key[p]
            c = lut[(v & magmask) >> shift]
            q = ptr[c]
            pos[j] = p
            cm[j] = q
            old_cm[q] = v
            ptr[c] = q + 1
            j += 1
    for i in range(nw * 64, n):
        v = key[i]
        c = _class_of(np.int64(v & magmask), thr)
        if (bm[at[c] >> 6] >> np.uint64(at[c] & 63)) & np.uint64(1):
            pos[j] = i
            cm[j] = ptr[c]
            old_cm[ptr[c]] = v
            ptr[c] += 1
            j += 1
        at[c] += 1
    for c in range(ncls):
        if at[c] != start[c] + counts[c] or ptr[c] != offsets[c + 1]:
            return pos, cm, old_cm, ERR_POPULATION
    return pos, cm, old_cm, ERR_OK


# ------------------------------------------------------------------------------ bit streams


@njit(cache=True, nogil=True)
def pack_fields(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """``values[i]`` as ``widths[i]`` bits each (≤ 63, value < 2**width), LSB-first, as bytes."""
    total = 0
    for i in range(widths.shape[0]):
        total += widths[i]
    words = np.zeros((total >> 6) + 2, dtype=np.uint64)
    off = 0
    for i in range(values.shape[0]):
        v = np.uint64(values[i])
        w = off >> 6
        s = off & 63
        words[w] |= v << np.uint64(s)
        if s + widths[i] > 64:
            words[w + 1] |= v >> np.uint64(64 - s)
        off += widths[i]
    return words.view(np.uint8)[: (total + 7) >> 3].copy()


@njit(cache=True, nogil=True)
def unpack_fields(data: np.ndarray, widths: np.ndarray) -> tuple[np.ndarray, int]:
    """Inverse of :func:`pack_fields` (uint64 values); checks the stream length and padding."""
    total = 0
    for i in range(widths.shape[0]):
        total += widths[i]
    out = np.zeros(widths.shape[0], dtype=np.uint64)
    if data.shape[0] != (total + 7) >> 3:
        return out, ERR_FIELDS
    if total & 7 and (data[-1] >> (total & 7)) != 0:
        return out, ERR_PADDING
    padded = np.zeros(((total >> 6) + 2) * 8, dtype=np.uint8)
    padded[: data.shape[0]] = data
    words = padded.view(np.uint64)
    off = 0
    for i in range(widths.shape[0]):
        k = widths[i]
        w = off >> 6
        s = off & 63
        v = words[w] >> np.uint64(s)
        if s and s + k > 64:
            v |= words[w + 1] << np.uint64(64 - s)
        out[i] = v & ((np.uint64(1) << np.uint64(k)) - np.uint64(1))
        off += k
    return out, ERR_OK


@njit(cache=True, nogil=True)
def unary_encode(values: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """The unary stream of Rice codes: ``values[i] >> ks[i]`` zero bits then a one, LSB-first."""
    total = 0
    for i in range(values.shape[0]):
        total += (values[i] >> ks[i]) + 1
    out = np.zeros((total + 7) >> 3, dtype=np.uint8)
    bit = -1
    for i in range(values.shape[0]):
        bit += (values[i] >> ks[i]) + 1
        out[bit >> 3] |= np.uint8(1 << (bit & 7))
    return out


@njit(cache=True, nogil=True)
def unary_decode(data: np.ndarray, ks: np.ndarray) -> tuple[np.ndarray, int]:
    """Quotients from a unary stream of exactly ``len(ks)`` symbols, each < 2**(62 - k)."""
    count = ks.shape[0]
    q = np.empty(count, dtype=np.int64)
    j = 0
    run = 0
    last = -1
    for b in range(data.shape[0]):
        byte = np.int64(data[b])
        bitpos = 0
        while byte:
            low = _LOW_BIT[byte]
            run += low - bitpos
            if j == count:
                return q, ERR_UNARY
            if ks[j] > 62 or (run >> (62 - ks[j])) != 0:
                return q, ERR_RANGE
            q[j] = run
            j += 1
            run = 0
            byte &= byte - 1
            bitpos = low + 1
            last = b
        run += 8 - bitpos
    if j != count or (count and last != data.shape[0] - 1):
        return q, ERR_UNARY
    return q, ERR_OK


# ------------------------------------------------------------------------------ Rice parameters


@njit(cache=True, nogil=True)
def group_sums(values: np.ndarray, groups: np.ndarray, ngroups: int) -> tuple[np.ndarray, np.ndarray]:
    """(count, sum of values) per group."""
    cnt = np.zeros(ngroups, dtype=np.int64)
    tot = np.zeros(ngroups, dtype=np.int64)
    for i in range(values.shape[0]):
        cnt[groups[i]] += 1
        tot[groups[i]] += values[i]
    return cnt, tot


@njit(cache=True, nogil=True)
def rice_costs(values: np.ndarray, groups: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Coded bits per group for each candidate k: ``cand`` is (groups, 3) → costs (groups, 3)."""
    cost = np.zeros(cand.shape, dtype=np.int64)
    for i in range(values.shape[0]):
        g = groups[i]
        for t in range(cand.shape[1]):
            cost[g, t] += (values[i] >> cand[g, t]) + 1 + cand[g, t]
    return cost


# -------------------------------------------------------------------------- Bernoulli sequences


@njit(cache=True, nogil=True)
def seq_gaps(
    lengths: np.ndarray, seq: np.ndarray, local: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Coded gaps of a batch of sequences given their ones as sorted (seq, local) pairs.

    Sequences denser than 1/2 code their zeros. Returns (ones, invert, gaps, sequence of each gap).
    """
    nseq = lengths.shape[0]
    ones = np.zeros(nseq, dtype=np.int64)
    for i in range(seq.shape[0]):
        ones[seq[i]] += 1
    invert = 2 * ones > lengths
    total = 0
    for s in range(nseq):
        total += lengths[s] - ones[s] if invert[s] else ones[s]
    gaps = np.empty(total, dtype=np.int64)
    gseq = np.empty(total, dtype=np.int64)
    g = 0
    i = 0
    for s in range(nseq):
        end = i + ones[s]
        if invert[s]:
            prev = -1
            p = 0
            for t in range(i, end + 1):
                stop = local[t] if t < end else lengths[s]
                while p < stop:  # zeros between listed ones
                    gaps[g] = p - prev - 1
                    gseq[g] = s
                    g += 1
                    prev = p
                    p += 1
                p = stop + 1
        else:
            prev = -1
            for t in range(i, end):
                gaps[g] = local[t] - prev - 1
                gseq[g] = s
                g += 1
                prev = local[t]
        i = end
    return ones, invert, gaps, gseq


@njit(cache=True, nogil=True)
def seq_ones(
    lengths: np.ndarray, ones: np.ndarray, invert: np.ndarray, counts: np.ndarray, gaps: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """Inverse of :func:`seq_gaps`: (sequence, local) of every one, sorted; ``counts`` symbols each."""
    total = 0
    for s in range(lengths.shape[0]):
        total += ones[s]
    seq = np.empty(total, dtype=np.int64)
    local = np.empty(total, dtype=np.int64)
    o = 0
    g = 0
    for s in range(lengths.shape[0]):
        p = -1
        if invert[s]:
            nxt = 0  # every position below the next coded zero is a one
            for t in range(counts[s] + 1):
                if t < counts[s]:
                    p += gaps[g + t] + 1
                    if p >= lengths[s]:
                        return seq, local, ERR_OVERRUN
                    stop = p
                else:
                    stop = lengths[s]
                for q in range(nxt, stop):
                    seq[o] = s
                    local[o] = q
                    o += 1
                nxt = stop + 1
        else:
            for t in range(counts[s]):
                p += gaps[g + t] + 1
                if p >= lengths[s]:
                    return seq, local, ERR_OVERRUN
                seq[o] = s
                local[o] = p
                o += 1
        g += counts[s]
    return seq, local, ERR_OK if o == total else ERR_OVERRUN


# --------------------------------------------------------------------------- order-preserving ints


@njit(cache=True, nogil=True)
def _ord(b: np.int64, sign_bit: int, mag_mask: int) -> np.int64:
    return -(b & mag_mask) - 1 if (b >> sign_bit) & 1 else b


@njit(cache=True, nogil=True)
def sparse_encode_order(
    cls: np.ndarray, old_c: np.ndarray, new_c: np.ndarray, nclass: int, mant: int, sign_bit: int, mag_mask: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Class-major stable order of the changed elements, their exponents and d = ord(new) − ord(old)."""
    m = cls.shape[0]
    start = np.zeros(nclass + 1, dtype=np.int64)
    for i in range(m):
        start[cls[i] + 1] += 1
    for c in range(nclass):
        start[c + 1] += start[c]
    order = np.empty(m, dtype=np.int64)
    exp = np.empty(m, dtype=np.int64)
    d = np.empty(m, dtype=np.int64)
    for i in range(m):
        j = start[cls[i]]
        start[cls[i]] += 1
        order[j] = i
        o = np.int64(old_c[i])
        exp[j] = (o & mag_mask) >> mant
        d[j] = _ord(np.int64(new_c[i]), sign_bit, mag_mask) - _ord(o, sign_bit, mag_mask)
    return order, exp, d


@njit(cache=True, nogil=True)
def value_stats(exp: np.ndarray, mag: np.ndarray, nexp: int, levels: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per exponent: members and members with |d| > level for level 1..levels; the largest tail value."""
    cnt = np.zeros(nexp, dtype=np.int64)
    above = np.zeros((levels, nexp), dtype=np.int64)
    tmax = -1
    for i in range(exp.shape[0]):
        e = exp[i]
        cnt[e] += 1
        for lv in range(levels):
            if mag[i] > lv + 1:
                above[lv, e] += 1
        if mag[i] > levels:
            tmax = max(tmax, mag[i] - levels - 1)
    return cnt, above, tmax


@njit(cache=True, nogil=True)
def tail_sums(exp: np.ndarray, mag: np.ndarray, nexp: int, levels: int, kmax: int) -> np.ndarray:
    """Σ (|d| − levels − 1) >> k over tail elements, per k in 0..kmax and exponent."""
    out = np.zeros((kmax + 1, nexp), dtype=np.int64)
    for i in range(exp.shape[0]):
        if mag[i] > levels:
            tv = mag[i] - levels - 1
            for k in range(kmax + 1):
                out[k, exp[i]] += tv >> k
    return out


@njit(cache=True, nogil=True)
def level_sequences(
    vcls: np.ndarray, mag: np.ndarray, nvclass: int, nclass: int, levels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Value-class-major regrouping and the level sequences of |d|.

    Returns (lengths per level sequence, their ones as sorted (seq id, local) pairs with seq ids
    starting at ``nclass``, tail values, tail value classes, elements per value class).
    """
    m = vcls.shape[0]
    start = np.zeros(nvclass + 1, dtype=np.int64)
    for i in range(m):
        start[vcls[i] + 1] += 1
    n_v = start[1:].copy()
    for c in range(nvclass):
        start[c + 1] += start[c]
    vmag = np.empty(m, dtype=np.int64)
    fill = start[:-1].copy()
    for i in range(m):
        vmag[fill[vcls[i]]] = mag[i]
        fill[vcls[i]] += 1
    lengths = np.zeros(levels * nvclass, dtype=np.int64)
    nones = 0
    ntail = 0
    for i in range(m):
        nones += min(vmag[i], levels + 1) - 1
        ntail += vmag[i] > levels
    seq = np.empty(nones, dtype=np.int64)
    local = np.empty(nones, dtype=np.int64)
    tail = np.empty(ntail, dtype=np.int64)
    tcls = np.empty(ntail, dtype=np.int64)
    o = 0
    for lv in range(1, levels + 1):
        for c in range(nvclass):
            member = 0
            for i in range(start[c], start[c + 1]):
                if vmag[i] >= lv:
                    if vmag[i] > lv:
                        seq[o] = nclass + (lv - 1) * nvclass + c
                        local[o] = member
                        o += 1
                    member += 1
            lengths[(lv - 1) * nvclass + c] = member
    t = 0
    for i in range(m):
        if vmag[i] > levels:
            tail[t] = vmag[i] - levels - 1
            t += 1
    t = 0
    for c in range(nvclass):
        for i in range(start[c], start[c + 1]):
            if vmag[i] > levels:
                tcls[t] = c
                t += 1
    return lengths, seq, local, tail, tcls, n_v


@njit(cache=True, nogil=True)
def sparse_decode_values(
    old_c: np.ndarray,
    cm: np.ndarray,
    vlut: np.ndarray,
    n_v: np.ndarray,
    lseq: np.ndarray,
    llocal: np.ndarray,
    tail: np.ndarray,
    neg: np.ndarray,
    levels: int,
    mant: int,
    sign_bit: int,
    mag_mask: int,
) -> tuple[np.ndarray, int]:
    """New bit patterns of the changed elements from their old ones (``old_c``, class-major order), the
    decoded level sequences (seq ids relative to the first level sequence), Rice tail values and packed
    sign bits; written in position order: element j is class-major element ``cm[j]``."""
    m = old_c.shape[0]
    nv = n_v.shape[0]
    out = np.empty(m, dtype=old_c.dtype)
    if neg.shape[0] != (m + 7) >> 3:
        return out, ERR_FIELDS
    if m & 7 and (neg[-1] >> (m & 7)) != 0:
        return out, ERR_PADDING
    vcls = np.empty(m, dtype=np.int64)
    start = np.zeros(nv + 1, dtype=np.int64)
    for i in range(m):
        c = vlut[(np.int64(old_c[i]) & mag_mask) >> mant]
        vcls[i] = c
        start[c + 1] += 1
    for c in range(nv):
        if start[c + 1] != n_v[c]:
            return out, ERR_POPULATION
        start[c + 1] += start[c]
    vidx = np.empty(m, dtype=np.int64)
    fill = start[:-1].copy()
    for i in range(m):
        vidx[i] = fill[vcls[i]]
        fill[vcls[i]] += 1
    # Level l's ones are listed by their rank among the elements with |d| ≥ l of their value class; those
    # are level l-1's ones (level 1: the whole class), so each one is found by one lookup, not a scan.
    vmag = np.ones(m, dtype=np.int64)
    members = np.empty(m, dtype=np.int64)
    ones = np.empty(m, dtype=np.int64)
    moff = start.copy()
    ooff = np.zeros(nv + 1, dtype=np.int64)
    i = 0
    for lv in range(levels):
        o = 0
        for c in range(nv):
            ooff[c] = o
            s = lv * nv + c
            while i < lseq.shape[0] and lseq[i] == s:
                r = llocal[i]
                if r < 0 or r >= moff[c + 1] - moff[c]:
                    return out, ERR_OVERRUN
                p = moff[c] + r if lv == 0 else members[moff[c] + r]
                vmag[p] += 1
                ones[o] = p
                o += 1
                i += 1
        ooff[nv] = o
        members, ones = ones, members
        moff[:] = ooff
    if i != lseq.shape[0] or moff[nv] != tail.shape[0]:
        return out, ERR_OVERRUN
    for t in range(tail.shape[0]):  # the tail values follow the last level's ones in order
        vmag[members[t]] += tail[t]
    lo = -mag_mask - 1
    for j in range(m):
        i = cm[j]
        mag = vmag[vidx[i]]
        d = -mag if (neg[i >> 3] >> (i & 7)) & 1 else mag
        o = _ord(np.int64(old_c[i]), sign_bit, mag_mask) + d
        if o > mag_mask or o < lo:
            return out, ERR_VALUE
        out[j] = ((-o - 1) | (1 << sign_bit)) if o < 0 else o
    return out, ERR_OK
