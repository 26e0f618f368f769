"""Claim checks: a payload too large for Kafka goes to the blob store and a small reference rides the log.

Kafka refuses records over its ``max.message.bytes`` (1 MiB by default) and slows down well before that.
Rollouts of MoE policies carry their routing, int16 ``[layers, T, top_k]`` — 2·L·k bytes a token against
about 17 for everything else (ids, mask, log-probs, versions, transcript text) — so an encoded rollout
passes 512 KiB once layers × tokens × top_k nears 256 Ki: measured, at T = 667 tokens for 48 layers and
top-8 (Qwen3-30B-A3B's shape), 345 for 94 layers and top-8, 3 610 for 32 layers and top-2; a dense
model's rollout only at about 30 000 tokens. :class:`ClaimCheckBus` wraps any bus — Kafka or in-memory —
and implements the same contract, so workers, DLQ, replay and tail work unchanged on top of it:

* **Send.** A value longer than ``threshold_bytes`` (512 KiB by default) is zstd-compressed and stored
  under ``claims/<topic>/<UTC hour YYYYMMDDTHH>/<xxh3-128 of the stored bytes>``; the record on the
  topic keeps its key (so its partition) and headers, gets an *empty* value and one more header,
  ``rlbus.claim``, holding the reference as JSON — a :class:`~rlbus.schemas.BlobRef`::

      rlbus.claim = {"key": "claims/rl.rollouts.v1/20260301T14/9f…", "size": 301934,
                     "hash": "9f…(32 hex)", "codec": "zstd"}

  The blob is written before the reference, so no reader sees a reference to a blob not yet there.
  Values at or under the threshold pass through untouched: same bytes, same headers, as without it.
* **Consume.** Its consumers fetch the claims of a batch (concurrently), check size and xxh3-128, and
  decompress, before handing the records out; ``record.value`` is then the full typed message, as if
  it had ridden the log. ``record.raw`` stays what is on the log (the empty value), so a dead letter,
  a redrive or ``replay --into`` copies the small reference with its header, never the payload.
* **Failure.** A claim that cannot be resolved — the blob missing, a size or hash mismatch, bytes that
  do not decompress, a reference that is not a ``claims/`` key, a store still failing after
  ``attempts`` tries — still comes out as a record, whose ``value`` raises a
  :class:`~rlbus.errors.ClaimError` naming the key; :func:`rlbus.bus.dlq.handle_batch` dead-letters it
  with that reason and the worker goes on. A store outage therefore dead-letters records rather than
  stalling their partitions; ``rlbus dlq redrive`` sends the references back once the store is up.
  :func:`payload` gives the resolved bytes of any record (for consumers of untyped topics).

Every process that produces or consumes a topic that may carry claims wraps its bus with the same
store (rollout workers produce them; reward workers and the trainer read them). Without the wrapper a
claim record is still recognisable: ``rlbus tail`` and ``replay`` print its headers, reference
included, and with ``--blobs DIR|URL`` resolve it.

**Cleaning up.** Claims are immutable and never referenced again once the records pointing at them
have left the log, so they are collected by age: :func:`collect_claims` deletes every hour bucket
entirely older than ``older_than_s``. Keep that at least the topic's ``retention.ms`` (7 days for
``rl.rollouts.v1``), or replaying the log's oldest records meets collected claims (they then
dead-letter as ``ClaimMissing``, they do not crash). A producer that dies between the blob and the
reference leaves an unreferenced blob; the same sweep removes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import msgspec
import xxhash
import zstandard

from rlbus.blobs.base import BlobStore, check_key
from rlbus.bus.base import Bus, Consumer, TopicLike
from rlbus.bus.forward import ForwardingBus, ForwardingConsumer
from rlbus.bus.types import Headers, Record, RecordMetadata
from rlbus.errors import (
    BlobNotFound,
    BusError,
    ClaimCorrupt,
    ClaimError,
    ClaimMissing,
    ClaimUnavailable,
    RlbusError,
)
from rlbus.schemas import BlobRef

log = logging.getLogger("rlbus.claimcheck")

#: Header that marks a claim record; its value is the BlobRef as JSON.
H_CLAIM = "rlbus.claim"
PREFIX = "claims/"
DEFAULT_THRESHOLD_BYTES = 512 * 1024
#: A stored claim never inflates to more than this (guards against a forged frame header).
MAX_PAYLOAD_BYTES = 1 << 30
_BUCKET = "%Y%m%dT%H"
_HOUR_S = 3600.0


def claim_key(topic: str, stored: bytes, now: float) -> tuple[str, str]:
    """(key, xxh3-128 hex) of a claim written at ``now`` (seconds since the epoch)."""
    digest = xxhash.xxh3_128_hexdigest(stored)
    bucket = datetime.fromtimestamp(now, UTC).strftime(_BUCKET)
    return check_key(f"{PREFIX}{topic}/{bucket}/{digest}"), digest


def pack(topic: str, value: bytes, *, now: float, level: int = 3) -> tuple[BlobRef, bytes]:
    """The reference and the bytes to store for ``value`` (CPU-heavy: call it off the event loop)."""
    stored = zstandard.ZstdCompressor(level=level).compress(value)
    key, digest = claim_key(topic, stored, now)
    return BlobRef(key=key, size=len(stored), hash=digest, codec="zstd"), stored


def unpack(ref: BlobRef, stored: bytes) -> bytes:
    """Verify ``stored`` against ``ref`` and return the original value; raises ClaimCorrupt."""
    if len(stored) != ref.size:
        raise ClaimCorrupt(f"claim {ref.key}: {len(stored)} bytes stored, reference says {ref.size}")
    digest = xxhash.xxh3_128_hexdigest(stored)
    if digest != ref.hash:
        raise ClaimCorrupt(f"claim {ref.key}: xxh3-128 {digest} does not match the reference's {ref.hash}")
    if ref.codec == "identity":
        return stored
    if ref.codec != "zstd":
        raise ClaimCorrupt(f"claim {ref.key}: unknown codec {ref.codec!r}")
    try:
        size = zstandard.frame_content_size(stored)
        if not 0 <= size <= MAX_PAYLOAD_BYTES:
            declared = "no size" if size < 0 else f"{size} bytes"
            raise ClaimCorrupt(f"claim {ref.key}: zstd frame declares {declared} (limit {MAX_PAYLOAD_BYTES})")
        return zstandard.ZstdDecompressor().decompress(stored)
    except zstandard.ZstdError as exc:
        raise ClaimCorrupt(f"claim {ref.key}: does not decompress ({exc})") from exc


def reference(record: Record[Any]) -> BlobRef | None:
    """The claim a record carries, None for an ordinary record; raises ClaimCorrupt for a bad header."""
    header = record.header(H_CLAIM)
    if header is None:
        return None
    try:
        ref = msgspec.json.decode(header, type=BlobRef)
        if not ref.key.startswith(PREFIX):
            raise ValueError(f"key {ref.key!r} is not under {PREFIX!r}")
        check_key(ref.key)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ClaimCorrupt(f"{record.where}: header {H_CLAIM} is not a claim reference ({exc})") from exc
    return ref


@dataclass(frozen=True)
class _Claimed:
    """Stands in for a claim record's decoder: decodes the fetched payload, or raises why it is missing.

    ``Record.value`` calls ``decoder.decode(record.raw)``; ``raw`` (the empty value on the log) is
    ignored, so the record keeps its on-log bytes while its value is the full message.
    """

    codec: Any
    data: bytes | None = None
    error: ClaimError | None = None

    def decode(self, _raw: bytes) -> Any:
        if self.error is not None:
            raise self.error
        if self.codec is None:
            raise ClaimError("no schema bound to this topic; read the resolved bytes with claimcheck.payload()")
        return self.codec.decode(self.data)


def payload(record: Record[Any]) -> bytes:
    """The record's value bytes: the fetched payload of a resolved claim, else ``record.raw``. Raises the
    claim's ClaimError when it could not be resolved."""
    if isinstance(record.decoder, _Claimed):
        if record.decoder.error is not None:
            raise record.decoder.error
        assert record.decoder.data is not None
        return record.decoder.data
    return record.raw


class ClaimCheckBus(ForwardingBus):
    """A bus that moves values over ``threshold_bytes`` into ``store`` (see the module docstring).

    It owns ``inner``'s lifecycle when used as ``async with``; wrapping a bus that is already started
    and never entering the wrapper works too (it keeps no connection of its own). ``clock`` dates the
    claims (the hour bucket :func:`collect_claims` goes by); ``attempts`` and ``backoff_s`` bound the
    retries of a failing store while resolving; ``concurrency`` bounds parallel fetches per batch.
    """

    def __init__(
        self,
        inner: Bus,
        store: BlobStore,
        *,
        threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
        level: int = 3,
        attempts: int = 3,
        backoff_s: float = 0.1,
        concurrency: int = 8,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if threshold_bytes < 1:
            raise ValueError("threshold_bytes must be ≥ 1")
        if attempts < 1:
            raise ValueError("attempts must be ≥ 1")
        super().__init__(inner)
        self.store = store
        self.threshold_bytes = threshold_bytes
        self._level = level
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._concurrency = concurrency
        self._clock = clock
        self.claims_written = 0

    # --- produce -----------------------------------------------------------------------------------
    async def send_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Headers = (),
        timestamp_ms: int | None = None,
        partition: int | None = None,
    ) -> RecordMetadata:
        if len(value) > self.threshold_bytes:
            if any(name == H_CLAIM for name, _ in headers):
                raise BusError(f"{topic}: a claim record must carry an empty value, not {len(value)} bytes")
            ref, stored = await asyncio.to_thread(pack, topic, value, now=self._clock(), level=self._level)
            await self.store.put(ref.key, stored)
            self.claims_written += 1
            value, headers = b"", (*headers, (H_CLAIM, msgspec.json.encode(ref)))
        return await self.inner.send_raw(
            topic, value, key=key, headers=headers, timestamp_ms=timestamp_ms, partition=partition
        )

    # --- consume -----------------------------------------------------------------------------------
    def consumer(
        self,
        topics: Sequence[TopicLike],
        *,
        group: str | None = None,
        from_beginning: bool = True,
        instance_id: str | None = None,
    ) -> ClaimCheckConsumer:
        inner = self.inner.consumer(topics, group=group, from_beginning=from_beginning, instance_id=instance_id)
        return ClaimCheckConsumer(inner, topics, resolve=self.resolve, concurrency=self._concurrency)

    async def fetch(self, ref: BlobRef) -> bytes:
        """The original value of a claim: fetched with retries, verified, decompressed."""
        attempt = 0
        while True:
            attempt += 1
            try:
                stored = await self.store.get(ref.key)
            except BlobNotFound as exc:
                raise ClaimMissing(f"claim {ref.key}: not in the blob store {self.store!r}") from exc
            except (RlbusError, OSError) as exc:
                retriable = not isinstance(exc, RlbusError) or exc.retriable
                if not retriable or attempt >= self._attempts:
                    raise ClaimUnavailable(
                        f"claim {ref.key}: blob store failed after {attempt} attempt(s): {type(exc).__name__}: {exc}"
                    ) from exc
                await asyncio.sleep(self._backoff_s * 2 ** (attempt - 1))
                continue
            return await asyncio.to_thread(unpack, ref, stored)

    async def resolve(self, record: Record[Any]) -> Record[Any]:
        """``record`` itself when it is no claim; else a copy whose value is the fetched payload or raises
        the ClaimError that kept it from being fetched."""
        try:
            ref = reference(record)
            if ref is None:
                return record
            data: bytes | None = await self.fetch(ref)
            error: ClaimError | None = None
        except ClaimError as exc:
            data, error = None, exc
            log.warning("%s: unresolved claim: %s", record.where, exc)
        return replace(record, decoder=_Claimed(record.decoder, data, error), _value=None, _decoded=False)


class ClaimCheckConsumer(ForwardingConsumer):
    """Wraps a consumer of the inner bus; resolves each batch's claims before handing it out. Marks,
    commits and seeks go to the inner consumer, so its rebalance listener commits what was marked."""

    def __init__(
        self,
        inner: Consumer,
        topics: Sequence[TopicLike],
        *,
        resolve: Callable[[Record[Any]], Awaitable[Record[Any]]],
        concurrency: int = 8,
    ) -> None:
        super().__init__(inner, topics, inner.group)
        self._resolve = resolve
        self._slots = asyncio.Semaphore(concurrency)

    async def getmany(self, *, timeout_s: float = 1.0, max_records: int = 500) -> list[Record[Any]]:
        records = await self.inner.getmany(timeout_s=timeout_s, max_records=max_records)
        if not any(r.header(H_CLAIM) is not None for r in records):
            return records

        async def one(record: Record[Any]) -> Record[Any]:
            async with self._slots:
                resolved: Record[Any] = await self._resolve(record)
                return resolved

        return list(await asyncio.gather(*(one(r) for r in records)))


async def collect_claims(
    store: BlobStore, *, older_than_s: float, now: float | None = None, topic: str | None = None
) -> list[str]:
    """Delete every claim whose hour bucket ended more than ``older_than_s`` ago (all topics, or one);
    returns the keys deleted. Keys under ``claims/`` that do not follow the layout are left alone."""
    cutoff = (time.time() if now is None else now) - older_than_s
    prefix = f"{PREFIX}{topic}/" if topic is not None else PREFIX
    deleted = []
    for key in await store.list(prefix):
        parts = key.split("/")
        if len(parts) != 4:
            continue
        try:
            start = datetime.strptime(parts[2], _BUCKET).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
        if start + _HOUR_S <= cutoff:
            await store.delete(key)
            deleted.append(key)
    if deleted:
        log.info("collected %d claim(s) older than %.0f s", len(deleted), older_than_s)
    return deleted
