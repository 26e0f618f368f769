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


def check(err: int) -> None:
    """Raise :class:`ChunkCorrupt` for a non-zero kernel error code."""
    if err:
        from rlbus.weights.codec._kernels import ERRORS  # the kernels import the format, which imports this

        raise ChunkCorrupt(ERRORS[err])
