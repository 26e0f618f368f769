"""Bit-level building blocks of the weight codec: varints, Rice codes and Bernoulli sequences.

* ``Reader`` / ``put_varint``: bounds-checked parsing and LEB128 varints. Every read that would run
  past the end raises :class:`~rlbus.errors.ChunkCorrupt`, so a truncated blob never yields garbage.
* Rice codes (Golomb codes with a power-of-two divisor, Rice 1979) split into two streams: the unary
  quotients in one bitstream and the k-bit remainders in another.
* Bernoulli sequences coded as Rice-coded run lengths between their ones ("gap coding"). For a
  memoryless source with P(one) = p the gaps are geometric, for which Golomb codes are optimal prefix
  codes; with the best k the loss against the entropy n·H(p) is ~1 % on the weight deltas we measured.
  Sequences denser than 1/2 code their zeros instead.

The per-symbol loops run in the compiled kernels of ``_kernels``; this module holds their typed
Python entry points and turns kernel error codes into :class:`~rlbus.errors.ChunkCorrupt`.
Bit order is little-endian throughout: bit j of a stream is bit (j % 8) of byte j // 8.
"""

from __future__ import annotations

import numpy as np

import rlbus.weights.codec._kernels as K
from rlbus.errors import ChunkCorrupt

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


def check(err: int) -> None:
    """Raise :class:`ChunkCorrupt` for a non-zero kernel error code."""
    if err:
        raise ChunkCorrupt(K.ERRORS[err])


def as_u8(data: bytes | bytearray | memoryview) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def pack_bools(bits: np.ndarray) -> bytes:
    return np.packbits(bits, bitorder="little").tobytes()


def pack_fields(values: np.ndarray, widths: np.ndarray) -> bytes:
    """Concatenate ``values[i]`` as ``widths[i]`` bits each (LSB first). widths <= 63, values < 2**width."""
    return K.pack_fields(np.asarray(values, dtype=np.int64), np.asarray(widths, dtype=np.int64)).tobytes()


def unpack_fields(data: bytes | memoryview, widths: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_fields` (uint64 values); checks the stream length and padding."""
    out, err = K.unpack_fields(as_u8(data), np.asarray(widths, dtype=np.int64))
    check(err)
    return out


# -------------------------------------------------------------------------------------- Rice codes


def best_rice_k(values: np.ndarray, groups: np.ndarray, ngroups: int) -> np.ndarray:
    """Per group, the Rice k in 0..62 that minimises the coded size of its values.

    Searched over three candidates around log2(mean·ln 2), the optimum for geometric data; ties go to
    the smallest candidate.
    """
    cnt, tot = K.group_sums(values, groups, ngroups)
    mean = tot.astype(np.float64) / np.maximum(cnt, 1).astype(np.float64)
    guess = np.floor(np.log2(mean * 0.69 + 1.0)).astype(np.int64)
    cand = np.clip(guess[:, None] + np.arange(-1, 2), 0, 62)
    cost = K.rice_costs(values, groups, cand)
    return cand[np.arange(ngroups), np.argmin(cost, axis=1)]


def rice_encode(values: np.ndarray, ks: np.ndarray) -> tuple[bytes, bytes]:
    """Rice-code ``values`` (int64 >= 0) with per-symbol ``ks``: (unary stream, remainder stream)."""
    values = np.asarray(values, dtype=np.int64)
    ks = np.asarray(ks, dtype=np.int64)
    if len(values) == 0:
        return b"", b""
    rem = values & ((np.int64(1) << ks) - 1)
    return K.unary_encode(values, ks).tobytes(), K.pack_fields(rem, ks).tobytes()


def rice_decode(unary: bytes | memoryview, rem: bytes | memoryview, ks: np.ndarray) -> np.ndarray:
    """Inverse of :func:`rice_encode`; both streams must be consumed exactly."""
    ks = np.asarray(ks, dtype=np.int64)
    if len(ks) == 0:
        if len(unary) or len(rem):
            raise ChunkCorrupt("Rice streams present but no symbols expected")
        return np.zeros(0, dtype=np.int64)
    q, err = K.unary_decode(as_u8(unary), ks)
    check(err)
    r, err = K.unpack_fields(as_u8(rem), ks)
    check(err)
    return (q << ks) | r.astype(np.int64)


# ----------------------------------------------------------------------------- Bernoulli sequences
#
# A batch of S Bernoulli sequences is described by their lengths and their ones, given as (sequence id,
# position within the sequence) pairs sorted by sequence then position. Each sequence gets a parameter
# byte ``invert << 7 | k`` (invert: its zeros are coded because it is denser than 1/2) or none when it
# codes nothing (no ones, or only ones). The coded positions become gaps g >= 0 (zeros skipped since the
# previous coded position), Rice-coded with that sequence's k.

NO_PARAM = -1


def seq_encode(
    lengths: np.ndarray, seq: np.ndarray, local: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ones per sequence, params per sequence or NO_PARAM, gaps, k per gap) for a batch of sequences."""
    ones, invert, gaps, gseq = K.seq_gaps(lengths, seq, local)
    coded = np.where(invert, lengths - ones, ones)
    k = best_rice_k(gaps, gseq, len(lengths))
    params = np.where(coded > 0, (invert.astype(np.int64) << 7) | k, NO_PARAM)
    return ones, params, gaps, k[gseq]


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
    counts = coded_counts(lengths, ones, params)
    invert = np.where(params < 0, (ones == lengths) & (lengths > 0), (params & 0x80) != 0)
    seq, local, err = K.seq_ones(lengths, ones, invert, counts, gaps)
    check(err)
    return seq, local
