"""Replay and tail: read any topic by time or offset window without joining a production group.

Replay snapshots the end offsets first and stops there, so it terminates even while producers keep
writing. A time window ``[from, to)`` is turned into offsets with offsets-for-times and also checked
record by record, so producer-supplied, out-of-order timestamps cannot leak records from outside it.
Records go to a JSONL file (decoded when the topic has a schema, base64 bytes otherwise) or are
re-produced into another topic with their key and headers plus ``rlbus.replayed-from``.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any

import msgspec

from rlbus.bus.base import Bus
from rlbus.bus.topics import TYPED_TOPICS
from rlbus.bus.types import Record, TopicPartition
from rlbus.errors import SchemaError


@dataclass(frozen=True)
class Bound:
    """One end of a window: an offset (applied to every partition) or a time in ms since the epoch."""

    offset: int | None = None
    time_ms: int | None = None

    @classmethod
    def parse(cls, text: str) -> Bound:
        """``"1234"`` is an offset; an ISO-8601 time (``2026-11-30T10:00:00Z``) is a time."""
        if text.lstrip("-").isdigit():
            return cls(offset=int(text))
        try:
            moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"{text!r} is neither an offset nor an ISO-8601 time") from None
        if moment.tzinfo is None:
            raise ValueError(f"{text!r} has no time zone; add Z or +00:00")
        return cls(time_ms=int(moment.timestamp() * 1000))


@dataclass
class Window:
    starts: dict[int, int]
    stops: dict[int, int]

    @property
    def total(self) -> int:
        return sum(max(0, self.stops[p] - self.starts[p]) for p in self.stops)


async def plan_window(bus: Bus, topic: str, start: Bound | None, stop: Bound | None) -> Window:
    """Turn bounds into per-partition [start, stop) offsets, capped at an end-offset snapshot."""
    ends = await bus.end_offsets(topic)
    begins = await bus.beginning_offsets(topic)
    if start is None:
        starts = dict(begins)
    elif start.time_ms is not None:
        starts = await bus.offsets_for_time(topic, start.time_ms)
    else:
        assert start.offset is not None
        starts = {p: min(max(start.offset, begins[p]), ends[p]) for p in ends}
    if stop is None:
        stops = dict(ends)
    elif stop.time_ms is not None:
        found = await bus.offsets_for_time(topic, stop.time_ms)
        stops = {p: min(found[p], ends[p]) for p in ends}
    else:
        assert stop.offset is not None
        stops = {p: min(stop.offset, ends[p]) for p in ends}
    return Window(starts, stops)


async def read_window(
    bus: Bus, topic: str, start: Bound | None = None, stop: Bound | None = None
) -> AsyncIterator[Record[Any]]:
    """Yield every record of ``topic`` in the window, partition by partition interleaved, then stop."""
    window = await plan_window(bus, topic, start, stop)
    typed = TYPED_TOPICS.get(topic)
    pending = {p for p in window.stops if window.starts[p] < window.stops[p]}
    if not pending:
        return
    low = start.time_ms if start is not None else None
    high = stop.time_ms if stop is not None else None
    async with bus.consumer([typed or topic], group=None) as consumer:
        for p in window.stops:
            await consumer.seek(TopicPartition(topic, p), window.starts[p])
        while pending:
            for record in await consumer.getmany(timeout_s=1.0, max_records=1000):
                if record.partition not in pending or record.offset >= window.stops[record.partition]:
                    continue
                if low is not None and record.timestamp_ms < low:
                    continue
                if high is not None and record.timestamp_ms >= high:
                    continue
                yield record
            for p in list(pending):
                if await consumer.position(TopicPartition(topic, p)) >= window.stops[p]:
                    pending.discard(p)


def record_to_json(record: Record[Any]) -> dict[str, Any]:
    """A JSON-ready dict: location, key, headers and the decoded value (or base64 bytes + error)."""
    out: dict[str, Any] = {
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
        "timestamp_ms": record.timestamp_ms,
        "key": record.key.decode(errors="replace") if record.key is not None else None,
        "headers": {k: v.decode(errors="replace") for k, v in record.headers},
    }
    if record.decoder is None:
        out["value_b64"] = base64.b64encode(record.raw).decode()
        return out
    try:
        out["value"] = msgspec.to_builtins(record.value)
    except SchemaError as exc:
        out["value_b64"] = base64.b64encode(record.raw).decode()
        out["error"] = str(exc)
    return out


async def replay_to_file(
    bus: Bus,
    topic: str,
    out: IO[bytes],
    start: Bound | None = None,
    stop: Bound | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write the window as JSONL; returns the number of records written."""
    count = 0
    encoder = msgspec.json.Encoder()
    async for record in read_window(bus, topic, start, stop):
        out.write(encoder.encode(record_to_json(record)) + b"\n")
        count += 1
        if progress is not None:
            progress(count)
    return count


async def replay_into(
    bus: Bus,
    topic: str,
    target: str,
    start: Bound | None = None,
    stop: Bound | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Re-produce the window into ``target`` with original keys and headers; returns the count."""
    if target == topic:
        raise ValueError("replaying a topic into itself would never terminate; choose another target")
    count = 0
    async for record in read_window(bus, topic, start, stop):
        headers = (*record.headers, ("rlbus.replayed-from", record.where.encode()))
        await bus.send_raw(target, record.raw, key=record.key, headers=headers)
        count += 1
        if progress is not None:
            progress(count)
    return count


async def tail(bus: Bus, topic: str, *, last: int = 0, limit: int | None = None) -> AsyncIterator[Record[Any]]:
    """Follow ``topic`` live, starting ``last`` records before the end of each partition."""
    typed = TYPED_TOPICS.get(topic)
    ends = await bus.end_offsets(topic)
    begins = await bus.beginning_offsets(topic)
    seen = 0
    async with bus.consumer([typed or topic], group=None, from_beginning=False) as consumer:
        for p, end in ends.items():
            await consumer.seek(TopicPartition(topic, p), max(begins[p], end - last))
        while limit is None or seen < limit:
            for record in await consumer.getmany(timeout_s=0.5):
                yield record
                seen += 1
                if limit is not None and seen >= limit:
                    return
