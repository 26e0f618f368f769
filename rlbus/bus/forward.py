"""Bus and consumer wrappers that pass every call through to an inner bus.

Two layers wrap a bus and change only a little of it: :class:`rlbus.bus.claimcheck.ClaimCheckBus` moves
large values to a blob store (it changes ``send_raw`` and what ``getmany`` hands out) and
:class:`rlbus.bus.namespace.NamespacedBus` renames topics and groups (it changes names everywhere).
Both must forward the rest of the contract exactly — lifecycle, marks and commits (so the inner
consumer's rebalance listener commits what was marked), seeks, lag, admin — and a method forgotten in
one of them would silently bypass the inner bus. This module holds that forwarding once; a wrapper
overrides only what it changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlbus.bus.base import Bus, Consumer, TopicLike
from rlbus.bus.types import Headers, Record, RecordMetadata, TopicInfo, TopicPartition, TopicSpec


class ForwardingConsumer(Consumer):
    """A consumer that delegates every call to ``inner``."""

    def __init__(self, inner: Consumer, topics: Sequence[TopicLike], group: str | None) -> None:
        super().__init__(topics, group)
        self.inner = inner

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def getmany(self, *, timeout_s: float = 1.0, max_records: int = 500) -> list[Record[Any]]:
        return await self.inner.getmany(timeout_s=timeout_s, max_records=max_records)

    def mark(self, record: Record[Any]) -> None:
        self.inner.mark(record)

    async def commit(self) -> dict[TopicPartition, int]:
        return await self.inner.commit()

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        await self.inner._commit(offsets)

    def assignment(self) -> set[TopicPartition]:
        return self.inner.assignment()

    async def committed(self, tp: TopicPartition) -> int | None:
        return await self.inner.committed(tp)

    async def position(self, tp: TopicPartition) -> int:
        return await self.inner.position(tp)

    async def lag(self) -> dict[TopicPartition, int]:
        return await self.inner.lag()

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        await self.inner.seek(tp, offset)

    async def seek_to_time(self, timestamp_ms: int) -> None:
        await self.inner.seek_to_time(timestamp_ms)

    async def _offsets_for_time(
        self, tps: Sequence[TopicPartition], timestamp_ms: int
    ) -> dict[TopicPartition, int]:
        return await self.inner._offsets_for_time(tps, timestamp_ms)


class ForwardingBus(Bus):
    """A bus that delegates every call to ``inner`` and owns its lifecycle when used as ``async with``
    (wrapping a bus that is already started, and never entering the wrapper, works too)."""

    def __init__(self, inner: Bus) -> None:
        self.inner = inner
        self.kind = inner.kind

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

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
        return await self.inner.send_raw(
            topic, value, key=key, headers=headers, timestamp_ms=timestamp_ms, partition=partition
        )

    def consumer(
        self,
        topics: Sequence[TopicLike],
        *,
        group: str | None = None,
        from_beginning: bool = True,
        instance_id: str | None = None,
    ) -> Consumer:
        return self.inner.consumer(topics, group=group, from_beginning=from_beginning, instance_id=instance_id)

    async def create_topics(self, specs: Sequence[TopicSpec]) -> list[str]:
        return await self.inner.create_topics(specs)

    async def list_topics(self) -> list[str]:
        return await self.inner.list_topics()

    async def describe(self, topic: str) -> TopicInfo:
        return await self.inner.describe(topic)

    async def partitions(self, topic: str) -> list[int]:
        return await self.inner.partitions(topic)

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return await self.inner.end_offsets(topic)

    async def beginning_offsets(self, topic: str) -> dict[int, int]:
        return await self.inner.beginning_offsets(topic)

    async def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        return await self.inner.offsets_for_time(topic, timestamp_ms)

    async def committed(self, group: str, topic: str) -> dict[int, int | None]:
        return await self.inner.committed(group, topic)
