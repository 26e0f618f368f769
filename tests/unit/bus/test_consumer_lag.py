"""`Consumer.lag()` on both buses: end offset − committed offset per assigned partition."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rlbus.bus import Bus, Consumer, Record, TopicPartition


async def read(consumer: Consumer, want: int, timeout_s: float = 30.0) -> list[Record[Any]]:
    got: list[Record[Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += await consumer.getmany(timeout_s=0.5)
    return got


async def test_lag_is_end_minus_committed_per_partition(
    bus: Bus, make_topic: Callable[..., Any], unique: Callable[[str], str]
) -> None:
    topic = await make_topic("lag", partitions=2)
    for i in range(6):
        await bus.send_raw(topic, b"a%d" % i, partition=0)
    for i in range(4):
        await bus.send_raw(topic, b"b%d" % i, partition=1)
    p0, p1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    async with bus.consumer([topic], group=unique("g")) as consumer:
        records = await read(consumer, 10)
        assert len(records) == 10
        by_partition = {p: sorted((r for r in records if r.partition == p), key=lambda r: r.offset) for p in (0, 1)}
        consumer.mark(by_partition[0][2])  # offsets 0..2 of partition 0 done
        consumer.mark(by_partition[1][0])  # offset 0 of partition 1 done
        await consumer.commit()
        assert await consumer.lag() == {p0: 3, p1: 3}

        await bus.send_raw(topic, b"b4", partition=1)
        await bus.send_raw(topic, b"b5", partition=1)
        assert await consumer.lag() == {p0: 3, p1: 5}

        for record in [*records, *await read(consumer, 2)]:
            consumer.mark(record)
        await consumer.commit()
        assert await consumer.lag() == {p0: 0, p1: 0}


async def test_lag_without_a_group_counts_from_the_read_position(
    bus: Bus, make_topic: Callable[..., Any]
) -> None:
    topic = await make_topic("lagfree", partitions=1)
    for i in range(3):
        await bus.send_raw(topic, b"%d" % i, partition=0)
    tp = TopicPartition(topic, 0)
    async with bus.consumer([topic], group=None) as consumer:
        assert await consumer.lag() == {tp: 3}
        assert len(await read(consumer, 3)) == 3
        assert await consumer.lag() == {tp: 0}
        await bus.send_raw(topic, b"3", partition=0)
        assert await consumer.lag() == {tp: 1}
