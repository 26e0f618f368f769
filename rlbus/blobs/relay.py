"""A regional relay's download from its origin: resumable, by range, and counted.

A relay (:class:`rlbus.blobs.http.BlobServer` with ``upstream``) sits in a region at the far end of a WAN
link, and its origin goes away: a trainer host restarts, a link is cut for a minute. A chunk is tens of
megabytes on a real model, so a download that starts over after every drop may never finish over a slow,
flaky link. :func:`fetch_resumable` downloads a blob as ranges, keeps the ranges it already has across
failures, and retries only the missing ones — with backoff, until ``patience_s`` has passed without a single
range arriving — then hands back the whole blob, which the relay writes to its cache in one ``put``. A
partial blob is never written, so a worker can never be served (let alone apply) half a chunk; and every
worker verifies each chunk's hash from the manifest anyway (`rlbus.weights.sync`).

:class:`UpstreamCount` is what crossed the relay's WAN link: blobs and bytes fetched, ranges retried.
``rlbus bench regions`` compares it with what the region's workers pulled.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

from rlbus.blobs.base import BlobStore
from rlbus.errors import BlobAuthError, BlobNotFound, BlobStoreError

log = logging.getLogger("rlbus.blobs")

#: Range size of a relay's upstream reads: small enough that a cut costs little, large enough for few requests.
RANGE_BYTES = 1024 * 1024
#: How long a relay keeps retrying an origin that answers nothing before it gives up on a blob.
PATIENCE_S = 120.0


@dataclass
class UpstreamCount:
    """What a relay fetched from its origin (the bytes that crossed the region's WAN link)."""

    blobs: int = 0
    bytes: int = 0
    #: Ranges that failed and were fetched again (a cut or a restart of the origin mid-download).
    retried_ranges: int = 0
    #: Downloads abandoned after ``patience_s`` without progress (the request that waited got a 5xx).
    abandoned: int = 0


async def fetch_resumable(
    upstream: BlobStore,
    key: str,
    count: UpstreamCount,
    *,
    range_bytes: int = RANGE_BYTES,
    patience_s: float = PATIENCE_S,
    backoff_s: float = 0.2,
    max_backoff_s: float = 5.0,
) -> bytes:
    """The whole blob ``key`` from ``upstream``, resuming range by range across failures.

    Raises BlobNotFound / BlobAuthError at once (retrying cannot help) and BlobStoreError once
    ``patience_s`` passes with no range arriving."""
    progress_at = time.monotonic()
    delay = backoff_s
    size: int | None = None
    parts: dict[int, bytes] = {}
    while True:
        try:
            if size is None:
                size = await upstream.size(key)
            missing = [s for s in range(0, size, range_bytes) if s not in parts]
            results = await asyncio.gather(
                *(upstream.get_range(key, s, min(size, s + range_bytes)) for s in missing), return_exceptions=True
            )
            failed: BaseException | None = None
            for start, result in zip(missing, results, strict=True):
                if isinstance(result, BlobNotFound | BlobAuthError):
                    raise result
                if isinstance(result, BaseException):
                    failed = result
                    count.retried_ranges += 1
                    continue
                parts[start] = result
                count.bytes += len(result)
                progress_at = time.monotonic()
                delay = backoff_s
            if failed is not None:
                raise failed
            break
        except (BlobNotFound, BlobAuthError):
            raise
        except (BlobStoreError, OSError, TimeoutError) as exc:
            if time.monotonic() - progress_at > patience_s:
                count.abandoned += 1
                raise BlobStoreError(
                    f"relay: upstream {upstream!r} gave nothing of {key!r} for {patience_s:.0f} s "
                    f"({len(parts)} ranges held): {exc}"
                ) from exc
            log.warning("relay: upstream failed on %s (%d ranges held), retrying in %.1f s: %s",
                        key, len(parts), delay, exc)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(max_backoff_s, delay * 2)
    data = b"".join(parts[s] for s in sorted(parts))
    if len(data) != size:
        raise BlobStoreError(f"relay: {key!r} is {size} bytes upstream but {len(data)} arrived")
    count.blobs += 1
    return data
