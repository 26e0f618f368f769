"""In-order commits for records processed out of order: what lets a worker keep a window in flight.

:meth:`Consumer.mark` keeps the highest offset per partition, so a worker that marks records as they
finish — in whatever order — would commit past records still being processed, and a crash would lose
them. :class:`InFlight` sits between the two: the worker :meth:`~InFlight.take`\\ s each record as it
starts and :meth:`~InFlight.finish`\\ es it when its effect (or dead letter) is acknowledged; a finished
record is marked only once every record taken before it from the same partition has finished too. The
consumer therefore only ever commits a contiguous prefix of finished work, and everything after it is
redelivered after a crash. (The "offset tracker" idea of Confluent's parallel consumer, which also keeps
per-partition sets of in-flight offsets and commits the lowest incomplete one.)

"Contiguous" means among the records taken, not among offsets: compaction and transaction markers leave
gaps in a partition's offsets. The commit position of a partition is therefore the offset after the
highest finished record below the lowest unfinished one.

Rebalances: when a partition leaves ``consumer.assignment()``, :meth:`~InFlight.forget_revoked` drops its
bookkeeping. Its unfinished records will be redelivered to the partition's new owner from the last
commit; the copies still playing here may finish and publish their results as well. That duplicate is
harmless because results carry deterministic ids (a rollout id is the prompt id and group index) and the
trainer's ledger trains each id once. Under an eager rebalance a partition can also stay (or come back)
and be re-read from its committed offset while older copies are still in flight here; a record can then
be taken twice, and its offset counts as unfinished until every copy has finished. A finish that arrives
for a forgotten record is ignored. A partition that is revoked and handed back between two calls of
:meth:`~InFlight.forget_revoked` keeps its old bookkeeping; the worst that can do is commit an offset
below one another member committed meanwhile — a redelivery (deduplicated), never a loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlbus.bus.base import Consumer
from rlbus.bus.types import Record, TopicPartition


@dataclass
class _Partition:
    #: offset → copies of that record in flight (more than one only after a redelivery to this worker)
    pending: dict[int, int] = field(default_factory=dict)
    #: finished records waiting for an earlier pending one, by offset
    done: dict[int, Record[Any]] = field(default_factory=dict)


class InFlight:
    """Per-partition bookkeeping of records in flight; marks ``consumer`` with the contiguous finished
    prefix. Synchronous and cheap (a window holds a handful of records), so callers need no lock on one
    event loop."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._count = 0

    def __len__(self) -> int:
        """Records taken and not yet finished (or forgotten)."""
        return self._count

    def take(self, record: Record[Any]) -> None:
        """``record`` starts processing: no later record of its partition is committed before it finishes."""
        state = self._partitions.setdefault(record.tp, _Partition())
        state.pending[record.offset] = state.pending.get(record.offset, 0) + 1
        self._count += 1

    def finish(self, record: Record[Any]) -> bool:
        """``record``'s effect is acknowledged. Returns whether the consumer's mark moved (a commit would
        now cover more); False too for a record whose partition was forgotten."""
        state = self._partitions.get(record.tp)
        copies = state.pending.get(record.offset, 0) if state is not None else 0
        if state is None or copies == 0:
            return False
        self._count -= 1
        if copies == 1:
            del state.pending[record.offset]
        else:
            state.pending[record.offset] = copies - 1
        state.done[record.offset] = record
        return self._advance(state)

    def _advance(self, state: _Partition) -> bool:
        lowest_pending = min(state.pending, default=None)
        ready = [o for o in state.done if lowest_pending is None or o < lowest_pending]
        if not ready:
            return False
        self._consumer.mark(state.done[max(ready)])
        for offset in ready:
            del state.done[offset]
        return True

    def forget_revoked(self) -> set[TopicPartition]:
        """Drop the bookkeeping of partitions this consumer no longer owns; returns them."""
        owned = self._consumer.assignment()
        gone = {tp for tp in self._partitions if tp not in owned}
        for tp in gone:
            self._count -= sum(self._partitions.pop(tp).pending.values())
        return gone

    def unfinished(self, tp: TopicPartition) -> list[int]:
        """Offsets of ``tp`` taken and not finished, lowest first (logs, tests)."""
        state = self._partitions.get(tp)
        return sorted(state.pending) if state is not None else []
