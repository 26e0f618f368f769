"""Small structs shared by several message kinds."""

from __future__ import annotations

import msgspec


class BlobRef(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """A claim check: a payload too large for Kafka (> ~512 KB) stored in the blob store."""

    key: str
    size: int
    #: xxh3-128 of the stored bytes, hex.
    hash: str
    #: How the stored bytes are encoded (``"msgpack+zstd"``, ``"rlbus-delta"`` …).
    codec: str
