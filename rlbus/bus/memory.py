"""The embedded bus: an in-process log with Kafka's semantics, for the demo and the unit tests.

Topics have partitions; keys are placed with Kafka's murmur2 partitioner; every record gets an offset
and a timestamp; consumer groups split partitions between members (range assignment) and keep committed
offsets; a member joining or leaving rebalances the group, and — like rlbus's Kafka rebalance listener —
each member's marked-but-uncommitted positions are committed before its partitions move. Compacted
topics drop the previous record of a key when a new one is written (offsets stay as they were).
It is single-event-loop and not durable: a process restart loses everything.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlbus.bus.base import Bus, Consumer, TopicLike
from rlbus.bus.partitioner import partition_for
from rlbus.bus.types import Headers, Record, RecordMetadata, TopicInfo, TopicPartition, TopicSpec
from rlbus.errors import BusError, TopicNotFound


@dataclass
class _Entry:
    timestamp_ms: int
    key: bytes | None
    value: bytes | None  # None once compacted away
    headers: Headers


@dataclass
class _Log:
    spec: TopicSpec
    partitions: list[list[_Entry]]
    # Parallel per-partition lists of timestamps for offsets-for-time (max-so-far, so bisect works
    # even when producers supply out-of-order timestamps, as Kafka's time index does).
    time_index: list[list[int]]
    last_by_key: dict[tuple[int, bytes], int] = field(default_factory=dict)


@dataclass
class _Group:
    members: dict[str, MemoryConsumer] = field(default_factory=dict)
    committed: dict[TopicPartition, int] = field(default_factory=dict)
    generation: int = 0


class MemoryBus(Bus):
    kind = "memory"

    def __init__(self, specs: Sequence[TopicSpec] = ()) -> None:
        self._logs: dict[str, _Log] = {}
        self._groups: dict[str, _Group] = {}
        self._changed: asyncio.Condition | None = None
        self._ids = itertools.count()
        self._initial_specs = list(specs)

    async def start(self) -> None:
        self._changed = asyncio.Condition()
        if self._initial_specs:
            await self.create_topics(self._initial_specs)

    async def close(self) -> None:
        return None

    # --- admin -------------------------------------------------------------------------------------
    async def create_topics(self, specs: Sequence[TopicSpec]) -> list[str]:
        created = []
        for spec in specs:
            if spec.name in self._logs:
                continue
            self._logs[spec.name] = _Log(
                spec, [[] for _ in range(spec.partitions)], [[] for _ in range(spec.partitions)]
            )
            created.append(spec.name)
        return created

    async def list_topics(self) -> list[str]:
        return sorted(self._logs)

    def _log(self, topic: str) -> _Log:
        try:
            return self._logs[topic]
        except KeyError:
            raise TopicNotFound(f"topic {topic!r} does not exist (create it with `rlbus topics create`)") from None

    async def describe(self, topic: str) -> TopicInfo:
        log = self._log(topic)
        return TopicInfo(
            name=topic,
            partitions=len(log.partitions),
            replication=1,
            config=dict(log.spec.config),
            end_offsets=await self.end_offsets(topic),
        )

    async def partitions(self, topic: str) -> list[int]:
        return list(range(len(self._log(topic).partitions)))

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: len(entries) for p, entries in enumerate(self._log(topic).partitions)}

    async def beginning_offsets(self, topic: str) -> dict[int, int]:
        return {p: 0 for p in range(len(self._log(topic).partitions))}

    async def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        log = self._log(topic)
        return {p: bisect.bisect_left(index, timestamp_ms) for p, index in enumerate(log.time_index)}

    async def committed(self, group: str, topic: str) -> dict[int, int | None]:
        state = self._groups.get(group, _Group())
        return {p: state.committed.get(TopicPartition(topic, p)) for p in await self.partitions(topic)}

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
        log = self._log(topic)
        n = len(log.partitions)
        if partition is None:
            partition = partition_for(key, n) if key is not None else next(self._ids) % n
        elif not 0 <= partition < n:
            raise BusError(f"{topic}: partition {partition} out of range 0..{n - 1}")
        ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        entries = log.partitions[partition]
        offset = len(entries)
        entries.append(_Entry(ts, key, bytes(value), tuple(headers)))
        index = log.time_index[partition]
        index.append(max(ts, index[-1]) if index else ts)
        if log.spec.compacted and key is not None:
            previous = log.last_by_key.get((partition, key))
            if previous is not None:
                entries[previous].value = None
            log.last_by_key[(partition, key)] = offset
        await self._notify()
        return RecordMetadata(topic, partition, offset, ts)

    async def _notify(self) -> None:
        assert self._changed is not None, "MemoryBus used before start()"
        async with self._changed:
            self._changed.notify_all()

    async def _wait(self, timeout_s: float) -> None:
        assert self._changed is not None, "MemoryBus used before start()"
        async with self._changed:
            # asyncio.timeout, not wait_for, which can swallow a cancellation on 3.11 (rlbus.aio says more).
            try:
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait()
            except TimeoutError:
                pass

    # --- consume -----------------------------------------------------------------------------------
    def consumer(
        self,
        topics: Sequence[TopicLike],
        *,
        group: str | None = None,
        from_beginning: bool = True,
        instance_id: str | None = None,
    ) -> MemoryConsumer:
        return MemoryConsumer(self, topics, group=group, from_beginning=from_beginning, instance_id=instance_id)

    def _join(self, group: str, member: MemoryConsumer) -> None:
        state = self._groups.setdefault(group, _Group())
        state.members[member.member_id] = member
        self._rebalance(state)

    def _leave(self, group: str, member: MemoryConsumer) -> None:
        state = self._groups.get(group)
        if state is not None and state.members.pop(member.member_id, None) is not None:
            self._rebalance(state)

    def _rebalance(self, state: _Group) -> None:
        """Commit every member's processed positions, then range-assign partitions over members."""
        for member in state.members.values():
            member._revoke_commit()
        state.generation += 1
        members = sorted(state.members.values(), key=lambda m: m.member_id)
        topics = sorted({t for m in members for t in m.topics})
        for member in members:
            # Eager protocol, like Kafka's default: positions restart from committed offsets.
            member._assigned = set()
            member._positions.clear()
        for topic in topics:
            subscribers = [m for m in members if topic in m.topics]
            tps = [TopicPartition(topic, p) for p in range(len(self._log(topic).partitions))]
            per, extra = divmod(len(tps), len(subscribers))
            start = 0
            for i, member in enumerate(subscribers):
                count = per + (1 if i < extra else 0)
                member._assigned.update(tps[start : start + count])
                start += count

    def _commit(self, group: str, offsets: dict[TopicPartition, int]) -> None:
        self._groups.setdefault(group, _Group()).committed.update(offsets)

    def _read(self, tp: TopicPartition, start: int, limit: int) -> tuple[list[tuple[int, _Entry]], int]:
        entries = self._log(tp.topic).partitions[tp.partition]
        out: list[tuple[int, _Entry]] = []
        pos = start
        while pos < len(entries) and len(out) < limit:
            if entries[pos].value is not None:
                out.append((pos, entries[pos]))
            pos += 1
        return out, pos


class MemoryConsumer(Consumer):
    def __init__(
        self,
        bus: MemoryBus,
        topics: Sequence[TopicLike],
        *,
        group: str | None,
        from_beginning: bool,
        instance_id: str | None,
    ) -> None:
        super().__init__(topics, group)
        self._bus = bus
        self.member_id = instance_id or f"member-{next(bus._ids)}"
        self._from_beginning = from_beginning
        self._assigned: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._cursor = 0
        self._started = False

    async def start(self) -> None:
        for topic in self.topics:
            self._bus._log(topic)
        if self.group is None:
            for topic in self.topics:
                self._assigned.update(TopicPartition(topic, p) for p in await self._bus.partitions(topic))
        else:
            self._bus._join(self.group, self)
        self._started = True

    async def close(self) -> None:
        if not self._started:
            return
        if self.group is not None:
            await self.commit()
            self._bus._leave(self.group, self)
        self._started = False

    def _revoke_commit(self) -> None:
        if self.group is not None and self._marked:
            self._bus._commit(self.group, dict(self._marked))
            self._marked.clear()

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        if self.group is None:
            raise BusError("a consumer without a group cannot commit (replay and tail never commit)")
        self._bus._commit(self.group, offsets)

    async def committed(self, tp: TopicPartition) -> int | None:
        if self.group is None:
            return None
        return self._bus._groups.get(self.group, _Group()).committed.get(tp)

    async def position(self, tp: TopicPartition) -> int:
        if tp not in self._positions:
            committed = await self.committed(tp)
            if committed is not None:
                self._positions[tp] = committed
            elif self._from_beginning:
                self._positions[tp] = 0
            else:
                self._positions[tp] = (await self._bus.end_offsets(tp.topic))[tp.partition]
        return self._positions[tp]

    async def lag(self) -> dict[TopicPartition, int]:
        out: dict[TopicPartition, int] = {}
        for tp in sorted(self._assigned):
            end = len(self._bus._log(tp.topic).partitions[tp.partition])
            base = await self.committed(tp)
            if base is None:
                base = await self.position(tp)
            out[tp] = max(0, end - base)
        return out

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        if tp not in self._assigned:
            raise BusError(f"cannot seek {tp}: not assigned to this consumer")
        self._positions[tp] = offset

    async def _offsets_for_time(
        self, tps: Sequence[TopicPartition], timestamp_ms: int
    ) -> dict[TopicPartition, int]:
        out = {}
        for tp in tps:
            out[tp] = (await self._bus.offsets_for_time(tp.topic, timestamp_ms))[tp.partition]
        return out

    async def getmany(self, *, timeout_s: float = 1.0, max_records: int = 500) -> list[Record[Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            for tp in list(self._positions):
                if tp not in self._assigned:
                    del self._positions[tp]
            records = await self._collect(max_records)
            remaining = deadline - time.monotonic()
            if records or remaining <= 0:
                return records
            await self._bus._wait(remaining)

    async def _collect(self, max_records: int) -> list[Record[Any]]:
        tps = sorted(self._assigned)
        if not tps:
            return []
        out: list[Record[Any]] = []
        # Rotate the starting partition so one busy partition cannot starve the others.
        self._cursor = (self._cursor + 1) % len(tps)
        for tp in tps[self._cursor :] + tps[: self._cursor]:
            if len(out) >= max_records:
                break
            start = await self.position(tp)
            entries, next_pos = self._bus._read(tp, start, max_records - len(out))
            self._positions[tp] = next_pos
            for offset, entry in entries:
                assert entry.value is not None
                out.append(
                    Record(
                        topic=tp.topic,
                        partition=tp.partition,
                        offset=offset,
                        timestamp_ms=entry.timestamp_ms,
                        key=entry.key,
                        raw=entry.value,
                        headers=entry.headers,
                        decoder=self._decoders.get(tp.topic),
                    )
                )
        return out
