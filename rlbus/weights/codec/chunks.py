"""The chunk container: records framed with a tensor table and a checksum, each chunk decodable alone.

A chunk (≤ ``chunk_bytes``, layout in :mod:`rlbus.weights.codec.format`) names the tensors it touches
in its own table and ends in an xxh3-64 of everything before it, so a truncated or damaged chunk is
rejected before a byte of it is parsed; the manifest's xxh3-128 (:func:`chunk_hash`) checks it again
end to end. Packing is greedy against an upper bound of each record's framed size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash
import zstandard

from rlbus.errors import ChunkCorrupt
from rlbus.weights.codec._bits import Reader, put_bytes, put_varint
from rlbus.weights.codec.format import (
    _MAX_DIMS,
    _MAX_NAME,
    _MAX_NUMEL,
    DTYPE_CODES,
    FORMAT_VERSION,
    KIND_DELTA,
    KIND_KEYFRAME,
    MAGIC,
    SAME,
    _read_dtype,
)
from rlbus.weights.codec.planes import _zstd


@dataclass(frozen=True)
class TensorRange:
    """Elements [start, stop) of the flattened tensor ``name``."""

    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class Chunk:
    """One self-contained piece of a weight version, ≤ ``chunk_bytes``; ``hash`` is xxh3-128 hex."""

    data: bytes
    hash: str
    tensors: tuple[TensorRange, ...]

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass
class _Record:
    pieces: list[TensorRange]
    mode: int = SAME
    payload: bytes = b""
    size: int = field(default=0)


def chunk_hash(data: bytes | memoryview) -> str:
    """xxh3-128 of a chunk, as the manifest records it."""
    return xxhash.xxh3_128_hexdigest(data)


def _entry_bytes(name: str, t: torch.Tensor) -> int:
    """Upper bound of a tensor's entry in a chunk's tensor table."""
    return len(name.encode()) + 16 + 10 * t.dim()


def _record_bytes(rec: _Record, index: dict[str, int]) -> bytes:
    out = bytearray()
    put_varint(out, len(rec.pieces))
    for p in rec.pieces:
        put_varint(out, index[p.name])
        put_varint(out, p.start)
        put_varint(out, p.stop - p.start)
    out.append(rec.mode)
    put_bytes(out, rec.payload)
    return bytes(out)


def _table(names: list[str], state: Mapping[str, torch.Tensor]) -> bytes:
    out = bytearray()
    put_varint(out, len(names))
    for name in names:
        raw = name.encode()
        put_bytes(out, raw)
        t = state[name]
        out.append(DTYPE_CODES[t.dtype])
        put_varint(out, t.dim())
        for s in t.shape:
            put_varint(out, s)
    return bytes(out)


def _assemble(kind: int, records: list[_Record], state: Mapping[str, torch.Tensor], compress: bool) -> bytes:
    names: list[str] = []
    index: dict[str, int] = {}
    for rec in records:
        for p in rec.pieces:
            if p.name not in index:
                index[p.name] = len(names)
                names.append(p.name)
    table = _table(names, state)
    out = bytearray(MAGIC)
    out += bytes([FORMAT_VERSION, kind])
    packed = _zstd(3).compress(table) if compress else table
    if compress and len(packed) < len(table):
        out.append(1)
        put_bytes(out, packed)
    else:
        out.append(0)
        put_bytes(out, table)
    put_varint(out, len(records))
    for rec in records:
        out += _record_bytes(rec, index)
    out += xxhash.xxh3_64_intdigest(out).to_bytes(8, "little")
    return bytes(out)


def _pack_chunks(kind: int, records: list[_Record], state: Mapping[str, torch.Tensor], chunk_bytes: int) -> list[Chunk]:
    """Greedy packing of encoded records into chunks of at most ``chunk_bytes`` bytes."""
    chunks: list[Chunk] = []
    group: list[_Record] = []
    bound = 0
    names: set[str] = set()

    def flush() -> None:
        if not group:
            return
        data = _assemble(kind, group, state, compress=True)
        if len(data) > chunk_bytes:  # the stored table is the bound we packed against
            data = _assemble(kind, group, state, compress=False)
        chunks.append(Chunk(data, chunk_hash(data), _ranges(group)))

    for rec in records:
        rb = len(_record_bytes(rec, {p.name: 0 for p in rec.pieces})) + 8 * len(rec.pieces)
        new_names = {p.name for p in rec.pieces} - names
        tb = sum(_entry_bytes(n, state[n]) for n in new_names)
        if group and bound + rb + tb > chunk_bytes:
            flush()
            group, bound, names = [], 0, set()
            tb = sum(_entry_bytes(n, state[n]) for n in {p.name for p in rec.pieces})
        if not group:
            bound = len(MAGIC) + 3 + 10 + 10 + 8
        if bound + rb + tb > chunk_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} is too small for one record of {rec.pieces[0].name}")
        group.append(rec)
        bound += rb + tb
        names |= {p.name for p in rec.pieces}
    flush()
    return chunks


def _ranges(records: list[_Record]) -> tuple[TensorRange, ...]:
    out: list[TensorRange] = []
    for rec in records:
        for p in rec.pieces:
            if out and out[-1].name == p.name and out[-1].stop == p.start:
                out[-1] = TensorRange(p.name, out[-1].start, p.stop)
            else:
                out.append(p)
    return tuple(out)


@dataclass(frozen=True)
class _ParsedChunk:
    kind: int
    table: list[tuple[str, torch.dtype, tuple[int, ...]]]
    records: list[tuple[list[TensorRange], int, memoryview]]


def _parse_chunk(data: bytes | memoryview, expected_hash: str | None) -> _ParsedChunk:
    view = memoryview(data)
    if expected_hash is not None and chunk_hash(view) != expected_hash:
        raise ChunkCorrupt("chunk hash does not match the manifest")
    if len(view) < len(MAGIC) + 3 + 8 or bytes(view[:4]) != MAGIC:
        raise ChunkCorrupt("not a weight chunk (bad magic or too short)")
    if xxhash.xxh3_64_intdigest(view[:-8]) != int.from_bytes(view[-8:], "little"):
        raise ChunkCorrupt("chunk checksum mismatch (truncated or corrupted)")
    r = Reader(view, 4, len(view) - 8)
    if r.u8() != FORMAT_VERSION:
        raise ChunkCorrupt("unknown chunk format version")
    kind = r.u8()
    if kind not in (KIND_DELTA, KIND_KEYFRAME):
        raise ChunkCorrupt(f"unknown chunk kind {kind}")
    codec = r.u8()
    table_bytes = r.blob()
    if codec == 1:
        try:
            table_bytes = memoryview(zstandard.ZstdDecompressor().decompress(table_bytes, max_output_size=1 << 26))
        except zstandard.ZstdError as e:
            raise ChunkCorrupt(f"tensor table: {e}") from None
    elif codec != 0:
        raise ChunkCorrupt("unknown table codec")
    tr = Reader(table_bytes)
    table = []
    for _ in range(tr.varint(1 << 24)):
        try:
            name = bytes(tr.take(tr.varint(_MAX_NAME))).decode()
        except UnicodeDecodeError:
            raise ChunkCorrupt("tensor name is not UTF-8") from None
        dtype = _read_dtype(tr)
        shape = tuple(tr.varint(1 << 48) for _ in range(tr.varint(_MAX_DIMS)))
        if int(np.prod(shape, dtype=np.float64)) > _MAX_NUMEL:
            raise ChunkCorrupt(f"implausible shape {shape} for {name!r}")
        table.append((name, dtype, shape))
    tr.expect_end()
    numels = [math.prod(shape) for _, _, shape in table]
    records = []
    for _ in range(r.varint(1 << 24)):
        pieces = []
        dtypes = set()
        for _ in range(r.varint(1 << 24)):
            if not table:
                raise ChunkCorrupt("piece refers to an empty tensor table")
            ti = r.varint(len(table) - 1)
            name, dtype, _ = table[ti]
            numel = numels[ti]
            start = r.varint(numel)
            count = r.varint(numel - start)
            pieces.append(TensorRange(name, start, start + count))
            dtypes.add(dtype)
        if len(dtypes) != 1:
            raise ChunkCorrupt("record pieces must share one dtype")
        mode = r.u8()
        records.append((pieces, mode, r.blob()))
    r.expect_end()
    return _ParsedChunk(kind, table, records)


def chunk_ranges(data: bytes | memoryview) -> tuple[TensorRange, ...]:
    """The tensor ranges a chunk covers (after verifying its checksum)."""
    parsed = _parse_chunk(data, None)
    return _ranges([_Record(pieces) for pieces, _, _ in parsed.records])
