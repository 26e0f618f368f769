"""Byte-level building blocks of the weight codec: bounds-checked parsing, LEB128 varints, kernel errors.

* ``Reader`` / ``put_varint`` / ``put_bytes``: every read that would run past the end raises
  :class:`~rlbus.errors.ChunkCorrupt`, so a truncated blob never yields garbage.
* ``check`` turns a compiled kernel's error code (:mod:`._kernels`) into :class:`~rlbus.errors.ChunkCorrupt`.

The bit-level coding (Rice codes split into a unary and a remainder stream, Bernoulli sequences coded as
Rice-coded gaps) runs inside the kernels; the layout is the SPARSE table in :mod:`.format`.
"""

from __future__ import annotations

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


# -------------------------------------------------------------------------------------- kernel errors


#: The error codes the compiled kernels return (0: none), and what each means.
ERR_OK = 0
ERR_UNARY = 1
ERR_RANGE = 2
ERR_FIELDS = 3
ERR_PADDING = 4
ERR_OVERRUN = 5
ERR_POPULATION = 6
ERR_VALUE = 7
ERR_TRUNCATED = 8
ERR_VARINT = 9
ERR_CLASSES = 10
ERR_COUNTS = 11
ERR_PARAM = 12

ERRORS = {
    ERR_UNARY: "unary stream does not match the symbol count",
    ERR_RANGE: "Rice value out of range",
    ERR_FIELDS: "field stream has the wrong length",
    ERR_PADDING: "non-zero padding bits",
    ERR_OVERRUN: "run lengths overrun their sequence",
    ERR_POPULATION: "value class populations disagree with the header",
    ERR_VALUE: "decoded value out of range",
    ERR_TRUNCATED: "truncated payload",
    ERR_VARINT: "varint too long or out of range",
    ERR_CLASSES: "bad class count or thresholds",
    ERR_COUNTS: "class, value and sequence counts disagree",
    ERR_PARAM: "bad sequence parameter",
}


def check(err: int) -> None:
    """Raise :class:`ChunkCorrupt` for a non-zero kernel error code."""
    if err:
        raise ChunkCorrupt(ERRORS[err])
