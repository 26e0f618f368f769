"""Bit-level building blocks of the weight codec, all vectorised with numpy.

* ``Reader`` / ``put_varint``: bounds-checked parsing and LEB128 varints. Every read that would run
  past the end raises :class:`~rlbus.errors.ChunkCorrupt`, so a truncated blob never yields garbage.
* Rice codes (Golomb codes with a power-of-two divisor, Rice 1979) split into two streams: the unary
  quotients in one bitstream and the k-bit remainders in another. Splitting is what makes decoding
  vectorisable: the quotients are the gaps between the set bits of the unary stream (one
  ``flatnonzero``), and once every symbol's k is known the remainders sit at computable offsets.
* Bernoulli sequences coded as Rice-coded run lengths between their ones ("gap coding"). For a
  memoryless source with P(one) = p the gaps are geometric, for which Golomb codes are optimal prefix
  codes; with the best k the loss against the entropy n·H(p) is ~1 % on the weight deltas we measured.
  Sequences denser than 1/2 code their zeros instead.
* Packed class bitmaps with rank/select, used to map "the r-th element of context class c" to a
  position and back without materialising per-class index arrays (which would cost 8 bytes per weight).

Bit order is little-endian throughout: bit j of a stream is bit (j % 8) of byte j // 8.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from rlbus.errors import ChunkCorrupt

U64 = np.dtype("<u8")
_ONE = np.uint64(1)
_HAS_BITWISE_COUNT = hasattr(np, "bitwise_count")
_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def _select8_table() -> np.ndarray:
    table = np.full((256, 8), 255, dtype=np.uint8)
    for v in range(256):
        set_bits = [b for b in range(8) if v >> b & 1]
        table[v, : len(set_bits)] = set_bits
    return table


_SELECT8_FLAT = _select8_table().reshape(-1)


# --------------------------------------------------------------------------------------------- bytes


def put_varint(out: bytearray, value: int) -> None:
    """Append ``value`` (>= 0) as an unsigned LEB128 varint."""
    if value < 0:
        raise ValueError(f"varint must be >= 0, got {value}")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def put_bytes(out: bytearray, data: bytes | bytearray | memoryview) -> None:
    """Append a varint length followed by ``data``."""
    put_varint(out, len(data))
    out += data


class Reader:
    """Sequential, bounds-checked reader over a byte buffer."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int = 0, end: int | None = None) -> None:
        self.buf = memoryview(buf)
        self.pos = pos
        self.end = len(self.buf) if end is None else end

    def u8(self) -> int:
        if self.pos >= self.end:
            raise ChunkCorrupt("truncated: expected a byte")
        v = self.buf[self.pos]
        self.pos += 1
        return int(v)

    def varint(self, limit: int = 1 << 62) -> int:
        """Read a varint and check it is at most ``limit``."""
        shift = 0
        value = 0
        while True:
            b = self.u8()
            value |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
            if shift > 63:
                raise ChunkCorrupt("varint too long")
        if value > limit:
            raise ChunkCorrupt(f"value {value} exceeds limit {limit}")
        return value

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise ChunkCorrupt(f"truncated: need {n} bytes, {self.end - self.pos} left")
        v = self.buf[self.pos : self.pos + n]
        self.pos += n
        return v

    def blob(self) -> memoryview:
        """Read a varint length and that many bytes."""
        return self.take(self.varint(self.end - self.pos))

    def expect_end(self) -> None:
        if self.pos != self.end:
            raise ChunkCorrupt(f"{self.end - self.pos} unexpected trailing bytes")


# ------------------------------------------------------------------------------------- bit helpers


def popcount64(words: np.ndarray) -> np.ndarray:
    """Number of set bits of each uint64 (as int64)."""
    if _HAS_BITWISE_COUNT:
        return np.bitwise_count(words).astype(np.int64)
    return _POP8[words.view(np.uint8)].reshape(-1, 8).sum(axis=1, dtype=np.int64)


def pack_bools(bits: np.ndarray) -> bytes:
    return np.packbits(bits, bitorder="little").tobytes()


def unpack_bools(data: bytes | memoryview, count: int) -> np.ndarray:
    """The first ``count`` bits of ``data``; the rest of the last byte must be zero."""
    if len(data) != (count + 7) // 8:
        raise ChunkCorrupt(f"bitstream of {len(data)} bytes cannot hold exactly {count} bits")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bits[count:].any():
        raise ChunkCorrupt("non-zero padding bits")
    return bits[:count].astype(bool)


BLOCK = 8192
"""Elements per step of the O(m) array pipelines: 64 KiB temporaries stay in cache and on the heap
(larger ones are mmap-ed and page-faulted afresh on every operation, which costs more than the work)."""


def blocks(n: int) -> range:
    return range(0, n, BLOCK)


def pack_fields(values: np.ndarray, widths: np.ndarray) -> bytes:
    """Concatenate ``values[i]`` as ``widths[i]`` bits each (LSB first). widths <= 63, values < 2**width."""
    total = int(widths.sum())
    if total == 0:
        return b""
    offsets = np.cumsum(widths, dtype=np.int64) - widths
    words = np.zeros((total >> 6) + 2, dtype=np.uint64)
    for s in blocks(len(values)):
        off = offsets[s : s + BLOCK]
        word = off >> 6
        shift = (off & 63).astype(np.uint64)
        v = values[s : s + BLOCK].astype(np.uint64)
        lo = v << shift
        hi = (v >> _ONE) >> (np.uint64(63) - shift)  # bits spilling into the next word; 0 if shift == 0
        starts = np.flatnonzero(np.diff(word, prepend=-1))
        uniq = word[starts]
        words[uniq] |= np.bitwise_or.reduceat(lo, starts)
        words[uniq + 1] |= np.bitwise_or.reduceat(hi, starts)
    return words.astype(U64).tobytes()[: (total + 7) // 8]


def unpack_fields(data: bytes | memoryview, widths: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_fields` (uint64 values); checks the stream length and padding."""
    total = int(widths.sum())
    if len(data) != (total + 7) // 8:
        raise ChunkCorrupt(f"field stream of {len(data)} bytes, expected {(total + 7) // 8}")
    if total == 0:
        return np.zeros(len(widths), dtype=np.uint64)
    if total % 8 and (data[-1] >> (total % 8)):
        raise ChunkCorrupt("non-zero padding bits")
    nwords = (total >> 6) + 2
    padded = bytearray(nwords * 8)
    padded[: len(data)] = data
    words = np.frombuffer(bytes(padded), dtype=U64).astype(np.uint64)
    offsets = np.cumsum(widths, dtype=np.int64) - widths
    out = np.empty(len(widths), dtype=np.uint64)
    for s in blocks(len(widths)):
        off = offsets[s : s + BLOCK]
        word = off >> 6
        shift = (off & 63).astype(np.uint64)
        v = (words[word] >> shift) | ((words[word + 1] << _ONE) << (np.uint64(63) - shift))
        out[s : s + BLOCK] = v & ((_ONE << widths[s : s + BLOCK].astype(np.uint64)) - _ONE)
    return out


_scratch_tls = threading.local()


def scratch(key: str, n: int, dtype: Any) -> np.ndarray:
    """A per-thread reusable buffer of n elements for the O(n) temporaries of one record.

    Fresh multi-megabyte arrays are returned to the OS on free and page-fault again on every use,
    which costs more than the pass itself; one record at a time per thread reuses these. Contents are
    valid until the next call with the same key on the same thread. Footprint: ~8 bytes per element of
    the largest record (~16 MiB with default chunks) per thread that has run the codec.
    """
    cache = getattr(_scratch_tls, "bufs", None)
    if cache is None:
        cache = _scratch_tls.bufs = {}
    dt = np.dtype(dtype)
    buf = cache.get((key, dt))
    if buf is None or len(buf) < n:
        buf = cache[(key, dt)] = np.empty(max(n, 1 << 16), dtype=dt)
    return buf[:n]


# -------------------------------------------------------------------------------------- Rice codes


def best_rice_k(values: np.ndarray, groups: np.ndarray, ngroups: int) -> np.ndarray:
    """Per group, the Rice k in 0..62 that minimises the coded size of its values.

    Searched over three candidates around log2(mean·ln 2), the optimum for geometric data.
    """
    cnt = np.bincount(groups, minlength=ngroups).astype(np.float64)
    tot = np.bincount(groups, weights=values.astype(np.float64), minlength=ngroups)
    mean = tot / np.maximum(cnt, 1)
    guess = np.floor(np.log2(mean * 0.69 + 1.0)).astype(np.int64)
    best_k = np.zeros(ngroups, dtype=np.int64)
    best_cost = np.full(ngroups, np.inf)
    for delta in (-1, 0, 1):
        k = np.clip(guess + delta, 0, 62)
        shifted = (values >> k[groups]).astype(np.float64)
        cost = np.bincount(groups, weights=shifted, minlength=ngroups) + cnt * (1 + k)
        better = cost < best_cost
        best_k[better] = k[better]
        best_cost[better] = cost[better]
    return best_k


def rice_encode(values: np.ndarray, ks: np.ndarray) -> tuple[bytes, bytes]:
    """Rice-code ``values`` (int64 >= 0) with per-symbol ``ks``: (unary stream, remainder stream)."""
    if len(values) == 0:
        return b"", b""
    q = values >> ks
    ones = np.cumsum(q + 1) - 1
    unary = np.zeros(int(ones[-1]) + 1, dtype=bool)
    unary[ones] = True
    rem = values & ((np.int64(1) << ks) - 1)
    return pack_bools(unary), pack_fields(rem, ks)


def rice_decode(unary: bytes | memoryview, rem: bytes | memoryview, ks: np.ndarray) -> np.ndarray:
    """Inverse of :func:`rice_encode`; both streams must be consumed exactly."""
    count = len(ks)
    if count == 0:
        if len(unary) or len(rem):
            raise ChunkCorrupt("Rice streams present but no symbols expected")
        return np.zeros(0, dtype=np.int64)
    bits = np.unpackbits(np.frombuffer(unary, dtype=np.uint8), bitorder="little")
    ones = np.flatnonzero(bits)
    if len(ones) != count or (int(ones[-1]) + 8) // 8 != len(unary):
        raise ChunkCorrupt("unary stream does not match the symbol count")
    q = np.diff(ones, prepend=-1) - 1
    if (ks > 62).any() or ((q >> (62 - ks)) != 0).any():
        raise ChunkCorrupt("Rice value out of range")
    r = unpack_fields(rem, ks).astype(np.int64)
    return (q << ks) | r


# ----------------------------------------------------------------------------- Bernoulli sequences
#
# A batch of S Bernoulli sequences is described by their lengths and their ones, given as (sequence id,
# position within the sequence) pairs sorted by sequence then position. Each sequence gets a parameter
# byte ``invert << 7 | k`` (invert: its zeros are coded because it is denser than 1/2) or none when it
# codes nothing (no ones, or only ones). The coded positions become gaps g >= 0 (zeros skipped since the
# previous coded position), Rice-coded with that sequence's k.

NO_PARAM = -1


def seq_encode(lengths: np.ndarray, seq: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(params per sequence or NO_PARAM, gaps, k per gap) for a batch of sequences."""
    nseq = len(lengths)
    ones = np.bincount(seq, minlength=nseq)
    invert = 2 * ones > lengths
    if invert.any():
        keep = ~invert[seq]
        cseq, clocal = _complement(lengths, invert, seq[~keep], local[~keep])
        seq = np.concatenate([seq[keep], cseq])
        local = np.concatenate([local[keep], clocal])
        order = _stable_order(seq, len(lengths))
        seq, local = seq[order], local[order]
    coded = np.where(invert, lengths - ones, ones)
    gaps = _gaps(seq, local)
    k = best_rice_k(gaps, seq, nseq)
    params = np.where(coded > 0, (invert.astype(np.int64) << 7) | k, NO_PARAM)
    return params, gaps, k[seq]


def coded_counts(lengths: np.ndarray, ones: np.ndarray, params: np.ndarray) -> np.ndarray:
    """How many Rice symbols each sequence contributes."""
    inv = (params >= 0) & ((params & 0x80) != 0)
    return np.where(params < 0, 0, np.where(inv, lengths - ones, ones))


def check_params(lengths: np.ndarray, ones: np.ndarray, params: np.ndarray) -> None:
    if (ones > lengths).any():
        raise ChunkCorrupt("more ones than sequence elements")
    has = params >= 0
    if (has != ((ones > 0) & (ones < lengths))).any():
        raise ChunkCorrupt("sequence parameter present/absent mismatch")
    if ((params[has] & 0x40) != 0).any():
        raise ChunkCorrupt("bad sequence parameter")


def seq_decode(
    lengths: np.ndarray, ones: np.ndarray, params: np.ndarray, gaps: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`seq_encode`: (sequence id, position) of every one, sorted."""
    nseq = len(lengths)
    counts = coded_counts(lengths, ones, params)
    seq = np.repeat(np.arange(nseq), counts)
    csum = np.cumsum(gaps + 1)
    ends = np.cumsum(counts)
    base = np.concatenate([[0], csum])[ends - counts]  # csum before each sequence's first symbol
    local = csum - 1 - base[seq]
    if len(local) and (local >= lengths[seq]).any():
        raise ChunkCorrupt("run lengths overrun their sequence")
    invert = np.where(params < 0, (ones == lengths) & (lengths > 0), (params & 0x80) != 0)
    if invert.any():
        keep = ~invert[seq]
        cseq, clocal = _complement(lengths, invert, seq[~keep], local[~keep])
        seq = np.concatenate([seq[keep], cseq])
        local = np.concatenate([local[keep], clocal])
        order = _stable_order(seq, len(lengths))
        seq, local = seq[order], local[order]
    return seq, local


def _stable_order(keys: np.ndarray, count: int) -> np.ndarray:
    """Stable argsort of small non-negative keys (< count): a radix sort when they fit 16 bits."""
    if count <= 1 << 16:
        return np.argsort(keys.astype(np.uint16 if count > 256 else np.uint8), kind="stable")
    return np.argsort(keys, kind="stable")


def _gaps(seq: np.ndarray, local: np.ndarray) -> np.ndarray:
    gaps = np.diff(local, prepend=-1) - 1
    starts = np.flatnonzero(np.diff(seq, prepend=-1))
    gaps[starts] = local[starts]
    return gaps


def _complement(
    lengths: np.ndarray, invert: np.ndarray, seq: np.ndarray, local: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Positions not listed, within the inverted sequences (listed pairs belong to those sequences)."""
    ids = np.flatnonzero(invert)
    offs = np.zeros(len(lengths), dtype=np.int64)
    offs[ids] = np.cumsum(lengths[ids]) - lengths[ids]
    mask = np.ones(int(lengths[ids].sum()), dtype=bool)
    mask[offs[seq] + local] = False
    flat = np.flatnonzero(mask)
    starts = offs[ids]
    which = ids[np.searchsorted(starts, flat, side="right") - 1]
    return which, flat - offs[which]


# ------------------------------------------------------------------------------ class bitmaps


class ClassBitmaps:
    """Membership bitmaps of K disjoint context classes over n elements, with rank and select.

    Built from K-1 "at or above threshold t_k" bitmaps (packed little-endian uint64 words): class 0 is
    below t_1, class c is [t_c, t_{c+1}), class K-1 is at or above t_{K-1}. All classes' words are laid
    end to end, so rank and select for a mixed batch of classes are single vectorised operations.
    """

    def __init__(self, n: int, above: list[np.ndarray]) -> None:
        self.n = n
        self.nwords = nw = (n + 63) // 64
        k = len(above) + 1
        words = scratch("cb_words", k * nw, np.uint64)
        full = scratch("cb_full", nw, np.uint64)
        full[:] = np.uint64(0xFFFFFFFFFFFFFFFF)
        if n % 64:
            full[-1] = (_ONE << np.uint64(n % 64)) - _ONE
        bounds = [full, *above]
        for c in range(k):
            dst = words[c * nw : (c + 1) * nw]
            if c + 1 < k:
                np.bitwise_and(bounds[c], ~bounds[c + 1], out=dst)
            else:
                dst[:] = bounds[c]
        self.words = words
        if _HAS_BITWISE_COUNT:
            self.pop = np.bitwise_count(words, out=scratch("cb_pop", k * nw, np.uint8))
        else:
            self.pop = popcount64(words)
        self.cum = np.cumsum(self.pop, dtype=np.int64, out=scratch("cb_cum", k * nw, np.int64))
        ends = self.cum[nw - 1 :: nw] if nw else np.zeros(k, dtype=np.int64)
        self.base = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self.counts = (ends - self.base).astype(np.int64)

    def rank(self, cls: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Index of each position among the members of its class (positions must be members)."""
        out = np.empty(len(positions), dtype=np.int64)
        for s in blocks(len(positions)):
            c, p = cls[s : s + BLOCK], positions[s : s + BLOCK]
            w = c * self.nwords + (p >> 6)
            below = self.words[w] & ((_ONE << (p & 63).astype(np.uint64)) - _ONE)
            out[s : s + BLOCK] = self.cum[w] - self.pop[w] + popcount64(below) - self.base[c]
        return out

    def select(self, cls: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Positions of the class members with the given ranks; (cls, ranks) sorted, ranks < counts."""
        out = np.empty(len(ranks), dtype=np.int64)
        for s in blocks(len(ranks)):
            c = cls[s : s + BLOCK]
            g = ranks[s : s + BLOCK] + self.base[c]  # ascending: class-major, ranks sorted per class
            lo, hi = np.searchsorted(self.cum, [g[0], g[-1]], side="right")
            w = lo + np.searchsorted(self.cum[lo : hi + 1], g, side="right")  # a cache-sized window
            j = (g - (self.cum[w] - self.pop[w])).astype(np.uint64)
            out[s : s + BLOCK] = ((w - c * self.nwords) << 6) + select64(self.words[w], j)
        return out


_M1 = np.uint64(0x5555555555555555)
_M2 = np.uint64(0x3333333333333333)
_M4 = np.uint64(0x0F0F0F0F0F0F0F0F)
_BYTES1 = np.uint64(0x0101010101010101)
_HIGH = np.uint64(0x8080808080808080)


def select64(x: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Index of the j-th (0-based) set bit of each uint64 ``x`` (broadword select, no per-bit work)."""
    b1 = x - ((x >> _ONE) & _M1)
    b2 = (b1 & _M2) + ((b1 >> np.uint64(2)) & _M2)
    per_byte = (b2 + (b2 >> np.uint64(4))) & _M4
    prefix = per_byte * _BYTES1  # byte i: set bits in bytes 0..i (≤ 64, no carries)
    # High bit of byte i set ⇔ prefix_i ≤ j; their count is the byte holding the j-th set bit.
    le = ((j * _BYTES1) | _HIGH) - prefix
    byte = popcount64(le & _HIGH).astype(np.uint64)
    shift = byte << np.uint64(3)
    before = ((prefix << np.uint64(8)) >> shift) & np.uint64(0xFF)
    target = (x >> shift) & np.uint64(0xFF)
    bit = _SELECT8_FLAT[((target << np.uint64(3)) + j - before).astype(np.intp)]
    return (shift + bit).astype(np.int64)
