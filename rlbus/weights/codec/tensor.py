"""One tensor as one blob: ``encode_delta`` / ``decode_delta`` and ``encode_keyframe`` / ``decode_keyframe``.

The codec's pure function pairs: a header naming dtype and shape, then one mode and its
payload. A delta decodes only against the exact old tensor; decoding stages the change without touching
it, and the ``apply_*`` helpers swap it in.
"""

from __future__ import annotations

import numpy as np
import torch

from rlbus.errors import ChunkCorrupt, WeightSyncError
from rlbus.weights.apply import SparseUpdate, apply_update_
from rlbus.weights.bitview import tensor_from_bits
from rlbus.weights.codec._bits import Reader
from rlbus.weights.codec.format import KIND_DELTA, KIND_KEYFRAME, _check_dtype, _put_header, _read_header
from rlbus.weights.codec.modes import (
    _decode_delta_payload,
    _decode_keyframe_payload,
    _encode_delta_payload,
    _encode_keyframe_payload,
    _make_update,
)


def encode_delta(old: torch.Tensor, new: torch.Tensor) -> bytes:
    """Encode ``new`` relative to ``old`` (same dtype and shape); decoding needs ``old`` bit for bit."""
    _check_pair(old, new)
    out = bytearray()
    _put_header(out, KIND_DELTA, new)
    mode, payload = _encode_delta_payload(old, new)
    out.append(mode)
    out += payload
    return bytes(out)


def decode_delta(old: torch.Tensor, blob: bytes) -> SparseUpdate:
    """Stage a delta: positions and new values (or a dense replacement), without touching ``old``."""
    try:
        r = Reader(blob)
        dtype, shape = _read_header(r, KIND_DELTA)
        if dtype != old.dtype or shape != tuple(old.shape):
            raise WeightSyncError(f"delta is for {dtype}{list(shape)}, tensor is {old.dtype}{list(old.shape)}")
        pos, bits = _decode_delta_payload(old, r.u8(), r)
        r.expect_end()
    except (ValueError, IndexError, OverflowError) as e:
        raise ChunkCorrupt(f"delta does not decode: {e}") from None
    return _make_update(old.numel(), old.dtype, pos, bits)


def apply_delta_(t: torch.Tensor, blob: bytes) -> None:
    """Decode ``blob`` against ``t`` and apply it in place."""
    apply_update_(t, decode_delta(t, blob))


def apply_delta(old: torch.Tensor, blob: bytes) -> torch.Tensor:
    """The new tensor (``old`` is left unchanged)."""
    update = decode_delta(old, blob)
    new = old.detach().clone(memory_format=torch.contiguous_format)
    apply_update_(new, update)
    return new


def encode_keyframe(t: torch.Tensor) -> bytes:
    """A full snapshot of one tensor, byte planes compressed."""
    _check_dtype(t.dtype)
    out = bytearray()
    _put_header(out, KIND_KEYFRAME, t)
    mode, payload = _encode_keyframe_payload(t)
    out.append(mode)
    out += payload
    return bytes(out)


def decode_keyframe(blob: bytes) -> torch.Tensor:
    """The tensor a keyframe blob holds (on the CPU)."""
    try:
        r = Reader(blob)
        dtype, shape = _read_header(r, KIND_KEYFRAME)
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        bits = _decode_keyframe_payload(dtype, n, r.u8(), r)
        r.expect_end()
    except (ValueError, IndexError, OverflowError) as e:
        raise ChunkCorrupt(f"keyframe does not decode: {e}") from None
    return tensor_from_bits(bits, dtype).reshape(shape)


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    _check_dtype(old.dtype)
    if old.dtype != new.dtype or old.shape != new.shape or old.device != new.device:
        raise ValueError(
            f"old {old.dtype}{list(old.shape)}@{old.device} and new {new.dtype}{list(new.shape)}@{new.device} differ"
        )
