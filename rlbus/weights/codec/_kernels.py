"""Compiled (numba) kernels behind the weight codec's hot paths; the byte format lives in ``format``.

The exponent-conditioned position coding needs, per record of n elements, the position class of every
old element (an interval of its biased exponent), and per changed element its rank among the members
of its class (encode) or the position of the member with a given rank (decode). In numpy that took
K-1 compare-and-pack passes plus rank/select over packed bitmaps and ~40 array operations per changed
element. Here each is one scalar pass with the class counters packed into a single uint64 register,
eight 8-bit lanes (SWAR, "SIMD within a register"): ``acc += tab[exponent]`` with ``tab[e] = 1 << 8·class``
has a one-cycle dependency chain instead of a store-to-load round trip through a counter array, and the
lanes are flushed into wide per-class bases every ``_BLOCK`` = 255 elements, before any lane can carry.

Every kernel is ``nogil`` (workers decode in threads next to generation) and ``cache=True`` (the first
process compiles, later ones load machine code from ``__pycache__``). Kernels that read untrusted bytes
bounds-check everything themselves and return an error code (``ERR_*``, non-zero) instead of raising;
the Python side turns it into :class:`~rlbus.errors.ChunkCorrupt`. Bit order is LSB-first throughout.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_BLOCK = 255  # elements per SWAR block: a lane counts at most 255, so nothing carries into the next lane
_LANE = np.uint64(0xFF)

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

_LOW_BIT = np.array([8] + [(v & -v).bit_length() - 1 for v in range(1, 256)], dtype=np.int64)

# ------------------------------------------------------------------------------------ O(n) passes


@njit(cache=True, nogil=True)
def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted positions where the bit patterns differ (a vectorised count, then a sparse fill)."""
    n = old.shape[0]
    m = 0
    for i in range(n):
        m += old[i] != new[i]
    out = np.empty(m, dtype=np.int64)
    j = 0
    for i in range(n):
        if old[i] != new[i]:
            out[j] = i
            j += 1
    return out


@njit(cache=True, nogil=True)
def sampled_histogram(key: np.ndarray, shift: np.uint64, mask: np.uint64, nbins: int, stride: int) -> np.ndarray:
    """Histogram of ``(key[::stride] >> shift) & mask``, scaled by ``stride``."""
    hist = np.zeros(nbins, dtype=np.int64)
    for i in range(0, key.shape[0], stride):
        hist[(key[i] >> shift) & mask] += 1
    return hist * stride


@njit(cache=True, nogil=True)
def class_counts(key: np.ndarray, shift: np.uint64, mask: np.uint64, tab: np.ndarray, nclass: int) -> np.ndarray:
    """Members per class; ``tab[e] = 1 << 8·class(e)`` for every masked exponent e.

    ``shift`` and ``mask`` are uint64 so exponents index tables without negative-index handling."""
    n = key.shape[0]
    counts = np.zeros(nclass, dtype=np.int64)
    for b0 in range(0, n, _BLOCK):
        acc = np.uint64(0)
        for i in range(b0, min(n, b0 + _BLOCK)):
            acc += tab[(key[i] >> shift) & mask]
        for c in range(nclass):
            counts[c] += np.int64((acc >> np.uint64(8 * c)) & _LANE)
    return counts


@njit(cache=True, nogil=True)
def class_ranks(
    key: np.ndarray, shift: np.uint64, mask: np.uint64, tab: np.ndarray, lut: np.ndarray, nclass: int, pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(members per class, class of each ``pos``, its rank within the class); ``pos`` sorted ascending."""
    n = key.shape[0]
    m = pos.shape[0]
    base = np.zeros(nclass, dtype=np.int64)
    cls = np.empty(m, dtype=np.int64)
    ranks = np.empty(m, dtype=np.int64)
    j = 0
    for b0 in range(0, n, _BLOCK):
        b1 = min(n, b0 + _BLOCK)
        acc = np.uint64(0)
        i = b0
        while j < m and pos[j] < b1:  # count up to the next changed element, then rank it
            p = pos[j]
            for t in range(i, p):
                acc += tab[(key[t] >> shift) & mask]
            e = (key[p] >> shift) & mask
            c = lut[e]
            cls[j] = c
            ranks[j] = base[c] + np.int64((acc >> np.uint64(8 * c)) & _LANE)
            acc += tab[e]
            i = p + 1
            j += 1
        for t in range(i, b1):
            acc += tab[(key[t] >> shift) & mask]
        for c in range(nclass):
            base[c] += np.int64((acc >> np.uint64(8 * c)) & _LANE)
    return base, cls, ranks


@njit(cache=True, nogil=True)
def class_select(
    key: np.ndarray,
    shift: np.uint64,
    mask: np.uint64,
    tab: np.ndarray,
    lut: np.ndarray,
    ranks: np.ndarray,
    offsets: np.ndarray,
) -> tuple[np.ndarray, int]:
    """Positions of the members with the given ranks, laid out like ``ranks``: class c's strictly
    increasing ranks in ``ranks[offsets[c]:offsets[c+1]]``. Returns (positions, error code)."""
    n = key.shape[0]
    nclass = offsets.shape[0] - 1
    lanes = tab * _LANE  # lane mask of each exponent's class
    out = np.empty(ranks.shape[0], dtype=np.int64)
    base = np.zeros(nclass, dtype=np.int64)
    ptr = offsets[:-1].copy()
    left = ranks.shape[0]
    for b0 in range(0, n, _BLOCK):
        if left == 0:
            break
        b1 = min(n, b0 + _BLOCK)
        tgt = np.uint64(0)  # lane c: in-block rank of class c's next target, 255 (unreachable) when none
        for c in range(nclass):
            rel = ranks[ptr[c]] - base[c] if ptr[c] < offsets[c + 1] else 255
            tgt |= np.uint64(min(rel, 255)) << np.uint64(8 * c)
        for c in range(nclass, 8):
            tgt |= _LANE << np.uint64(8 * c)
        acc = np.uint64(0)
        for i in range(b0, b1):
            e = (key[i] >> shift) & mask
            if ((acc ^ tgt) & lanes[e]) == 0:
                c = lut[e]
                out[ptr[c]] = i
                ptr[c] += 1
                left -= 1
                rel = ranks[ptr[c]] - base[c] if ptr[c] < offsets[c + 1] else 255
                lane = np.uint64(8 * c)
                tgt = (tgt & ~(_LANE << lane)) | (np.uint64(min(rel, 255)) << lane)
            acc += tab[e]
        for c in range(nclass):
            base[c] += np.int64((acc >> np.uint64(8 * c)) & _LANE)
    return out, ERR_OVERRUN if left else ERR_OK


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
    """New bit patterns of the changed elements (class-major order) from the decoded level sequences
    (seq ids relative to the first level sequence), Rice tail values and packed sign bits."""
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
    vmag = np.ones(m, dtype=np.int64)
    i = 0
    while i < lseq.shape[0]:  # one level sequence of one value class at a time, levels in order
        s = lseq[i]
        lv = s // nv + 1
        c = s % nv
        member = 0
        p = start[c]
        while i < lseq.shape[0] and lseq[i] == s:
            while p < start[c + 1] and (vmag[p] < lv or member < llocal[i]):
                member += vmag[p] >= lv
                p += 1
            if p == start[c + 1]:
                return out, ERR_OVERRUN
            vmag[p] += 1
            member += 1
            p += 1
            i += 1
    t = 0
    for p in range(m):
        if vmag[p] > levels:
            if t == tail.shape[0]:
                return out, ERR_OVERRUN
            vmag[p] += tail[t]
            t += 1
    if t != tail.shape[0]:
        return out, ERR_OVERRUN
    lo = -mag_mask - 1
    for i in range(m):
        mag = vmag[vidx[i]]
        d = -mag if (neg[i >> 3] >> (i & 7)) & 1 else mag
        o = _ord(np.int64(old_c[i]), sign_bit, mag_mask) + d
        if o > mag_mask or o < lo:
            return out, ERR_VALUE
        out[i] = ((-o - 1) | (1 << sign_bit)) if o < 0 else o
    return out, ERR_OK
