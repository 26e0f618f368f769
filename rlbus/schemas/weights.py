"""``WeightVersion`` — the delta manifest (claim check) of one policy version.

Produced by ``weights/publish.py`` (trainer) on ``rl.weights.v1`` (key ``model_id``, one partition per
model so versions stay ordered) and on the compacted ``rl.weights.latest.v1``; consumed by
``weights/sync.py`` in every inference worker. The chunks themselves live in the blob store.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from rlbus.schemas.base import Message


class TensorSpan(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Elements [start, stop) of the flattened tensor ``name`` that a chunk covers."""

    name: str
    start: int
    stop: int


class ChunkRef(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """One independently decodable chunk (≤ 4 MiB) in the blob store."""

    key: str
    size: int
    #: xxh3-128 of the chunk bytes, hex; a mismatching chunk is never applied.
    hash: str
    tensors: list[TensorSpan]


class TensorMeta(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    name: str
    dtype: str
    shape: list[int]
    #: xxh3-128 of the tensor's bytes after applying this version, hex.
    digest: str = ""


class WeightVersion(Message, kw_only=True):
    SCHEMA_VERSION: ClassVar[int] = 1

    schema_version: int = 1
    model_id: str
    version: int
    #: For a delta: the version it applies to. None for a keyframe.
    base_version: int | None = None
    kind: Literal["delta", "keyframe"]
    #: Newest keyframe version at or before this one (where a lost worker restarts).
    keyframe_version: int
    #: Inference dtype of the snapshot (``"bfloat16"``, ``"float16"``, ``"float32"``).
    dtype: str
    chunks: list[ChunkRef]
    tensors: list[TensorMeta]
    #: xxh3-128 over all tensors in canonical (sorted name) order, hex: proves bit-exactness.
    model_digest: str
    #: Size of the full snapshot in the inference dtype, and of all chunks of this version.
    full_bytes: int
    encoded_bytes: int
    #: Where the chunks live (blob store URL or directory), for workers outside the trainer's region.
    blob_store: str = ""
    trainer_step: int = 0
    created_at: float = 0.0
