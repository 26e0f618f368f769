"""Dead letters: bad input never crashes a worker and is never silently dropped.

:class:`DeadLetters` writes the original bytes and key of a failed record to ``<topic>.dlq`` with
headers naming the source (topic, partition, offset), the error class and text, and the attempt count.
:func:`handle_batch` is the worker loop body: decode, run the handler with retries for retriable
errors, dead-letter the rest, and mark each record only after its effect or its dead letter was
acknowledged — so committing afterwards can never lose a message. :func:`redrive` sends dead letters
back to their source topic once the cause is fixed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rlbus.bus.base import Bus, Consumer
from rlbus.bus.topic import dlq_name
from rlbus.bus.types import Record, RecordMetadata
from rlbus.errors import BlobStoreError, BusUnavailable, RlbusError, StateError
from rlbus.metrics import DEAD_LETTERS, count_in

log = logging.getLogger("rlbus.dlq")

H_TOPIC = "rlbus.dlq.topic"
H_PARTITION = "rlbus.dlq.partition"
H_OFFSET = "rlbus.dlq.offset"
H_ERROR_CLASS = "rlbus.dlq.error_class"
H_ERROR = "rlbus.dlq.error"
H_ATTEMPTS = "rlbus.dlq.attempts"
H_TIME = "rlbus.dlq.time_ms"
_DLQ_HEADERS = {H_TOPIC, H_PARTITION, H_OFFSET, H_ERROR_CLASS, H_ERROR, H_ATTEMPTS, H_TIME}


@dataclass(frozen=True)
class DeadLetter:
    """A dead-lettered record as read back from a ``.dlq`` topic."""

    dlq_offset: int
    source_topic: str
    source_partition: int
    source_offset: int
    error_class: str
    error: str
    attempts: int
    key: bytes | None
    value: bytes
    original_headers: tuple[tuple[str, bytes], ...]

    @classmethod
    def from_record(cls, record: Record[Any]) -> DeadLetter:
        def text(name: str) -> str:
            return (record.header(name) or b"").decode(errors="replace")

        return cls(
            dlq_offset=record.offset,
            source_topic=text(H_TOPIC),
            source_partition=int(text(H_PARTITION) or -1),
            source_offset=int(text(H_OFFSET) or -1),
            error_class=text(H_ERROR_CLASS),
            error=text(H_ERROR),
            attempts=int(text(H_ATTEMPTS) or 0),
            key=record.key,
            value=record.raw,
            original_headers=tuple((k, v) for k, v in record.headers if k not in _DLQ_HEADERS),
        )


OnDead = Callable[[Record[Any], BaseException], Awaitable[None]]


class DeadLetters:
    """Writes failed records to their topic's dead-letter topic and waits for the acknowledgement."""

    def __init__(self, bus: Bus, *, on_dead: OnDead | None = None) -> None:
        self._bus = bus
        self._on_dead = on_dead
        self.counts: dict[str, int] = {}

    async def send(self, record: Record[Any], error: BaseException, attempts: int = 1) -> RecordMetadata:
        reason = f"{type(error).__name__}: {error}"
        headers = (
            *record.headers,
            (H_TOPIC, record.topic.encode()),
            (H_PARTITION, str(record.partition).encode()),
            (H_OFFSET, str(record.offset).encode()),
            (H_ERROR_CLASS, type(error).__name__.encode()),
            (H_ERROR, str(error)[:4000].encode()),
            (H_ATTEMPTS, str(attempts).encode()),
            (H_TIME, str(int(time.time() * 1000)).encode()),
        )
        meta = await self._bus.send_raw(dlq_name(record.topic), record.raw, key=record.key, headers=headers)
        self.counts[type(error).__name__] = self.counts.get(type(error).__name__, 0) + 1
        DEAD_LETTERS.labels(record.topic, type(error).__name__).inc()
        if self._on_dead is not None:
            await self._on_dead(record, error)
        log.warning(
            "dead-lettered %s key=%r after %d attempt(s): %s",
            record.where,
            record.key,
            attempts,
            reason,
            extra={"topic": record.topic, "partition": record.partition, "offset": record.offset},
        )
        return meta


Handler = Callable[[Record[Any]], Awaitable[None]]


async def handle_batch(
    consumer: Consumer,
    records: list[Record[Any]],
    handler: Handler,
    dead_letters: DeadLetters,
    *,
    max_attempts: int = 3,
    backoff_s: float = 0.2,
    concurrency: int = 1,
) -> None:
    """Process records: retriable errors are retried with backoff up to ``max_attempts``, anything else
    goes to the DLQ — except an outage of the infrastructure (state store, broker, blob store: see
    :func:`is_outage`), which says nothing about the record: it is raised after the last attempt, so
    the worker stops without committing and the record is redelivered once the dependency is back.
    With ``concurrency`` > 1 up to that many records run at once (sandboxed verifiers,
    judge calls); the function returns only when all are done. Each record is marked only after its
    effect or dead letter is acknowledged; the caller commits after the batch."""
    slots = asyncio.Semaphore(concurrency)
    count_in(records)

    async def one(record: Record[Any]) -> None:
        async with slots:
            await handle_record(record, handler, dead_letters, max_attempts=max_attempts, backoff_s=backoff_s)

    if concurrency <= 1:
        for record in records:
            await one(record)
            consumer.mark(record)
        return
    await asyncio.gather(*(one(r) for r in records))
    for record in records:
        consumer.mark(record)


async def handle_record(
    record: Record[Any],
    handler: Handler,
    dead_letters: DeadLetters,
    *,
    max_attempts: int = 3,
    backoff_s: float = 0.2,
) -> None:
    """One record's fate, as :func:`handle_batch` describes it: the handler's effect (retriable errors
    retried) or its dead letter, acknowledged when this returns; an outage is raised. Marking is left to
    the caller — :func:`handle_batch` marks after its batch, a windowed worker through
    :class:`rlbus.bus.inflight.InFlight`."""
    attempt = 0
    while True:
        attempt += 1
        try:
            await handler(record)
            return
        except Exception as exc:  # every failure must end in the DLQ, not a crash
            retriable = isinstance(exc, RlbusError) and exc.retriable
            if retriable and attempt < max_attempts:
                await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
                continue
            if is_outage(exc):
                raise
            await dead_letters.send(record, exc, attempts=attempt)
            return


def is_outage(error: BaseException) -> bool:
    """An error that means a dependency is down, not that the input is bad: dead-lettering the record
    would drop good work (the chaos suite's Redis restart showed a reward dead-lettered that way)."""
    return isinstance(error, StateError | BusUnavailable | BlobStoreError)


async def read_dead_letters(bus: Bus, topic: str, *, limit: int | None = None) -> list[DeadLetter]:
    """Every dead letter of ``topic`` present now (reads up to an end-offset snapshot)."""
    name = topic if topic.endswith(".dlq") else dlq_name(topic)
    ends = await bus.end_offsets(name)
    out: list[DeadLetter] = []
    if not any(ends.values()):
        return out
    async with bus.consumer([name], group=None, from_beginning=True) as consumer:
        done = {p for p, end in ends.items() if end == 0}
        while len(done) < len(ends) and (limit is None or len(out) < limit):
            for record in await consumer.getmany(timeout_s=1.0):
                if record.offset < ends[record.partition]:
                    out.append(DeadLetter.from_record(record))
                if record.offset + 1 >= ends[record.partition]:
                    done.add(record.partition)
    return out[:limit] if limit is not None else out


async def redrive(bus: Bus, topic: str, *, offsets: set[int] | None = None) -> int:
    """Send dead letters (all, or those at ``offsets`` in the DLQ) back to their source topic, with
    their original key and headers plus ``rlbus.redriven-from``. Returns how many were sent."""
    letters = await read_dead_letters(bus, topic)
    sent = 0
    for letter in letters:
        if offsets is not None and letter.dlq_offset not in offsets:
            continue
        headers = (
            *letter.original_headers,
            ("rlbus.redriven-from", f"{dlq_name(letter.source_topic)}@{letter.dlq_offset}".encode()),
        )
        await bus.send_raw(letter.source_topic, letter.value, key=letter.key, headers=headers)
        sent += 1
    return sent
