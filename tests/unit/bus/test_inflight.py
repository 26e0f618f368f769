"""InFlight commits only the contiguous finished prefix of each partition, whatever the finishing order."""

from __future__ import annotations

from typing import Any

from rlbus.bus import MemoryBus, Record, TopicPartition, TopicSpec
from rlbus.bus.base import Consumer
from rlbus.bus.inflight import InFlight


async def records(bus: MemoryBus, consumer: Consumer, n: int) -> list[Record[Any]]:
    out: list[Record[Any]] = []
    while len(out) < n:
        got = await consumer.getmany(timeout_s=1.0, max_records=n - len(out))
        assert got, f"only {len(out)} of {n} records arrived"
        out += got
    return out


async def test_out_of_order_finishes_commit_only_the_contiguous_prefix(memory_bus: MemoryBus) -> None:
    await memory_bus.create_topics([TopicSpec("t", partitions=1)])
    for i in range(5):
        await memory_bus.send_raw("t", str(i).encode())
    async with memory_bus.consumer(["t"], group="g") as consumer:
        window = InFlight(consumer)
        r = await records(memory_bus, consumer, 5)
        for record in r:
            window.take(record)
        assert len(window) == 5
        assert window.finish(r[2]) is False and window.finish(r[1]) is False  # 0 still playing
        assert await consumer.commit() == {}
        assert window.finish(r[0]) is True  # 0, 1, 2 are a finished prefix now
        assert await consumer.commit() == {TopicPartition("t", 0): 3}
        assert window.finish(r[4]) is False
        assert await consumer.commit() == {}
        assert window.unfinished(TopicPartition("t", 0)) == [3]
        assert window.finish(r[3]) is True and len(window) == 0
        assert await consumer.commit() == {TopicPartition("t", 0): 5}
        assert window.finish(r[3]) is False  # a second finish of the same record changes nothing


async def test_gaps_in_offsets_do_not_hold_the_commit(memory_bus: MemoryBus) -> None:
    """A compacted topic skips offsets; contiguity is over the records taken, not offset + 1."""
    await memory_bus.create_topics([TopicSpec("c", partitions=1, config={"cleanup.policy": "compact"})])
    for key in (b"a", b"b", b"a", b"c"):  # offset 0 is compacted away
        await memory_bus.send_raw("c", b"v", key=key)
    async with memory_bus.consumer(["c"], group="g") as consumer:
        window = InFlight(consumer)
        r = await records(memory_bus, consumer, 3)
        assert [x.offset for x in r] == [1, 2, 3]
        for record in r:
            window.take(record)
        window.finish(r[1])
        window.finish(r[0])
        assert await consumer.commit() == {TopicPartition("c", 0): 3}


async def test_partitions_are_tracked_independently(memory_bus: MemoryBus) -> None:
    await memory_bus.create_topics([TopicSpec("m", partitions=2)])
    for i in range(6):
        await memory_bus.send_raw("m", str(i).encode(), partition=i % 2)
    async with memory_bus.consumer(["m"], group="g") as consumer:
        window = InFlight(consumer)
        r = await records(memory_bus, consumer, 6)
        for record in r:
            window.take(record)
        p0 = sorted((x for x in r if x.partition == 0), key=lambda x: x.offset)
        p1 = sorted((x for x in r if x.partition == 1), key=lambda x: x.offset)
        window.finish(p0[0])
        window.finish(p1[1])  # p1[0] still playing: holds partition 1 only
        window.finish(p0[2])
        assert await consumer.commit() == {TopicPartition("m", 0): 1}
        window.finish(p1[0])
        window.finish(p0[1])
        assert await consumer.commit() == {TopicPartition("m", 0): 3, TopicPartition("m", 1): 2}


async def test_a_revoked_partition_is_forgotten_and_its_late_finishes_ignored(memory_bus: MemoryBus) -> None:
    await memory_bus.create_topics([TopicSpec("r", partitions=2)])
    for i in range(4):
        await memory_bus.send_raw("r", str(i).encode(), partition=i % 2)
    async with memory_bus.consumer(["r"], group="g") as first:
        window = InFlight(first)
        r = await records(memory_bus, first, 4)
        for record in r:
            window.take(record)
        assert window.forget_revoked() == set()
        async with memory_bus.consumer(["r"], group="g") as second:  # joins: partition 1 moves to it
            assert first.assignment() == {TopicPartition("r", 0)}
            assert window.forget_revoked() == {TopicPartition("r", 1)}
            assert len(window) == 2 and window.unfinished(TopicPartition("r", 1)) == []
            late = [x for x in r if x.partition == 1]
            assert [window.finish(x) for x in late] == [False, False]
            # Partition 0 stayed (an eager rebalance re-reads it from its commit): each record is
            # now in flight twice, and the offset commits only when both copies have finished.
            again = await records(memory_bus, first, 2)
            assert {x.tp for x in again} == {TopicPartition("r", 0)}
            for record in again:
                window.take(record)
            ours = sorted((x for x in r if x.partition == 0), key=lambda x: x.offset)
            window.finish(ours[0])
            window.finish(ours[1])
            assert await first.commit() == {}
            window.finish(again[0])
            assert await first.commit() == {TopicPartition("r", 0): 1}
            window.finish(again[1])
            assert await first.commit() == {TopicPartition("r", 0): 2}
            assert await second.commit() == {}
        assert await memory_bus.committed("g", "r") == {0: 2, 1: None}
