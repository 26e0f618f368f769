"""A worker's blob store with a way out: its region's relay first, the origin when the relay is gone.

A region's workers read weight chunks through the region's pull-through relay (`rlbus.blobs.relay`), so
each chunk crosses the WAN once per region. A relay is one process, though, and a worker that can only
reach it stops syncing when it dies — the region's whole fleet then generates on ever staler weights
until someone restarts it. :class:`FailoverStore` reads from the primary (the relay) and, when a read fails
for a transport reason (the relay's own client has already retried with backoff), from the fallback (the
origin, across the WAN), counting each such read. It keeps trying the primary first for every later read,
after ``retry_primary_s``: a relay that comes back is used again, without a restart.

Not-found and refusals are answers, not failures: they are raised as they are, never retried on the
origin (a relay that says 404 is telling the truth about the origin too). Writes — a worker's claim-checked
payloads — go straight to the origin: a relay is read-only, and the reader of a claim check (the trainer, the
reward worker) looks for it at the origin.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rlbus.blobs.base import BlobStore
from rlbus.errors import BlobAuthError, BlobNotFound, BlobStoreError
from rlbus.metrics import BLOB_FAILOVERS

log = logging.getLogger("rlbus.blobs")
T = TypeVar("T")


class FailoverStore(BlobStore):
    """Reads from ``primary`` (a relay), or from ``fallback`` (its origin) while ``primary`` fails; writes to
    ``fallback``."""

    def __init__(self, primary: BlobStore, fallback: BlobStore, *, retry_primary_s: float = 10.0) -> None:
        self.primary = primary
        self.fallback = fallback
        self.retry_primary_s = retry_primary_s
        #: Reads served by the fallback because the primary failed (the heartbeat's ``blob_failovers``).
        self.failovers = 0
        self._primary_down_until = 0.0

    def __repr__(self) -> str:
        return f"FailoverStore({self.primary!r} -> {self.fallback!r})"

    async def close(self) -> None:
        await self.primary.close()
        await self.fallback.close()

    async def _read(self, what: str, call: Callable[[BlobStore], Awaitable[T]]) -> T:
        if time.monotonic() >= self._primary_down_until:
            try:
                return await call(self.primary)
            except (BlobNotFound, BlobAuthError):
                raise
            except (BlobStoreError, OSError, TimeoutError) as exc:
                self._primary_down_until = time.monotonic() + self.retry_primary_s
                log.warning("blob store %r failed on %s; reading from %r for %.0f s: %s",
                            self.primary, what, self.fallback, self.retry_primary_s, exc)
        self.failovers += 1
        BLOB_FAILOVERS.inc()
        return await call(self.fallback)

    async def get(self, key: str) -> bytes:
        return await self._read(key, lambda s: s.get(key))

    async def get_range(self, key: str, start: int, stop: int) -> bytes:
        return await self._read(key, lambda s: s.get_range(key, start, stop))

    async def size(self, key: str) -> int:
        return await self._read(key, lambda s: s.size(key))

    async def list(self, prefix: str = "") -> list[str]:
        return await self._read(prefix, lambda s: s.list(prefix))

    async def put(self, key: str, data: bytes) -> None:
        await self.fallback.put(key, data)

    async def delete(self, key: str) -> None:
        await self.fallback.delete(key)
