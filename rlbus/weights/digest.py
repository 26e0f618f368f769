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
        digest_update(h, name, state[name])
    return h.hexdigest()


def digest_update(h: xxhash.xxh3_128, name: str, t: torch.Tensor) -> None:
    """Feed one tensor into a running whole-model digest. The hash is one stream in sorted-name order and
    its state cannot leave the process, so whoever computes the digest sees every tensor, one at a time,
    in that order (`rlbus.training.shard_publish` streams the other ranks' tensors to rank 0 for this)."""
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
