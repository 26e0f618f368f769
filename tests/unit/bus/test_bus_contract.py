"""The bus contract, run against the in-memory bus and a real Kafka broker (``bus`` fixture)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from rlbus.bus import Bus, Consumer, Record, Topic, TopicPartition
from rlbus.bus.dlq import DeadLetters, handle_batch, read_dead_letters, redrive
from rlbus.bus.partitioner import partition_for
from rlbus.bus.replay import Bound, read_window, replay_into
from rlbus.bus.topics import dlq_spec
from rlbus.bus.types import TopicSpec
from rlbus.errors import MalformedMessage, TopicNotFound
from rlbus.schemas import Prompt


def prompt(i: int, key: str | None = None) -> Prompt:
    return Prompt(prompt_id=key or f"p{i}", env="arith", text=f"{i} + {i} = ?", group_size=4)


async def drain(consumer: Consumer, want: int, timeout_s: float = 30.0, mark: bool = True) -> list[Record[Any]]:
    got: list[Record[Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        for record in await consumer.getmany(timeout_s=0.5):
            got.append(record)
            if mark:
                consumer.mark(record)
    return got


async def typed_topic(make_topic: Callable[..., Any], name: str, partitions: int = 3) -> Topic[Prompt]:
    return Topic(await make_topic(name, partitions), Prompt, key=lambda m: m.prompt_id)


async def test_produce_consume_commit_resume(bus: Bus, make_topic: Callable[..., Any], unique: Callable[[str], str]):
    topic = await typed_topic(make_topic, "resume")
    group = unique("g")
    for i in range(20):
        await bus.send(topic, prompt(i))
    async with bus.consumer([topic], group=group) as consumer:
        first = await drain(consumer, 20)
        assert sorted(r.value.prompt_id for r in first) == sorted(f"p{i}" for i in range(20))
        await consumer.commit()
    for i in range(20, 25):
        await bus.send(topic, prompt(i))
    async with bus.consumer([topic], group=group) as consumer:
        second = await drain(consumer, 5)
        await asyncio.sleep(0.3)
        second += await consumer.getmany(timeout_s=0.5)
    assert sorted(r.value.prompt_id for r in second) == [f"p{i}" for i in range(20, 25)]
    committed = await bus.committed(group, topic.name)
    assert sum(v or 0 for v in committed.values()) == 25


async def test_keys_partition_like_kafka(bus: Bus, make_topic: Callable[..., Any]):
    topic = await typed_topic(make_topic, "keys", partitions=5)
    for i in range(30):
        meta = await bus.send(topic, prompt(i, key=f"group-{i % 7}"))
        assert meta.partition == partition_for(f"group-{i % 7}".encode(), 5)


async def test_unmarked_records_are_redelivered(bus: Bus, make_topic: Callable[..., Any], unique: Callable[[str], str]):
    topic = await typed_topic(make_topic, "redeliver", partitions=1)
    group = unique("g")
    for i in range(10):
        await bus.send(topic, prompt(i))
    async with bus.consumer([topic], group=group) as consumer:
        got = await drain(consumer, 10, mark=False)
        for record in got[:4]:
            consumer.mark(record)
        await consumer.commit()
    async with bus.consumer([topic], group=group) as consumer:
        again = await drain(consumer, 6)
    assert [r.value.prompt_id for r in again] == [f"p{i}" for i in range(4, 10)]


async def test_group_members_split_partitions_and_rebalance_commits(
    bus: Bus, make_topic: Callable[..., Any], unique: Callable[[str], str]
):
    topic = await typed_topic(make_topic, "split", partitions=4)
    group = unique("g")
    for i in range(40):
        await bus.send(topic, prompt(i, key=f"k{i}"))
    a = bus.consumer([topic], group=group)
    await a.start()
    fetched = await drain(a, 40, mark=False)
    # Mark a prefix per partition (commits must be contiguous to mean "everything before is done").
    prefix: dict[int, int] = {}
    for r in sorted(fetched, key=lambda r: (r.partition, r.offset)):
        if r.offset < 3:
            a.mark(r)
            prefix[r.partition] = r.offset + 1
    marked = {(p, o) for p, end in prefix.items() for o in range(end)}
    b = bus.consumer([topic], group=group)
    await b.start()
    after: list[Record[Any]] = []
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        after += await a.getmany(timeout_s=0.2)
        after += await b.getmany(timeout_s=0.2)
        sa, sb = a.assignment(), b.assignment()
        settled = sa and sb and not (sa & sb) and len(sa | sb) == 4
        if settled and len({(r.partition, r.offset) for r in after}) >= 40 - len(marked):
            break
    assert a.assignment() and b.assignment(), "both members should own partitions after the rebalance"
    assert not (a.assignment() & b.assignment())
    seen_after = {(r.partition, r.offset) for r in after}
    assert not (seen_after & marked), "records marked before the rebalance were redelivered"
    assert seen_after == {(r.partition, r.offset) for r in fetched} - marked
    await a.close()
    await b.close()


async def test_seek_by_offset_and_time(bus: Bus, make_topic: Callable[..., Any]):
    topic = await typed_topic(make_topic, "seek", partitions=1)
    base = int(time.time() * 1000) - 60_000
    for i in range(10):
        await bus.send(topic, prompt(i), timestamp_ms=base + i * 1000)
    async with bus.consumer([topic], group=None) as consumer:
        tp = TopicPartition(topic.name, 0)
        await consumer.seek(tp, 7)
        got = await drain(consumer, 3, mark=False)
        assert [r.offset for r in got] == [7, 8, 9]
        await consumer.seek_to_time(base + 4500)
        got = await drain(consumer, 5, mark=False)
        assert [r.value.prompt_id for r in got] == ["p5", "p6", "p7", "p8", "p9"]


async def test_replay_by_time_returns_exactly_the_window(bus: Bus, make_topic: Callable[..., Any]):
    topic = await typed_topic(make_topic, "window", partitions=3)
    base = int(time.time() * 1000) - 100_000
    for i in range(30):
        await bus.send(topic, prompt(i, key=f"k{i}"), timestamp_ms=base + i * 1000)
    start, stop = Bound(time_ms=base + 10_000), Bound(time_ms=base + 20_000)
    from rlbus.bus import topics as topics_module

    topics_module.TYPED_TOPICS[topic.name] = topic  # type: ignore[assignment]
    try:
        got = [r async for r in read_window(bus, topic.name, start, stop)]
    finally:
        del topics_module.TYPED_TOPICS[topic.name]
    assert sorted(int(r.value.prompt_id[1:]) for r in got) == list(range(10, 20))
    by_offset = [r async for r in read_window(bus, topic.name, Bound(offset=5))]
    assert len(by_offset) == sum(max(0, n - 5) for n in (await bus.end_offsets(topic.name)).values())


async def test_replay_terminates_while_producers_write(bus: Bus, make_topic: Callable[..., Any]):
    source = await make_topic("live", 2)
    target = await make_topic("copy", 2)
    for i in range(50):
        await bus.send_raw(source, f"m{i}".encode(), key=f"k{i}".encode())
    stop = asyncio.Event()

    async def keep_writing() -> None:
        i = 50
        while not stop.is_set():
            await bus.send_raw(source, f"m{i}".encode(), key=f"k{i}".encode())
            i += 1
            await asyncio.sleep(0.005)

    writer = asyncio.create_task(keep_writing())
    try:
        copied = await asyncio.wait_for(replay_into(bus, source, target), 60)
    finally:
        stop.set()
        await writer
    assert copied >= 50
    assert sum((await bus.end_offsets(target)).values()) == copied


async def test_poison_message_goes_to_dlq_and_nothing_is_lost(
    bus: Bus, make_topic: Callable[..., Any], unique: Callable[[str], str]
):
    topic = await typed_topic(make_topic, "poison", partitions=1)
    await bus.create_topics([dlq_spec(TopicSpec(topic.name, partitions=1))])
    group = unique("g")
    await bus.send(topic, prompt(1))
    await bus.send_raw(topic.name, b"\xc1 not msgpack", key=b"bad", headers=(("trace", b"abc"),))
    await bus.send(topic, prompt(3))
    handled: list[str] = []

    async def handler(record: Record[Any]) -> None:
        handled.append(record.value.prompt_id)

    dead = DeadLetters(bus)
    async with bus.consumer([topic], group=group) as consumer:
        batch = await drain(consumer, 3, mark=False)
        await handle_batch(consumer, batch, handler, dead)
        await consumer.commit()
    assert handled == ["p1", "p3"]
    assert (await bus.committed(group, topic.name))[0] == 3
    letters = await read_dead_letters(bus, topic.name)
    assert len(letters) == 1
    letter = letters[0]
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == (topic.name, 0, 1)
    assert letter.error_class == MalformedMessage.__name__ and letter.value == b"\xc1 not msgpack"
    assert letter.key == b"bad" and ("trace", b"abc") in letter.original_headers
    assert await redrive(bus, topic.name) == 1
    assert (await bus.end_offsets(topic.name))[0] == 4


async def test_missing_topic_is_an_error(bus: Bus, unique: Callable[[str], str]):
    with pytest.raises(TopicNotFound):
        await bus.send_raw(unique("missing"), b"x")
    with pytest.raises(TopicNotFound):
        async with bus.consumer([unique("missing2")], group=unique("g")):
            pass


async def test_create_is_idempotent_and_describe_reports_config(bus: Bus, unique: Callable[[str], str]):
    name = unique("described")
    spec = TopicSpec(name, partitions=2, config={"cleanup.policy": "compact", "retention.ms": "3600000"})
    assert await bus.create_topics([spec]) == [name]
    assert await bus.create_topics([spec]) == []
    assert name in await bus.list_topics()
    info = await bus.describe(name)
    assert info.partitions == 2 and info.replication == 1
    assert info.config["cleanup.policy"] == "compact" and info.config["retention.ms"] == "3600000"
    assert info.end_offsets == {0: 0, 1: 0}
