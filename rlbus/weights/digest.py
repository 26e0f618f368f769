"""The whole-model digest: xxh3-128 over a state's tensors, the proof that a worker holds S_v.

The trainer writes it into each manifest and a worker recomputes it after every swap; a mismatch makes
the worker refuse the version and rebuild from a keyframe. It hashes bit patterns, names, dtype codes
and shapes in sorted-name order, so it is the same on any device and for any dict order.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import xxhash

from rlbus.weights.bitview import np_bits
from rlbus.weights.codec._bits import put_bytes, put_varint
from rlbus.weights.codec.format import DTYPE_CODES, _check_dtype


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """xxh3-128 (hex) over tensors in sorted-name order: name, dtype, shape and raw bytes."""
    h = xxhash.xxh3_128()
    for name in sorted(state):
        t = state[name]
        _check_dtype(t.dtype)
        head = bytearray()
        put_bytes(head, name.encode())
        head.append(DTYPE_CODES[t.dtype])
        put_varint(head, t.dim())
        for s in t.shape:
            put_varint(head, s)
        body = np_bits(t).view(np.uint8) if t.numel() else np.zeros(0, dtype=np.uint8)
        put_varint(head, body.nbytes)
        h.update(bytes(head))
        h.update(body.data)
    return h.hexdigest()
