"""Consumer-group lag from the outside: a group's committed offsets against the topic's end offsets.

What ``kafka-consumer-groups --describe`` calls lag, read through the bus so it works on Kafka and the
in-memory bus alike. A partition the group never committed counts from the log start (everything
retained is still to be read). ``rlbus status`` shows it per partition; the dashboard charts the
totals over time. (A worker's own view — end offset − its position — is
:meth:`rlbus.bus.base.Consumer.lag`, which it reports in its heartbeat.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlbus.bus.base import Bus
from rlbus.bus.topics import PROMPTS, REWARDS, ROLLOUTS

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
