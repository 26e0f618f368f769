"""The infrastructure every role stands on: the bus, the state store, the blob store, claim checks.

One factory each (the blob store's is `rlbus.blobs.open.open_store`: a directory, ``file://`` or an
``http(s)://`` `rlbus blobs serve` with its HMAC secret). None of them starts what it returns: the caller
enters it (``async with``).
"""

from __future__ import annotations

from rlbus.blobs.base import BlobStore
from rlbus.blobs.open import open_store
from rlbus.bus.base import Bus
from rlbus.bus.memory import MemoryBus
from rlbus.bus.namespace import namespaced
from rlbus.bus.topics import topic_specs
from rlbus.config import KafkaBusConfig, build_bus
from rlbus.state import StateStore, open_state_store

__all__ = ["open_bus", "open_state", "open_store", "with_claims"]


def open_bus(kafka: KafkaBusConfig | None = None, *, prefix: str = "", partitions: int = 4) -> Bus:
    """Kafka with ``kafka``'s settings under the topic ``prefix`` (a run's namespace), or — with None —
    the embedded in-memory bus holding every rlbus topic with ``partitions`` partitions."""
    if kafka is None:
        return MemoryBus(topic_specs(partitions=partitions))
    return namespaced(build_bus(kafka), prefix)


def open_state(url: str = "memory://", *, key_prefix: str = "rlbus:") -> StateStore:
    """``memory://`` or ``redis://host:port/db`` (see `rlbus.state.open_state_store`)."""
    return open_state_store(url, key_prefix=key_prefix)


def with_claims(bus: Bus, store: BlobStore, *, threshold_bytes: int = 512 * 1024) -> Bus:
    """``bus`` with claim checks: values over ``threshold_bytes`` ride as blob references."""
    from rlbus.bus.claimcheck import ClaimCheckBus

    return ClaimCheckBus(bus, store, threshold_bytes=threshold_bytes)
