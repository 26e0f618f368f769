"""The bus contract: producing, consuming in groups, committing, seeking and replaying.

Two implementations satisfy it — :mod:`rlbus.bus.kafka` (aiokafka against a real broker) and
:mod:`rlbus.bus.memory` (the embedded default and the unit-test fixture) — and one contract test suite
runs against both. Commit semantics are "ack then commit": a worker calls :meth:`Consumer.mark` once a
record's side effect is done (or its dead letter is acknowledged) and :meth:`Consumer.commit` commits
the marked positions. On a rebalance the consumer commits what was marked before giving partitions up,
so a record is never committed before it was processed and is redelivered at most once per revoke.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

from rlbus.bus.topic import Topic
from rlbus.bus.types import Headers, Record, RecordMetadata, TopicInfo, TopicPartition, TopicSpec
from rlbus.errors import CommitFailed
from rlbus.metrics import count_out

log = logging.getLogger("rlbus.bus")

TopicLike = Topic[Any] | str


def topic_name(topic: TopicLike) -> str:
    return topic.name if isinstance(topic, Topic) else topic


class Consumer(abc.ABC):
    """A consumer of one or more topics, in a group (``group`` set) or manually assigned (replay)."""

    def __init__(self, topics: Sequence[TopicLike], group: str | None) -> None:
        self.topics = [topic_name(t) for t in topics]
        self.group = group
        # Typed topics decode their records; plain names hand out raw bytes only.
        self._decoders = {t.name: t.codec for t in topics if isinstance(t, Topic)}
        self._marked: dict[TopicPartition, int] = {}

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Commit what was marked (group consumers) and leave the group."""

    @abc.abstractmethod
    async def getmany(self, *, timeout_s: float = 1.0, max_records: int = 500) -> list[Record[Any]]:
        """Up to ``max_records`` records, waiting at most ``timeout_s`` for the first."""

    def mark(self, record: Record[Any]) -> None:
        """Record that ``record`` was fully processed; the next :meth:`commit` covers it."""
        tp = record.tp
        if record.offset + 1 > self._marked.get(tp, -1):
            self._marked[tp] = record.offset + 1

    async def commit(self) -> dict[TopicPartition, int]:
        """Commit every marked position (next offset to read) and return what was committed. When the
        group refuses the commit (``CommitFailed``: it is rebalancing) the positions stay marked, so the
        next commit carries them, and the error is raised."""
        owned = self.assignment()
        offsets = {tp: off for tp, off in self._marked.items() if tp in owned}
        self._marked.clear()
        if offsets:
            try:
                await self._commit(offsets)
            except CommitFailed:
                for tp, off in offsets.items():  # a position marked meanwhile is newer: it wins
                    if off > self._marked.get(tp, -1):
                        self._marked[tp] = off
                raise
        return offsets

    async def commit_or_defer(self) -> bool:
        """A worker's routine commit: a commit refused while the group rebalances is no reason to stop.
        Its positions stay marked for the next commit; partitions that moved to another member were
        committed by the revoke listener or are replayed there (every effect is idempotent by id).
        Returns whether it committed."""
        try:
            await self.commit()
        except CommitFailed as exc:
            log.warning("commit of group %s deferred to the next one: %s", self.group, exc)
            return False
        return True

    @abc.abstractmethod
    async def _commit(self, offsets: dict[TopicPartition, int]) -> None: ...

    @abc.abstractmethod
    def assignment(self) -> set[TopicPartition]: ...

    @abc.abstractmethod
    async def committed(self, tp: TopicPartition) -> int | None: ...

    @abc.abstractmethod
    async def position(self, tp: TopicPartition) -> int: ...

    @abc.abstractmethod
    async def lag(self) -> dict[TopicPartition, int]:
        """Per assigned partition, records not yet committed: end offset − committed offset (− the read
        position where nothing is committed, e.g. a consumer without a group). What the consumer-lag
        metric and the workers' heartbeats report."""

    @abc.abstractmethod
    async def seek(self, tp: TopicPartition, offset: int) -> None:
        """Move the read position of an assigned partition."""

    async def seek_to_time(self, timestamp_ms: int) -> None:
        """Seek every assigned partition to the first record at or after ``timestamp_ms`` (or its end)."""
        assigned = sorted(self.assignment())
        found = await self._offsets_for_time(assigned, timestamp_ms)
        for tp in assigned:
            await self.seek(tp, found[tp])

    @abc.abstractmethod
    async def _offsets_for_time(
        self, tps: Sequence[TopicPartition], timestamp_ms: int
    ) -> dict[TopicPartition, int]: ...


class Bus(abc.ABC):
    """A connection to the log: producer, consumer factory and topic admin."""

    kind: str = "abstract"

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def send(
        self, topic: Topic[Any], message: Any, *, headers: Headers = (), timestamp_ms: int | None = None
    ) -> RecordMetadata:
        """Encode with the topic's schema and write; returns once the write is acknowledged."""
        key, value = topic.encode(message)
        meta = await self.send_raw(topic.name, value, key=key, headers=headers, timestamp_ms=timestamp_ms)
        count_out(topic.name)
        return meta

    @abc.abstractmethod
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
        """Write bytes as they are (dead letters, redrive, replay ``--into``)."""

    @abc.abstractmethod
    def consumer(
        self,
        topics: Sequence[TopicLike],
        *,
        group: str | None = None,
        from_beginning: bool = True,
        instance_id: str | None = None,
    ) -> Consumer:
        """A group consumer (``group`` set) or, with ``group=None``, one assigned every partition of
        ``topics`` that commits nothing — what replay and tail use, so they never join a production group.
        ``instance_id`` enables static membership (a restarted worker keeps its partitions)."""

    @abc.abstractmethod
    async def create_topics(self, specs: Sequence[TopicSpec]) -> list[str]:
        """Create the topics that do not exist yet; return the names created."""

    @abc.abstractmethod
    async def list_topics(self) -> list[str]: ...

    @abc.abstractmethod
    async def describe(self, topic: str) -> TopicInfo: ...

    @abc.abstractmethod
    async def partitions(self, topic: str) -> list[int]: ...

    @abc.abstractmethod
    async def end_offsets(self, topic: str) -> dict[int, int]:
        """Next offset to be written, per partition (a snapshot: replay stops there)."""

    @abc.abstractmethod
    async def beginning_offsets(self, topic: str) -> dict[int, int]: ...

    @abc.abstractmethod
    async def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        """Per partition, the first offset whose timestamp is ≥ ``timestamp_ms``; the end offset if none."""

    @abc.abstractmethod
    async def committed(self, group: str, topic: str) -> dict[int, int | None]:
        """A group's committed offsets per partition (lag = end − committed)."""
