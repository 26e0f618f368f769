"""Consumer-group lag, seen from the outside and from inside a worker.

From the outside: a group's committed offsets against the topic's end offsets — what
``kafka-consumer-groups --describe`` calls lag — read through the bus so it works on Kafka and the
in-memory bus alike. A partition the group never committed counts from the log start (everything
retained is still to be read). ``rlbus status`` shows it per partition; the dashboard charts the totals
over time. From inside: :class:`LagProbe` refreshes the ``rlbus_consumer_lag`` gauge for the partitions
one worker owns, from its :meth:`rlbus.bus.base.Consumer.lag`, and keeps the figures for its heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rlbus.bus.base import Bus, Consumer
from rlbus.bus.topics import PROMPTS, REWARDS, ROLLOUTS
from rlbus.bus.types import TopicPartition
from rlbus.errors import RlbusError
from rlbus.metrics import CONSUMER_LAG

log = logging.getLogger("rlbus.observe.lag")

#: rlbus's consumer groups and the topics each reads (reward groups are ``reward-<kind>``).
DEFAULT_GROUPS: dict[str, tuple[str, ...]] = {
    "rollout": (PROMPTS.name,),
    "reward-verifier": (ROLLOUTS.name,),
    "trainer": (ROLLOUTS.name, REWARDS.name),
}


@dataclass(frozen=True)
class PartitionLag:
    partition: int
    committed: int | None
    """Next offset the group will read; None when it never committed on this partition."""
    end: int
    lag: int


@dataclass(frozen=True)
class GroupLag:
    """One consumer group on one topic."""

    group: str
    topic: str
    members: int
    """Live workers whose heartbeat names this group."""
    partitions: list[PartitionLag]
    total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", sum(p.lag for p in self.partitions))

    @property
    def worst(self) -> PartitionLag | None:
        return max(self.partitions, key=lambda p: p.lag, default=None)

    @property
    def ever_committed(self) -> bool:
        return any(p.committed is not None for p in self.partitions)


def partition_lags(
    committed: Mapping[int, int | None], ends: Mapping[int, int], starts: Mapping[int, int]
) -> list[PartitionLag]:
    """Per partition of the topic, end − committed (end − log start where nothing was committed)."""
    lags = []
    for p, end in sorted(ends.items()):
        c = committed.get(p)
        lags.append(PartitionLag(p, c, end, max(0, end - (starts.get(p, 0) if c is None else c))))
    return lags


async def group_lag(
    bus: Bus,
    group: str,
    topic: str,
    *,
    members: int = 0,
    ends: Mapping[int, int] | None = None,
    starts: Mapping[int, int] | None = None,
) -> GroupLag:
    """``group``'s lag on ``topic``; pass ``ends``/``starts`` when reading several groups of one topic."""
    ends = await bus.end_offsets(topic) if ends is None else ends
    starts = await bus.beginning_offsets(topic) if starts is None else starts
    committed = await bus.committed(group, topic)
    return GroupLag(group, topic, members, partition_lags(committed, ends, starts))


# --- one worker's own partitions ------------------------------------------------------------------
class LagProbe:
    """Refreshes ``rlbus_consumer_lag`` for one consumer, at most every ``every_s`` seconds.

    A worker calls :meth:`refresh` once per loop iteration; the probe asks the consumer only when the
    interval has passed, drops the gauge's series for partitions the consumer no longer owns (after a
    rebalance another member reports them), and keeps the figures for the worker's heartbeat. A failed
    query is logged and leaves the previous figures: lag is an observation, never a reason to stop.
    """

    def __init__(self, *, every_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._due = 0.0
        self._group = ""
        self.latest: dict[TopicPartition, int] = {}

    async def refresh(self, consumer: Consumer, *, force: bool = False) -> dict[TopicPartition, int]:
        now = self._clock()
        if not force and now < self._due:
            return self.latest
        self._due = now + self.every_s
        try:
            lag = await consumer.lag()
        except RlbusError as exc:
            log.warning("consumer lag of %s not available: %s", consumer.group or consumer.topics, exc)
            return self.latest
        group = consumer.group or ""
        for tp in set(self.latest) - set(lag):
            with contextlib.suppress(KeyError):
                CONSUMER_LAG.remove(tp.topic, str(tp.partition), self._group)
        for tp, value in lag.items():
            CONSUMER_LAG.labels(tp.topic, str(tp.partition), group).set(value)
        self.latest, self._group = lag, group
        return lag

    @property
    def total(self) -> int:
        return sum(self.latest.values())
