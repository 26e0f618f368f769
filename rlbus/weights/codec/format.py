"""The weight codec's byte format: the layout table, format constants, dtype codes and blob headers.

Every other module of :mod:`rlbus.weights.codec` writes or reads bytes laid out as below; the constants
they share (kinds, modes, class limits, dtype codes) and the tensor-blob header live here with it.

Byte layout (integers little-endian; ``varint`` = unsigned LEB128; bitstreams LSB-first, zero-padded):

**Tensor blob** — ``encode_delta`` / ``encode_keyframe`` (one tensor; no checksum, chunks carry that)

    ====== ======= ==================================================================================
    offset size    field
    ====== ======= ==================================================================================
    0      u8      format version = 1
    1      u8      kind: 1 = delta, 2 = keyframe
    2      u8      dtype code (``DTYPE_CODES``: 1 bf16, 2 fp16, 3 fp32, 4 fp64, 5 u8, 6 i8, 7 i16,
                   8 i32, 9 i64, 10 bool)
    3      varint  ndim, then ndim varint dims (checked against the tensor a delta is applied to)
    …      u8      mode (table below)
    …      rest    mode payload
    ====== ======= ==================================================================================

**Chunk** — ``encode_state_delta`` / ``encode_state_keyframe``: ≤ ``chunk_bytes``, decodes on its own

    =========== ====================================================================================
    size        field
    =========== ====================================================================================
    4           magic ``RLBW``
    u8          format version = 1
    u8          kind: 1 = delta, 2 = keyframe
    u8          tensor-table codec: 0 = stored, 1 = zstd (used when smaller; names repeat a lot)
    varint+…    tensor table: varint count; per tensor varint name length, UTF-8 name, u8 dtype code,
                varint ndim, ndim varint dims
    varint      record count, then per record:
                  varint piece count; per piece varint tensor index, varint start, varint count
                  u8 mode, varint payload length, payload
    8           xxh3-64 of every preceding byte: a truncated or damaged chunk is rejected before any
                of it is parsed, with or without the manifest's xxh3-128 ``Chunk.hash``
    =========== ====================================================================================

    A record is the concatenation of its pieces (element ranges of tensors of one dtype, in sorted-name
    order): large tensors are split, runs of small tensors share a record. Its raw size stays below
    ``chunk_bytes`` minus a margin (default ~4 MiB, 2 M bf16 elements) so even a RAW record fits a
    chunk; the per-record class parameters (a few dozen bytes) amortise over that many elements.
    Delta chunks leave out unchanged records; a version with no change has no chunks.

**Modes** (per record or tensor blob; the encoder keeps the smallest of those it tried)

    ==== ========= ================================================================================
    code name      payload
    ==== ========= ================================================================================
    0    SAME      empty: nothing changed
    1    SPARSE    bf16/fp16/fp32 deltas; layout below
    2    XOR       planes of old XOR new, plane i = byte i of every element. Tried when SPARSE
                   exceeds 1/4 of raw (near-random changes), and for other dtypes
    3    RAW       the new elements' bytes
    4    PLANES    keyframes. bf16: [exponent byte | sign + 7 mantissa bits]; fp32: [exponent | sign +
                   7 high mantissa bits | mantissa byte | mantissa byte]; fp16: [high byte | low byte];
                   others: one plane per byte
    ==== ========= ================================================================================

    Planes (modes 2, 4): u8 plane count, then per plane u8 codec (0 stored, 1 zstd) + varint length +
    bytes. The exponent plane uses zstd with a literal-heavy preset (min match 7, 128 KiB window):
    it is an order-0 source, so Huffman-coded literals beat LZ matches.

**SPARSE payload** (n elements, m changed)

    ================== =============================================================================
    field              meaning
    ================== =============================================================================
    u8 K, K-1 × u8     position classes: thresholds T_1 < … < T_{K-1} on the old value's biased
                       exponent e; class c = {T_c ≤ e < T_{c+1}} (T_0 = 0, T_K = ∞), n_c members
    u8 V, V-1 × u8     value classes: thresholds on e, same convention
    V × varint         n_v: changed elements per value class (Σ = m)
    K sequence heads   position sequence of class c, length n_c: varint m_c (its ones: changed
                       members), then a parameter byte if 0 < m_c < n_c
    3 × V heads        level l = 1, 2, 3 of value class v, length P = elements with |d| ≥ l (P_1 = n_v,
                       P_{l+1} = ones of level l), written only if P > 0: varint ones (|d| > l), then
                       a parameter byte if 0 < ones < P
    V × u8             tail Rice k, for each value class with elements |d| ≥ 4
    varint + bytes     unary stream: every Rice quotient, in the order of the heads above, then tails
    varint + bytes     remainder stream: the matching k-bit remainders
    ceil(m/8) bytes    sign bits of d (1 = negative), position-class-major order
    ================== =============================================================================

    Orders: changed elements are listed position-class-major (by position within a class); level and
    tail sequences follow value-class-major order over that list. ord(b) = b for a clear sign bit and
    −(b & magnitude mask) − 1 otherwise: monotone in the float value, bijective on bit patterns (so
    −0.0 ≠ +0.0 and NaN payloads survive), and d ≠ 0 exactly when the bits changed.

    A sequence is coded by its gaps g ≥ 0 (zeros before each coded one, counted from the previous one
    or the start); parameter byte = ``invert << 7 | k``: invert means the zeros are coded instead of
    the ones (sequences denser than 1/2), k the Rice parameter. Sequences of no ones or only ones code
    nothing. A Rice symbol is g >> k zero bits then a one in the unary stream, g's low k bits in the
    remainder stream. Splitting the streams is what lets numpy decode every quotient with one
    ``flatnonzero``: with the best k, gap coding is within ~1 % of the conditional entropy here.

Robustness: every count is bounded by what contains it, stream lengths must match exactly, padding
bits must be zero, and decoded positions and values are range-checked, so damaged bytes raise
``ChunkCorrupt`` (``WeightSyncError`` when a chunk does not fit the state) and never write anything.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from rlbus.errors import ChunkCorrupt
from rlbus.weights.codec._bits import Reader, put_varint

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("rlbus.weights.codec assumes a little-endian host")

FORMAT_VERSION = 1
MAGIC = b"RLBW"
KIND_DELTA, KIND_KEYFRAME = 1, 2
SAME, SPARSE, XOR, RAW, PLANES = 0, 1, 2, 3, 4
MAX_CLASSES = 8
MAX_VALUE_CLASSES = 16
LEVELS = 3
_MAX_DIMS = 64
_MAX_NAME = 1 << 16
_MAX_NUMEL = 1 << 40

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class _Float:
    """Bit layout of a float dtype the sparse path understands."""

    bits: int
    mant: int  # explicit mantissa bits

    @property
    def mag_mask(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def exp_count(self) -> int:
        return 1 << (self.bits - 1 - self.mant)


_FLOATS = {torch.bfloat16: _Float(16, 7), torch.float16: _Float(16, 10), torch.float32: _Float(32, 23)}


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in DTYPE_CODES:
        raise TypeError(f"unsupported dtype {dtype}")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _put_header(out: bytearray, kind: int, t: torch.Tensor) -> None:
    out += bytes([FORMAT_VERSION, kind, DTYPE_CODES[t.dtype]])
    put_varint(out, t.dim())
    for s in t.shape:
        put_varint(out, s)


def _read_header(r: Reader, kind: int) -> tuple[torch.dtype, tuple[int, ...]]:
    if r.u8() != FORMAT_VERSION:
        raise ChunkCorrupt("unknown format version")
    if r.u8() != kind:
        raise ChunkCorrupt("blob is of the wrong kind")
    dtype = _read_dtype(r)
    ndim = r.varint(_MAX_DIMS)
    shape = tuple(r.varint(1 << 48) for _ in range(ndim))
    return dtype, shape


def _read_dtype(r: Reader) -> torch.dtype:
    code = r.u8()
    if code not in _DTYPES:
        raise ChunkCorrupt(f"unknown dtype code {code}")
    return _DTYPES[code]
