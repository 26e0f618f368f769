"""A run's namespace: workers use canonical names, the cluster sees prefixed ones, runs stay apart."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from rlbus.bus import Bus, MemoryBus, Record, TopicPartition
from rlbus.bus.dlq import DeadLetters, handle_batch, read_dead_letters, redrive
from rlbus.bus.namespace import NamespacedBus, check_prefix, namespaced
from rlbus.bus.topics import PROMPTS, ROLLOUTS, topic_specs
from rlbus.schemas import Prompt


def prompt(i: int) -> Prompt:
    return Prompt(prompt_id=f"p{i}", env="arith", text=f"{i}+1=")


async def drain(bus: Bus, group: str | None, want: int) -> list[Record[Any]]:
    out: list[Record[Any]] = []
    async with bus.consumer([PROMPTS], group=group) as consumer:
        for _ in range(100):
            batch = await consumer.getmany(timeout_s=0.2)
            for record in batch:
                consumer.mark(record)
            out += batch
            if len(out) >= want:
                break
        if group is not None:
            await consumer.commit()
    return out


async def test_names_are_prefixed_on_the_cluster_and_canonical_for_workers(bus: Bus) -> None:
    prefix = f"test-ns-{uuid.uuid4().hex[:8]}."
    ns = NamespacedBus(bus, prefix)
    assert sorted(await ns.create_topics(topic_specs(partitions=2))) == sorted(s.name for s in topic_specs())
    assert f"{prefix}rl.prompts.v1" in await bus.list_topics()
    assert PROMPTS.name in await ns.list_topics()
    meta = await ns.send(PROMPTS, prompt(1))
    assert meta.topic == PROMPTS.name
    records = await drain(ns, "rollout", 1)
    assert [r.topic for r in records] == [PROMPTS.name] and records[0].value.prompt_id == "p1"
    assert (await bus.committed(f"{prefix}rollout", f"{prefix}{PROMPTS.name}"))[meta.partition] == meta.offset + 1
    assert (await ns.committed("rollout", PROMPTS.name))[meta.partition] == meta.offset + 1
    assert (await ns.end_offsets(PROMPTS.name))[meta.partition] == meta.offset + 1
    assert (await ns.describe(PROMPTS.name)).name == PROMPTS.name


async def test_two_namespaces_do_not_see_each_other() -> None:
    inner = MemoryBus()
    await inner.start()
    a, b = NamespacedBus(inner, "a."), NamespacedBus(inner, "b.")
    for ns in (a, b):
        await ns.create_topics(topic_specs(partitions=2))
    await a.send(PROMPTS, prompt(1))
    await b.send(PROMPTS, prompt(2))
    await b.send(PROMPTS, prompt(3))
    assert [r.value.prompt_id for r in await drain(a, "g", 1)] == ["p1"]
    assert sorted(r.value.prompt_id for r in await drain(b, "g", 2)) == ["p2", "p3"]
    assert sum((await inner.end_offsets("a.rl.prompts.v1")).values()) == 1


async def test_dead_letters_go_to_the_namespaced_dlq() -> None:
    inner = MemoryBus()
    await inner.start()
    ns = NamespacedBus(inner, "run7.")
    await ns.create_topics(topic_specs(partitions=1))
    await ns.send_raw(ROLLOUTS.name, b"\xc1 not msgpack", key=b"k")

    async def handler(record: Record[Any]) -> None:
        record.value  # noqa: B018 - decoding raises for the garbage

    dead = DeadLetters(ns)
    async with ns.consumer([ROLLOUTS], group="trainer") as consumer:
        batch: list[Record[Any]] = []
        while not batch:
            batch = await consumer.getmany(timeout_s=0.1)
        await handle_batch(consumer, batch, handler, dead)
        committed = await consumer.commit()
    assert committed == {TopicPartition(ROLLOUTS.name, 0): 1}
    assert sum((await inner.end_offsets("run7.rl.rollouts.v1.dlq")).values()) == 1
    (letter,) = await read_dead_letters(ns, ROLLOUTS.name)
    assert letter.source_topic == ROLLOUTS.name and letter.value == b"\xc1 not msgpack"
    (outside,) = await read_dead_letters(inner, "run7.rl.rollouts.v1")  # what `rlbus dlq list` shows
    assert outside.source_topic == "run7.rl.rollouts.v1"
    assert await redrive(inner, "run7.rl.rollouts.v1") == 1  # `rlbus dlq redrive`: back into the run's topic
    assert sum((await inner.end_offsets("run7.rl.rollouts.v1")).values()) == 2
    assert sum((await inner.end_offsets("rl.rollouts.v1")).values() if "rl.rollouts.v1" in await inner.list_topics()
               else [0]) == 0


async def test_seek_position_and_assignment_use_canonical_names() -> None:
    inner = MemoryBus()
    await inner.start()
    ns = NamespacedBus(inner, "x-")
    await ns.create_topics(topic_specs(partitions=1))
    for i in range(3):
        await ns.send(PROMPTS, prompt(i))
    tp = TopicPartition(PROMPTS.name, 0)
    async with ns.consumer([PROMPTS], group=None) as consumer:
        assert consumer.assignment() == {tp}
        await consumer.seek(tp, 2)
        assert await consumer.position(tp) == 2
        records = await consumer.getmany(timeout_s=0.5)
        assert [(r.topic, r.offset) for r in records] == [(PROMPTS.name, 2)]


def test_prefix_rules() -> None:
    assert check_prefix("run7.") == "run7."
    for bad in ("run7", ".run.", "a b.", "x" * 101 + "."):
        with pytest.raises(ValueError):
            check_prefix(bad)
    inner = MemoryBus()
    assert namespaced(inner, "") is inner
    assert isinstance(namespaced(inner, "r."), NamespacedBus)
