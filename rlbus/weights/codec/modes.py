"""The per-record mode choice: which of SAME, SPARSE, XOR, RAW or PLANES codes a run of elements.

A record is one tensor blob or one piece-run of a chunk. The encoder tries the modes that fit and keeps
the smallest payload; the decoder dispatches on the mode byte and returns positions and new bit patterns
(or all new bits, for the dense modes), which :func:`_make_update` turns into a staged update.
"""

from __future__ import annotations

import numpy as np
import torch

from rlbus.errors import ChunkCorrupt
from rlbus.weights.apply import SparseUpdate
from rlbus.weights.bitview import NP_UINT, np_bits, tensor_from_bits
from rlbus.weights.codec import device
from rlbus.weights.codec._bits import Reader
from rlbus.weights.codec.format import _FLOATS, PLANES, RAW, SAME, SPARSE, XOR, _itemsize
from rlbus.weights.codec.planes import (
    _byte_planes,
    _float_planes,
    _join_byte_planes,
    _join_float_planes,
    _plane_count,
    _put_planes,
    _read_planes,
)
from rlbus.weights.codec.sparse import decode_sparse, encode_sparse


def _encode_delta_payload(old: torch.Tensor, new: torch.Tensor) -> tuple[int, bytes]:
    """(mode, payload) for one record: the smallest of the modes tried."""
    fmt = _FLOATS.get(old.dtype)
    if fmt is not None:
        if device.wanted(old):
            return _choose_mode(old, new, device.encode_records([old], [new], fmt)[0])
        return _choose_mode(old, new, encode_sparse(np_bits(old), np_bits(new), fmt))
    return _choose_mode(old, new, None)


def _choose_mode(old: torch.Tensor, new: torch.Tensor, sparse: bytes | None) -> tuple[int, bytes]:
    """(mode, payload) given a float record's SPARSE payload (None: nothing changed, or not a float)."""
    raw_size = old.numel() * old.element_size()
    if old.dtype in _FLOATS:
        if sparse is None:
            return SAME, b""
        best = (SPARSE, sparse)
        if len(sparse) <= raw_size // 4:
            return best
        old_np, new_np = np_bits(old), np_bits(new)
    else:
        old_np, new_np = np_bits(old), np_bits(new)
        if np.array_equal(old_np, new_np):
            return SAME, b""
        best = (RAW, new_np.tobytes())
    xor = bytearray()
    _put_planes(xor, _byte_planes(old_np ^ new_np), 3)
    for cand in ((XOR, bytes(xor)), (RAW, new_np.tobytes())):
        if len(cand[1]) < len(best[1]):
            best = cand
    return best


Decoded = np.ndarray | torch.Tensor


def _decode_delta_payload(old: torch.Tensor, mode: int, r: Reader) -> tuple[Decoded | None, Decoded | None]:
    """(positions, new bits) for SPARSE; (None, all new bits) for dense modes; (None, None) for SAME. SPARSE
    records on an accelerator decode there (tensors on that device); everything else on the host (numpy)."""
    n = old.numel()
    size = old.element_size()
    if mode == SAME:
        return None, None
    if mode == SPARSE:
        fmt = _FLOATS.get(old.dtype)
        if fmt is None:
            raise ChunkCorrupt(f"sparse mode for non-float dtype {old.dtype}")
        if device.wanted(old):
            (found,), (r.pos,) = device.decode_records([old], [device.Payload(np.frombuffer(r.buf, np.uint8),
                                                                              r.pos, r.end)], fmt)
            return found
        return decode_sparse(np_bits(old), fmt, r)
    if mode == XOR:
        planes = _read_planes(r, size, n)
        return None, np_bits(old) ^ _join_byte_planes(planes, n)
    if mode == RAW:
        return None, np.frombuffer(bytes(r.take(n * size)), dtype=NP_UINT[size])
    raise ChunkCorrupt(f"mode {mode} is not a delta mode")


def _encode_keyframe_payload(t: torch.Tensor) -> tuple[int, bytes]:
    bits = np_bits(t)
    raw = bits.tobytes()
    if len(raw) < 64:
        return RAW, raw
    out = bytearray()
    planes = _float_planes(bits, t.dtype)
    _put_planes(out, planes, None if t.dtype in _FLOATS else 3)
    return (PLANES, bytes(out)) if len(out) < len(raw) else (RAW, raw)


def _decode_keyframe_payload(dtype: torch.dtype, n: int, mode: int, r: Reader) -> np.ndarray:
    size = _itemsize(dtype)
    if mode == RAW:
        return np.frombuffer(bytes(r.take(n * size)), dtype=NP_UINT[size])
    if mode == PLANES:
        return _join_float_planes(_read_planes(r, _plane_count(dtype), n), dtype, n)
    raise ChunkCorrupt(f"mode {mode} is not a keyframe mode")


def _make_update(
    numel: int, dtype: torch.dtype, pos: Decoded | None, bits: Decoded | None, offset: int = 0
) -> SparseUpdate:
    """Update from decoded positions/bits (``pos`` None: ``bits`` replaces elements from ``offset`` on).

    Positions are shifted by ``offset`` in place and both arrays are wrapped without a copy where they are
    the decoder's own (writable) arrays."""
    if bits is None or pos is None:
        no_pos = torch.zeros(0, dtype=torch.int64)
        no_vals = torch.empty(0, dtype=dtype)
        dense = None if bits is None else _wrap_bits(bits, dtype)
        return SparseUpdate(numel, dtype, no_pos, no_vals, dense, offset if dense is not None else 0)
    if offset:
        pos += offset
    positions = pos if isinstance(pos, torch.Tensor) else torch.from_numpy(pos)
    return SparseUpdate(numel, dtype, positions, _wrap_bits(bits, dtype))


def _wrap_bits(bits: Decoded, dtype: torch.dtype) -> torch.Tensor:
    """``bits`` as a tensor of ``dtype``: a view of a device tensor or of a writable, contiguous array, else a
    copy."""
    if isinstance(bits, torch.Tensor):
        return bits.view(dtype)
    if bits.flags.writeable and bits.flags.c_contiguous:
        return torch.from_numpy(bits.view(_SIGNED[bits.dtype.itemsize])).view(dtype)
    return tensor_from_bits(bits, dtype)


_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
