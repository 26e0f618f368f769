"""Lossless, bit-exact codec for weight versions: sparse deltas, keyframes and self-contained chunks.

A version is the inference-dtype snapshot S_v (bf16, fp16 or fp32). Between RL steps only a few percent
of its elements change, mostly by ±1 unit in the last place, and the codec spends its bits on what the
receiver cannot predict from what it already holds, the old weights S_{v-1}: positions per class of the
old value's exponent, values as differences of sign-magnitude-corrected integers (:mod:`.sparse`).

Peers measured in ``rlbus bench codec``: dense XOR + zstd (SkyRL, slime), int32 indices + values + zstd
(TRL, slime), varint gap-coded positions + raw values + zstd (PULSE). Keyframes split each float into
byte planes so the skewed exponent byte compresses and the near-uniform mantissa bytes are stored as
they are (the ZipNN observation, Hershcovitch et al. 2024).

One module per concept: :mod:`.format` (the byte layout table, constants, dtype codes, blob headers),
:mod:`.tensor` (one tensor ↔ one blob), :mod:`.state` (a whole state ↔ chunks), :mod:`.chunks` (the
chunk container), :mod:`.modes` (the per-record mode choice), :mod:`.sparse` and :mod:`.classes` (the
SPARSE coder and its exponent classes), :mod:`.planes` (byte planes), ``_bits`` and ``_kernels`` (bit
I/O and the compiled loops). Applying a staged update is :mod:`rlbus.weights.apply`; the whole-model
digest is :mod:`rlbus.weights.digest`.
"""

from __future__ import annotations

from rlbus.weights.apply import SparseUpdate
from rlbus.weights.codec.chunks import Chunk, TensorRange, chunk_hash, chunk_ranges
from rlbus.weights.codec.state import (
    CHUNK_BYTES,
    StagedUpdate,
    apply_chunk_,
    decode_chunk,
    encode_state_delta,
    encode_state_keyframe,
    load_keyframe,
)
from rlbus.weights.codec.tensor import (
    apply_delta,
    apply_delta_,
    decode_delta,
    decode_keyframe,
    encode_delta,
    encode_keyframe,
)

# isort: split
# Internals the white-box tests (tests/unit/weights/test_codec.py) reach as ``codec.<name>``; not API.
from rlbus.weights.bitview import int_flat as _int_flat  # noqa: F401
from rlbus.weights.codec._bits import Reader  # noqa: F401
from rlbus.weights.codec.classes import _class_lut  # noqa: F401
from rlbus.weights.codec.format import _FLOATS, PLANES, SAME, SPARSE, _Float, _read_header  # noqa: F401

__all__ = [
    "CHUNK_BYTES",
    "Chunk",
    "SparseUpdate",
    "StagedUpdate",
    "TensorRange",
    "apply_chunk_",
    "apply_delta",
    "apply_delta_",
    "chunk_hash",
    "chunk_ranges",
    "decode_chunk",
    "decode_delta",
    "decode_keyframe",
    "encode_delta",
    "encode_keyframe",
    "encode_state_delta",
    "encode_state_keyframe",
    "load_keyframe",
]
