"""The end-of-scenario ledger check, and the report every chaos scenario returns.

The promise under test (docs/architecture.md §3): every rollout a run produces ends in exactly one outcome —
trained, dropped with a reason, or dead-lettered — and nothing is trained twice. The audit starts from
what the log says was asked for (every prompt of the run on ``rl.prompts.v1`` wants ``group_size``
rollouts with the ids ``<prompt_id>/<i>``, :mod:`rlbus.consumers.rollout`) plus any rollout injected
on ``rl.rollouts.v1``, and looks each id up in the trainer's ledger (:meth:`JoinBuffer.outcome_of`):

* ``lost``: an id with no outcome (never produced, or produced and never finished);
* ``multiple_outcomes``: an id with more than one (e.g. dropped, then trained after a redelivery);
* ``duplicates_trained``: rollouts handed to the optimizer a second time — the exactly-once gate's
  count of trainings it caught only after the step (``ledger:trained_again``), or the harness's own
  count (an in-process trainer counts every id it hands to the optimizer), whichever is larger.

A scenario passes when all three are zero, no corrupt weights were applied, and its own checks hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rlbus.bus.base import Bus
from rlbus.bus.topic import Topic
from rlbus.bus.topics import PROMPTS, ROLLOUTS
from rlbus.errors import RlbusError
from rlbus.state.base import StateStore
from rlbus.training.join import TRAINED_AGAIN, JoinBuffer, Outcome


@dataclass
class ScenarioReport:
    """One scenario's figures (the row of ``rlbus bench chaos``) and whether its checks held."""

    scenario: str
    faults: list[str] = field(default_factory=list)
    produced: int = 0
    trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    dead_lettered: int = 0
    duplicates_trained: int = 0
    lost: int = 0
    corrupt_applied: int = 0
    #: Seconds from the fault until the system made progress again (scenario-specific; see ``notes``).
    recovery_s: float | None = None
    passed: bool = False
    wall_s: float = 0.0
    #: What the scenario checked beyond the ledger, and anything a reader should know.
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool) -> bool:
        self.checks[name] = bool(ok)
        return bool(ok)

    def finish(self) -> ScenarioReport:
        self.passed = (
            self.lost == 0
            and self.duplicates_trained == 0
            and self.corrupt_applied == 0
            and all(self.checks.values())
        )
        return self

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Audit:
    expected: int
    produced: int
    outcomes: dict[str, int]
    lost: list[str]
    multiple_outcomes: list[str]
    trained_again: int
    log_copies: int
    #: The ledger's counters (they include records that never decoded, e.g. garbage dead-lettered).
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def dropped(self) -> dict[str, int]:
        return {k: v for k, v in self.outcomes.items() if k.startswith("dropped")}


class TopicTail:
    """Every record of one topic so far, read by one long-lived consumer (no group, from the beginning).

    :func:`read_topic` opens a consumer per call: a dozen connections, each a TLS handshake and a SCRAM
    exchange on a secure cluster, about 0.7 s idle and 2.5 s under a scenario's load against 0.1-0.3 s in
    PLAINTEXT — slow enough for a poll to miss a window that lasts less than a second (prompts admitted
    but not yet played). A tail pays for its connections once; each :meth:`read` fetches only what arrived.
    """

    def __init__(self, bus: Bus, topic: str) -> None:
        self.bus = bus
        self.topic = topic
        self.records: list[Any] = []
        self._next: dict[int, int] = {}
        self._consumer: Any = None

    async def read(self) -> list[Any]:
        """Every record up to the end offsets seen now (decoded where the topic is typed)."""
        ends = await self.bus.end_offsets(self.topic)
        if all(ends[p] <= self._next.get(p, 0) for p in ends):
            return self.records
        known: dict[str, Topic[Any]] = {PROMPTS.name: PROMPTS, ROLLOUTS.name: ROLLOUTS}
        typed = known.get(self.topic)
        if self._consumer is None:
            self._consumer = self.bus.consumer([typed or self.topic], group=None, from_beginning=True)
            await self._consumer.start()
        while any(ends[p] > self._next.get(p, 0) for p in ends):
            for record in await self._consumer.getmany(timeout_s=1.0):
                self._next[record.partition] = record.offset + 1
                try:
                    self.records.append(record.value if typed else record)
                except RlbusError:
                    self.records.append(record)
        return self.records

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.close()
            self._consumer = None


async def read_topic(bus: Bus, topic: str, start: Mapping[int, int] | None = None) -> list[Any]:
    """Every record of ``topic`` from ``start`` (per partition; default the beginning) up to the end
    offsets seen now. Records that do not decode are returned as their raw record."""
    ends = await bus.end_offsets(topic)
    start = dict(start or {})
    out: list[Any] = []
    if all(ends[p] <= start.get(p, 0) for p in ends):
        return out
    from rlbus.bus.types import TopicPartition

    known: dict[str, Topic[Any]] = {PROMPTS.name: PROMPTS, ROLLOUTS.name: ROLLOUTS}
    typed = known.get(topic)
    async with bus.consumer([typed or topic], group=None) as consumer:
        for p, offset in start.items():
            await consumer.seek(TopicPartition(topic, p), offset)
        done = {p for p in ends if ends[p] <= start.get(p, 0)}
        while len(done) < len(ends):
            for record in await consumer.getmany(timeout_s=1.0):
                if record.offset < ends[record.partition]:
                    try:
                        out.append(record.value if typed else record)
                    except RlbusError:
                        out.append(record)
                if record.offset + 1 >= ends[record.partition]:
                    done.add(record.partition)
    return out


async def audit(
    *,
    bus: Bus,
    state: StateStore,
    join: JoinBuffer,
    run_id: str | None,
    start: Mapping[str, Mapping[int, int]] | None = None,
    injected: Iterable[str] = (),
) -> Audit:
    """Check the ledger for every rollout of the run (prompt ids starting with ``run_id``; every prompt on
    the topic when None) plus the ``injected`` rollout ids. ``start`` holds per-topic offsets to read
    from (default: the beginning)."""
    start = start or {}
    prompts = [p for p in await read_topic(bus, PROMPTS.name, start.get(PROMPTS.name)) if _ours(p, run_id)]
    expected = {f"{p.prompt_id}/{i}" for p in prompts for i in range(p.group_size)} | set(injected)
    copies = Counter(
        r.rollout_id for r in await read_topic(bus, ROLLOUTS.name, start.get(ROLLOUTS.name)) if hasattr(r, "rollout_id")
    )
    produced = {rid for rid in copies if rid in expected}
    outcomes: Counter[str] = Counter()
    lost, multiple = [], []
    for rollout_id in sorted(expected):
        found = await join.outcome_of(rollout_id)
        if not found:
            lost.append(rollout_id)
        elif len(found) > 1:
            multiple.append(rollout_id)
        for outcome in found:
            outcomes[outcome.value] += 1
    return Audit(
        expected=len(expected),
        produced=len(produced),
        outcomes=dict(outcomes),
        lost=lost,
        multiple_outcomes=multiple,
        trained_again=await state.get_counter(TRAINED_AGAIN),
        log_copies=sum(copies[r] for r in produced) - len(produced),
        counters=await join.counts(),
    )


def _ours(prompt: Any, run_id: str | None) -> bool:
    return hasattr(prompt, "prompt_id") and (run_id is None or str(prompt.prompt_id).startswith(f"{run_id}-"))


def fill(report: ScenarioReport, found: Audit, *, trained_twice_seen: int = 0) -> ScenarioReport:
    """Copy an audit into the report's ledger columns."""
    report.produced = found.produced
    report.trained = found.outcomes.get(Outcome.TRAINED.value, 0)
    report.dropped = found.dropped
    report.dead_lettered = found.counters.get(Outcome.DEAD_LETTERED.value, 0)
    report.lost = len(found.lost)
    # Two independent measures of the same event (the gate's counter, the harness's own count): the larger.
    report.duplicates_trained = max(found.trained_again, trained_twice_seen)
    report.check("every rollout has at most one outcome", not found.multiple_outcomes)
    report.extra.update(expected=found.expected, log_copies=found.log_copies)
    if found.lost:
        report.notes.append(f"lost: {found.lost[:5]}{' …' if len(found.lost) > 5 else ''}")
    if found.multiple_outcomes:
        report.notes.append(f"more than one outcome: {found.multiple_outcomes[:5]}")
    return report
