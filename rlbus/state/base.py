"""The StateStore contract: the small shared state the asynchronous RL loop keeps beside Kafka.

Kafka redelivers after a crash or rebalance, so effects must be idempotent by id: the trainer marks every
rollout id it gave an outcome (``mark_once_counted``: SET NX semantics, the outcome's mark and counter in the
same atomic call) and counts, rather than repeats, a redelivery. The trainer joins rollouts with their rewards
in a buffer keyed by rollout id (``put_field`` / ``get_fields``; ``put_fields`` answers with the entry's field
count and ``field_names`` lists the fields without their values, so the join can tell a group is complete
without reading it), workers announce themselves in a registry whose entries vanish when heartbeats stop, and
counters record outcomes such as dropped-as-stale.

Two implementations honour the same contract test suite: in-memory for the embedded demo and unit
tests, Redis for real runs. Failures of the backing store surface as :class:`rlbus.errors.StateError`.
TTLs are seconds (floats allowed) and must be positive; ``None`` means no expiry.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypedDict


class WorkerRecord(TypedDict):
    """One live worker as the registry reports it."""

    role: str
    worker_id: str
    info: dict[str, Any]
    last_seen: float
    """Unix time of the latest heartbeat, by the worker's clock."""


@dataclass(frozen=True)
class Merged:
    """What `StateStore.merge_fields` did."""

    size: int
    """Fields the entry has afterwards."""
    added: frozenset[str]
    """The ``if_absent`` fields this call set (the others existed and kept their values)."""
    read: dict[str, bytes]
    """The ``read`` fields after the writes (absent ones left out)."""
    skipped: bool = False
    """Nothing was written: the ``unless`` id is marked (the other fields are then empty)."""


class StateStore(abc.ABC):
    """Idempotency ledger, join buffer, counters and worker registry behind one async interface."""

    @abc.abstractmethod
    async def mark_once(self, namespace: str, id: str, ttl_s: float | None = None) -> bool:
        """Record ``id`` in ``namespace``; True only for the first caller (until the TTL expires)."""

    @abc.abstractmethod
    async def mark_once_counted(
        self, namespace: str, ids: Sequence[str], *, counter: str, also: Sequence[str] = (),
        repeats: Sequence[str] = (),
    ) -> list[bool]:
        """The ledger's entry, in one atomic call: mark each id in ``namespace`` (as `mark_once`, no
        expiry); for the ids that were new, mark them in every namespace of ``also`` too and add their
        number to ``counter``; add the number already marked to each counter in ``repeats``. Returns, per
        id, whether it was new.

        All or nothing, so the gate, the outcome sets and the counters never disagree. As three calls, a
        trainer SIGKILLed between the gate and the count left a rollout with an outcome that no counter
        showed, and a run that waits for every rollout's outcome to be counted waited forever (the chaos
        suite's ``trainer_kill``, about one run in fifteen)."""

    @abc.abstractmethod
    async def seen(self, namespace: str, id: str) -> bool:
        """Whether ``id`` is recorded in ``namespace``."""

    @abc.abstractmethod
    async def put_field(self, key: str, field: str, value: bytes, ttl_s: float | None) -> None:
        """Set one field of the buffer entry ``key``; the entry's TTL restarts at ``ttl_s``."""

    @abc.abstractmethod
    async def put_fields(self, key: str, fields: Mapping[str, bytes], ttl_s: float | None) -> int:
        """Set several fields of ``key`` at once (the TTL restarts at ``ttl_s``); returns how many fields
        the entry has afterwards."""

    @abc.abstractmethod
    async def merge_fields(
        self, key: str, fields: Mapping[str, bytes], ttl_s: float | None, *,
        if_absent: Mapping[str, bytes] | None = None, read: Collection[str] = (),
        unless: tuple[str, str] | None = None,
    ) -> Merged:
        """In one atomic round trip: set ``fields``, set each field of ``if_absent`` only where ``key`` has
        none of that name (the first writer's value stays: HSETNX), restart the TTL at ``ttl_s`` if anything
        was written (a call that wrote nothing leaves it: an entry kept without expiry stays so), and read
        the ``read`` fields back — or, when ``unless = (namespace, id)`` is marked (`mark_once`), do
        nothing and say so (``skipped``). One arrival at the join, whatever the group's size."""

    @abc.abstractmethod
    async def get_fields(self, key: str) -> dict[str, bytes]:
        """All fields of the buffer entry ``key`` (empty when absent or expired)."""

    @abc.abstractmethod
    async def get_named(self, key: str, fields: Collection[str]) -> dict[str, bytes]:
        """The named fields of ``key`` that exist (the others are left out)."""

    @abc.abstractmethod
    async def field_names(self, key: str) -> set[str]:
        """The field names of ``key``, without reading their values (empty when absent or expired)."""

    @abc.abstractmethod
    async def delete_field(self, key: str, field: str) -> None:
        """Remove one field of the buffer entry ``key`` (the entry's TTL is unchanged)."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Drop the buffer entry ``key``; absent entries are fine."""

    @abc.abstractmethod
    async def incr(self, name: str, by: int = 1) -> int:
        """Add ``by`` to the counter ``name`` (starting at 0) and return the new value."""

    @abc.abstractmethod
    async def get_counter(self, name: str) -> int:
        """The counter's value; 0 when never incremented."""

    @abc.abstractmethod
    async def heartbeat(self, role: str, worker_id: str, info: dict[str, Any], ttl_s: float) -> None:
        """Register or refresh a worker; it disappears ``ttl_s`` after its latest heartbeat.

        ``info`` must be JSON-serialisable; both stores return it as JSON decoded it.
        """

    @abc.abstractmethod
    async def workers(self, role: str | None = None) -> list[WorkerRecord]:
        """Live workers, of one role or all, ordered by (role, worker_id)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def check_ttl(ttl_s: float | None) -> None:
    """Reject non-positive TTLs, which Redis would refuse and memory would expire at once."""
    if ttl_s is not None and ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")


def encode_worker(role: str, worker_id: str, info: dict[str, Any], now: float) -> str:
    """The stored form of a heartbeat: JSON, so Redis entries stay readable with redis-cli."""
    record: WorkerRecord = {"role": role, "worker_id": worker_id, "info": info, "last_seen": now}
    return json.dumps(record, sort_keys=True)


def decode_worker(raw: str | bytes) -> WorkerRecord:
    record: WorkerRecord = json.loads(raw)
    return record


def by_role(records: list[WorkerRecord], role: str | None) -> list[WorkerRecord]:
    """Records of ``role`` (all when None), sorted by (role, worker_id)."""
    chosen = [r for r in records if role is None or r["role"] == role]
    return sorted(chosen, key=lambda r: (r["role"], r["worker_id"]))
