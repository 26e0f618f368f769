"""Whole model states ↔ chunks: ``encode_state_delta`` / ``encode_state_keyframe`` and their decoders.

The state is taken in sorted-name order and cut into records of one dtype (large tensors split, runs
of small ones shared), each coded in its best mode, on a thread pool when asked (the numeric work
releases the GIL), then packed into chunks. Decoding verifies and decodes a whole chunk into staged
updates before anything is written, so a corrupt chunk is never applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from rlbus.errors import ChunkCorrupt, WeightSyncError
from rlbus.weights.apply import SparseUpdate, apply_update_
from rlbus.weights.bitview import int_flat
from rlbus.weights.codec import device
from rlbus.weights.codec._bits import Reader
from rlbus.weights.codec.chunks import (
    Chunk,
    TensorRange,
    _entry_bytes,
    _pack_chunks,
    _parse_chunk,
    _ParsedChunk,
    _ranges,
    _Record,
)
from rlbus.weights.codec.format import _FLOATS, KIND_DELTA, KIND_KEYFRAME, RAW, SAME, SPARSE, _check_dtype
from rlbus.weights.codec.modes import (
    Decoded,
    _choose_mode,
    _decode_delta_payload,
    _decode_keyframe_payload,
    _encode_delta_payload,
    _encode_keyframe_payload,
    _make_update,
)
from rlbus.weights.codec.tensor import _check_pair

CHUNK_BYTES = 4 << 20
MAX_SEGMENT_BYTES = 4 << 20


@dataclass(frozen=True)
class StagedUpdate:
    """The update a chunk carries for one tensor (a chunk may hold several per tensor)."""

    name: str
    update: SparseUpdate


def _plan(state: Mapping[str, torch.Tensor], seg_bytes: int) -> list[_Record]:
    """Split the canonical (sorted) tensor stream into records of one dtype.

    A record's raw bytes, its pieces and its tensor-table entries stay within ``seg_bytes``, so even a
    record stored RAW fits in a chunk on its own.
    """
    records: list[_Record] = []
    cur: _Record | None = None
    cur_dtype: torch.dtype | None = None
    bound = 0
    for name in sorted(state):
        t = state[name]
        _check_dtype(t.dtype)
        entry = _entry_bytes(name, t) + 32
        if entry + t.element_size() > seg_bytes:
            raise ValueError(f"chunk_bytes too small for the table entry of {name!r}")
        numel = t.numel()
        if numel == 0:
            records.append(_Record([TensorRange(name, 0, 0)]))
            continue
        start = 0
        while start < numel:
            room = (seg_bytes - bound - entry) // t.element_size() if cur is not None else 0
            if cur is None or cur_dtype != t.dtype or room <= 0:
                cur, cur_dtype, bound = _Record([]), t.dtype, 0
                records.append(cur)
                room = (seg_bytes - entry) // t.element_size()
            take = min(numel - start, room)
            cur.pieces.append(TensorRange(name, start, start + take))
            bound += entry + take * t.element_size()
            start += take
    return records


def _gather(state: Mapping[str, torch.Tensor], pieces: list[TensorRange]) -> torch.Tensor:
    """A record's elements as one flat tensor: a view for one piece, else a copy. On the CPU the copy
    goes through numpy, whose allocations of a record's size reuse freed memory; torch's faults in fresh
    pages every time, which cost ~10× the copy itself."""
    parts = [state[p.name].detach().reshape(-1)[p.start : p.stop] for p in pieces]
    if len(parts) == 1:
        return parts[0]
    if parts[0].device.type != "cpu":
        return torch.cat(parts)
    flat = [int_flat(t).numpy() for t in parts]
    return torch.from_numpy(np.concatenate(flat)).view(parts[0].dtype)


def _check_same_structure(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    if set(old) != set(new):
        raise ValueError(f"state keys differ: {sorted(set(old) ^ set(new))[:5]}")
    for name in old:
        _check_pair(old[name], new[name])


def _segment_bytes(chunk_bytes: int) -> int:
    """Record budget: a chunk minus room for its header, record framing and checksum."""
    if chunk_bytes < 1024:
        raise ValueError("chunk_bytes must be at least 1024")
    return min(MAX_SEGMENT_BYTES, chunk_bytes - 64 - chunk_bytes // 64)


def _map(fn: Callable[[_Record], None], records: list[_Record], threads: int) -> None:
    """Run ``fn`` over records, on a thread pool when ``threads`` > 1 (numpy releases the GIL)."""
    if threads <= 1 or len(records) <= 1:
        for rec in records:
            fn(rec)
        return
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(fn, records))


def encode_state_delta(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    chunk_bytes: int = CHUNK_BYTES,
    *,
    threads: int = 1,
) -> list[Chunk]:
    """Chunks that turn ``old`` into ``new``; unchanged records are left out (no chunks: no change).

    Works for any two versions, so a worker several versions behind gets one coalesced delta S_a → S_c.
    """
    _check_same_structure(old, new)
    records = [r for r in _plan(new, _segment_bytes(chunk_bytes)) if r.pieces[0].stop > r.pieces[0].start]

    def encode(rec: _Record) -> None:
        rec.mode, rec.payload = _encode_delta_payload(_gather(old, rec.pieces), _gather(new, rec.pieces))

    if _on_device(new):
        _encode_on_device(old, new, records)
    else:
        _map(encode, records, threads)
    return _pack_chunks(KIND_DELTA, [r for r in records if r.mode != SAME], new, chunk_bytes)


#: Elements of one device batch: bounds the coder's working memory (≈ 12 bytes an element beside the records).
DEVICE_BATCH = 1 << 28


def _on_device(state: Mapping[str, torch.Tensor]) -> bool:
    return any(device.wanted(t) for t in state.values())


def _device_batches(state: Mapping[str, torch.Tensor], records: list[_Record]) -> list[list[_Record]]:
    """Float records in runs of one dtype and at most ``DEVICE_BATCH`` elements (one coder call each)."""
    batches: list[list[_Record]] = []
    size = 0
    for rec in records:
        dtype = state[rec.pieces[0].name].dtype
        if dtype not in _FLOATS:
            continue
        n = sum(p.stop - p.start for p in rec.pieces)
        if not batches or size + n > DEVICE_BATCH or state[batches[-1][0].pieces[0].name].dtype != dtype:
            batches.append([])
            size = 0
        batches[-1].append(rec)
        size += n
    return batches


def _encode_on_device(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], records: list[_Record]) -> None:
    """Every record of a state on an accelerator: float records in batches (:mod:`.device`), the others
    through the host."""
    done: set[int] = set()
    for batch in _device_batches(new, records):
        fmt = _FLOATS[new[batch[0].pieces[0].name].dtype]
        olds = [_gather(old, r.pieces) for r in batch]
        news = [_gather(new, r.pieces) for r in batch]
        for rec, o, n, sparse in zip(batch, olds, news, device.encode_records(olds, news, fmt), strict=True):
            rec.mode, rec.payload = _choose_mode(o, n, sparse)
            done.add(id(rec))
    for rec in records:
        if id(rec) not in done:
            rec.mode, rec.payload = _encode_delta_payload(_gather(old, rec.pieces), _gather(new, rec.pieces))


def encode_state_keyframe(
    state: Mapping[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES, *, threads: int = 1
) -> list[Chunk]:
    """Chunks holding a full snapshot of ``state`` (every tensor, including empty ones)."""
    records = _plan(state, _segment_bytes(chunk_bytes))

    def encode(rec: _Record) -> None:
        if rec.pieces[0].stop > rec.pieces[0].start:
            rec.mode, rec.payload = _encode_keyframe_payload(_gather(state, rec.pieces))
        else:
            rec.mode = RAW

    _map(encode, records, threads)
    return _pack_chunks(KIND_KEYFRAME, records, state, chunk_bytes)


def decode_chunk(
    state: Mapping[str, torch.Tensor],
    data: bytes | memoryview,
    *,
    expected_hash: str | None = None,
    threads: int = 1,
) -> list[StagedUpdate]:
    """Verify and fully decode one chunk against ``state`` (only read) into staged updates.

    Raises :class:`ChunkCorrupt` if the chunk fails its hash, its checksum or any structural check, and
    :class:`WeightSyncError` if it does not fit ``state`` (missing tensor, other dtype or shape).
    """
    return _decode_parsed(state, _parse_chunk(data, expected_hash), threads)


def _decode_parsed(state: Mapping[str, torch.Tensor], parsed: _ParsedChunk, threads: int) -> list[StagedUpdate]:
    meta = {name: (dtype, shape) for name, dtype, shape in parsed.table}
    for name, (dtype, shape) in meta.items():
        t = state.get(name)
        if t is None or t.dtype != dtype or tuple(t.shape) != shape:
            have = "missing" if t is None else f"{t.dtype}{list(t.shape)}"
            raise WeightSyncError(f"chunk tensor {name} is {dtype}{list(shape)}, state has {have}")

    def decode(item: tuple[list[TensorRange], int, memoryview]) -> list[StagedUpdate]:
        pieces, mode, payload = item
        dtype = meta[pieces[0].name][0]
        n = sum(p.stop - p.start for p in pieces)
        r = Reader(payload)
        pos: Decoded | None = None
        bits: Decoded | None = None
        if id(item) in on_device:
            pos, bits = on_device[id(item)]
        elif parsed.kind == KIND_DELTA:
            if n:
                pos, bits = _decode_delta_payload(_gather(state, pieces), mode, r)
            r.expect_end()
        else:
            bits = _decode_keyframe_payload(dtype, n, mode, r)
            r.expect_end()
        return _split(state, pieces, pos, bits)

    try:
        on_device = _decode_on_device(state, parsed) if parsed.kind == KIND_DELTA and _on_device(state) else {}
        if threads > 1 and len(parsed.records) > 1 and not on_device:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                parts = list(pool.map(decode, parsed.records))
        else:
            parts = [decode(item) for item in parsed.records]
    except (ValueError, IndexError, OverflowError) as e:
        raise ChunkCorrupt(f"chunk does not decode: {e}") from None
    return [u for part in parts for u in part]


def _decode_on_device(state: Mapping[str, torch.Tensor], parsed: _ParsedChunk) -> dict[int, tuple[Decoded, Decoded]]:
    """A chunk's SPARSE records against a state on an accelerator, decoded there in batches (the payloads
    are checked to end where the record does); by ``id`` of the parsed record."""
    out: dict[int, tuple[Decoded, Decoded]] = {}
    sparse = [item for item in parsed.records if item[1] == SPARSE and any(p.stop > p.start for p in item[0])]
    recs = [_Record(item[0]) for item in sparse]
    items = {id(rec): item for rec, item in zip(recs, sparse, strict=True)}
    for batch in _device_batches(state, recs):
        fmt = _FLOATS[state[batch[0].pieces[0].name].dtype]
        views = [items[id(rec)][2] for rec in batch]
        payloads = [device.Payload(np.frombuffer(v, dtype=np.uint8), 0, len(v)) for v in views]
        found, ends = device.decode_records([_gather(state, rec.pieces) for rec in batch], payloads, fmt)
        for rec, view, result, end in zip(batch, views, found, ends, strict=True):
            if end != len(view):
                raise ChunkCorrupt(f"{len(view) - end} unexpected trailing bytes")
            out[id(items[id(rec)])] = result
    return out


def _split(
    state: Mapping[str, torch.Tensor],
    pieces: list[TensorRange],
    pos: Decoded | None,
    bits: Decoded | None,
) -> list[StagedUpdate]:
    """Record-local results (SPARSE positions ascending) → one update per piece, in tensor coordinates
    (views of the decoded arrays, positions shifted in place)."""
    if bits is None:
        return []
    if pos is not None and len(pieces) == 1:
        p = pieces[0]
        t = state[p.name]
        return [StagedUpdate(p.name, _make_update(t.numel(), t.dtype, pos, bits, p.start))] if len(pos) else []
    out = []
    offset = 0
    edges = np.cumsum([0] + [p.stop - p.start for p in pieces])
    bounds: np.ndarray | None = None
    if isinstance(pos, torch.Tensor):
        bounds = torch.searchsorted(pos, torch.from_numpy(edges).to(pos.device)).cpu().numpy()
    elif pos is not None:
        bounds = np.searchsorted(pos, edges)
    for i, p in enumerate(pieces):
        t = state[p.name]
        count = p.stop - p.start
        if pos is None or bounds is None:
            update = _make_update(t.numel(), t.dtype, None, bits[offset : offset + count], p.start)
            out.append(StagedUpdate(p.name, update))
        else:
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if hi > lo:
                update = _make_update(t.numel(), t.dtype, pos[lo:hi], bits[lo:hi], p.start - offset)
                out.append(StagedUpdate(p.name, update))
        offset += count
    return out


def apply_chunk_(
    state: Mapping[str, torch.Tensor],
    data: bytes | memoryview,
    *,
    expected_hash: str | None = None,
    threads: int = 1,
) -> tuple[TensorRange, ...]:
    """Decode a chunk completely, then apply it to ``state`` in place; returns the ranges it covered.

    Nothing is written unless the whole chunk verified and decoded.
    """
    parsed = _parse_chunk(data, expected_hash)
    staged = _decode_parsed(state, parsed, threads)
    for s in staged:
        apply_update_(state[s.name], s.update)
    return _ranges([_Record(pieces) for pieces, _, _ in parsed.records])


def load_keyframe(
    chunks: Iterable[bytes | memoryview], *, hashes: Iterable[str] | None = None, threads: int = 1
) -> dict[str, torch.Tensor]:
    """Build a fresh state (CPU tensors) from all chunks of a keyframe.

    Every chunk is verified and decoded before anything is returned; the tensor tables give shapes.
    """
    state: dict[str, torch.Tensor] = {}
    hash_list = list(hashes) if hashes is not None else None
    staged: list[StagedUpdate] = []
    for i, data in enumerate(chunks):
        parsed = _parse_chunk(data, hash_list[i] if hash_list is not None else None)
        if parsed.kind != KIND_KEYFRAME:
            raise ChunkCorrupt("not a keyframe chunk")
        for name, dtype, shape in parsed.table:
            if name not in state:
                state[name] = torch.empty(shape, dtype=dtype)
        staged += _decode_parsed(state, parsed, threads)
    for s in staged:
        apply_update_(state[s.name], s.update)
    return state
