"""A run's own topics and consumer groups on a shared cluster: every name gets the run's prefix.

Workers name topics by their canonical names (``rl.rollouts.v1``) and groups by role (``trainer``).
Two runs on one Kafka — an integration test beside a developer's run, a replay into fresh topics — must
not see each other's records or join each other's groups, so :class:`NamespacedBus` wraps any bus and
maps ``name`` → ``<prefix>name`` on the way in (topics, dead-letter topics, groups) and back on the way
out (records, metadata, assignments), so workers, the DLQ helper and ``record.topic == ROLLOUTS.name``
checks see the canonical names. An empty prefix means no wrapper at all (:func:`namespaced`).

With ``prefix = "run7."`` the rollouts live in ``run7.rl.rollouts.v1`` (dead letters in
``run7.rl.rollouts.v1.dlq``) and the trainer's group is ``run7.trainer``; ``rlbus replay``, ``tail`` and
``topics list`` name them that way. A dead letter's source-topic header is mapped the same way, so on the
cluster it names the real topic and ``rlbus dlq redrive run7.rl.rollouts.v1`` sends it back there.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from rlbus.bus.base import Bus, Consumer, TopicLike
from rlbus.bus.dlq import H_TOPIC
from rlbus.bus.forward import ForwardingBus, ForwardingConsumer
from rlbus.bus.topic import Topic
from rlbus.bus.types import Headers, Record, RecordMetadata, TopicInfo, TopicPartition, TopicSpec

_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*[._-]")


def check_prefix(prefix: str) -> str:
    """Kafka topic names allow ``[A-Za-z0-9._-]``; a prefix must also end in a separator (``.``, ``_``
    or ``-``) so ``run7.rl.rollouts.v1`` stays readable."""
    if len(prefix) > 100 or not _PREFIX.fullmatch(prefix):
        raise ValueError(f"namespace prefix {prefix!r} must match {_PREFIX.pattern} (at most 100 characters)")
    return prefix


class NamespacedBus(ForwardingBus):
    """``inner`` with every topic and group name prefixed (see the module docstring): every call that names
    a topic, group or partition is mapped; lifecycle is forwarded (:class:`ForwardingBus`)."""

    def __init__(self, inner: Bus, prefix: str) -> None:
        super().__init__(inner)
        self.prefix = check_prefix(prefix)
        self._topics: dict[str, Topic[Any]] = {}

    # --- names -------------------------------------------------------------------------------------
    def outer(self, name: str) -> str:
        """The name on the cluster of the canonical ``name``."""
        return self.prefix + name

    def canonical(self, name: str) -> str:
        """The canonical name of a cluster name (unchanged when it is not in this namespace)."""
        return name.removeprefix(self.prefix)

    def topic(self, topic: TopicLike) -> TopicLike:
        if isinstance(topic, str):
            return self.outer(topic)
        mapped = self._topics.get(topic.name)
        if mapped is None:
            mapped = self._topics[topic.name] = Topic(self.outer(topic.name), topic.schema, topic.key)
        return mapped

    def group(self, group: str | None) -> str | None:
        return None if group is None else self.outer(group)

    def tp_out(self, tp: TopicPartition) -> TopicPartition:
        return TopicPartition(self.outer(tp.topic), tp.partition)

    def tp_in(self, tp: TopicPartition) -> TopicPartition:
        return TopicPartition(self.canonical(tp.topic), tp.partition)

    def record_in(self, record: Record[Any]) -> Record[Any]:
        headers = _map_header(record.headers, H_TOPIC, self.canonical)
        return dataclasses.replace(record, topic=self.canonical(record.topic), headers=headers)

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
        meta = await self.inner.send_raw(
            self.outer(topic), value, key=key, headers=_map_header(headers, H_TOPIC, self.outer),
            timestamp_ms=timestamp_ms, partition=partition,
        )
        return dataclasses.replace(meta, topic=self.canonical(meta.topic))

    # --- consume -----------------------------------------------------------------------------------
    def consumer(
        self,
        topics: Sequence[TopicLike],
        *,
        group: str | None = None,
        from_beginning: bool = True,
        instance_id: str | None = None,
    ) -> NamespacedConsumer:
        inner = self.inner.consumer(
            [self.topic(t) for t in topics], group=self.group(group), from_beginning=from_beginning,
            instance_id=instance_id,
        )
        return NamespacedConsumer(inner, topics, group=group, bus=self)

    # --- admin -------------------------------------------------------------------------------------
    async def create_topics(self, specs: Sequence[TopicSpec]) -> list[str]:
        created = await self.inner.create_topics([dataclasses.replace(s, name=self.outer(s.name)) for s in specs])
        return [self.canonical(name) for name in created]

    async def list_topics(self) -> list[str]:
        return [self.canonical(n) for n in await self.inner.list_topics() if n.startswith(self.prefix)]

    async def describe(self, topic: str) -> TopicInfo:
        info = await self.inner.describe(self.outer(topic))
        return dataclasses.replace(info, name=topic)

    async def partitions(self, topic: str) -> list[int]:
        return await self.inner.partitions(self.outer(topic))

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return await self.inner.end_offsets(self.outer(topic))

    async def beginning_offsets(self, topic: str) -> dict[int, int]:
        return await self.inner.beginning_offsets(self.outer(topic))

    async def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        return await self.inner.offsets_for_time(self.outer(topic), timestamp_ms)

    async def committed(self, group: str, topic: str) -> dict[int, int | None]:
        return await self.inner.committed(self.outer(group), self.outer(topic))


class NamespacedConsumer(ForwardingConsumer):
    """A consumer of the inner bus under outer names; hands out records under canonical names. Marks and
    commits go to the inner consumer, so its rebalance listener commits what was marked."""

    def __init__(self, inner: Consumer, topics: Sequence[TopicLike], *, group: str | None, bus: NamespacedBus) -> None:
        super().__init__(inner, topics, group)
        self._ns = bus

    async def getmany(self, *, timeout_s: float = 1.0, max_records: int = 500) -> list[Record[Any]]:
        records = await self.inner.getmany(timeout_s=timeout_s, max_records=max_records)
        return [self._ns.record_in(r) for r in records]

    def mark(self, record: Record[Any]) -> None:
        self.inner.mark(dataclasses.replace(record, topic=self._ns.outer(record.topic)))

    async def commit(self) -> dict[TopicPartition, int]:
        return {self._ns.tp_in(tp): off for tp, off in (await self.inner.commit()).items()}

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        await self.inner._commit({self._ns.tp_out(tp): off for tp, off in offsets.items()})

    def assignment(self) -> set[TopicPartition]:
        return {self._ns.tp_in(tp) for tp in self.inner.assignment()}

    async def committed(self, tp: TopicPartition) -> int | None:
        return await self.inner.committed(self._ns.tp_out(tp))

    async def position(self, tp: TopicPartition) -> int:
        return await self.inner.position(self._ns.tp_out(tp))

    async def lag(self) -> dict[TopicPartition, int]:
        return {self._ns.tp_in(tp): n for tp, n in (await self.inner.lag()).items()}

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        await self.inner.seek(self._ns.tp_out(tp), offset)

    async def _offsets_for_time(
        self, tps: Sequence[TopicPartition], timestamp_ms: int
    ) -> dict[TopicPartition, int]:
        found = await self.inner._offsets_for_time([self._ns.tp_out(tp) for tp in tps], timestamp_ms)
        return {self._ns.tp_in(tp): off for tp, off in found.items()}


def _map_header(headers: Headers, name: str, rename: Callable[[str], str]) -> Headers:
    """``headers`` with the topic name in header ``name`` renamed (the DLQ's source topic)."""
    if not any(key == name for key, _ in headers):
        return headers
    return tuple((k, rename(v.decode()).encode()) if k == name else (k, v) for k, v in headers)


def namespaced(bus: Bus, prefix: str) -> Bus:
    """``bus`` under ``prefix``; ``bus`` itself when the prefix is empty."""
    return NamespacedBus(bus, prefix) if prefix else bus
