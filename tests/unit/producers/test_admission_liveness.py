"""Admission cannot deadlock: groups that end untrained free their slots, and the staleness bound still holds.

A seeded model of the loop's version arithmetic drives the real `Admission` rule: a producer admitting
prompts, rollout workers that start each prompt on the version they hold and sync at their own pace (some
of them frozen for a while, as a worker whose first delta is still JIT-compiling, a far region or a GC
pause), a join that drops some groups whole (timed out, incomplete, dead-lettered) and a trainer that takes
``groups_per_step`` groups in prompt order, drops stale rollouts and steps only when something is left.
Hypothesis searches the delays, freezes and drops for a run that stops making progress, or (counting from
the served version) for a rollout trained beyond ``max_staleness``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from rlbus.bus import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.producers.prompts import Admission, Progress, PromptProducer, progress_from_state, task_prompts
from rlbus.state import MemoryStateStore
from rlbus.state.progress import GROUPS_FREED_COUNTER, VERSION_COUNTER


class WithoutCredit(Admission):
    """The admission rule before freed groups were credited: a group that ended untrained kept its slot."""

    def window(self, progress: Progress, *, base_version: int = 0) -> int:
        return super().window(dataclasses.replace(progress, groups_freed=0), base_version=base_version)


@dataclass
class Run:
    """What a simulated run did."""

    steps: int = 0
    ticks: int = 0
    admitted: int = 0
    freed: int = 0
    dropped_stale: int = 0
    staleness: list[int] = field(default_factory=list)


def simulate(
    rule: Admission,
    *,
    seed: int,
    workers: int,
    follow_served: bool,
    freeze: dict[int, int],
    drop_rate: float,
    steps: int = 20,
    ticks: int = 4000,
) -> Run:
    """Run until the trainer has taken ``steps`` steps or ``ticks`` ticks have passed. ``freeze`` maps a
    worker to the tick its weight sync resumes (it keeps generating on what it holds meanwhile)."""
    rng = random.Random(seed)
    gps, base = rule.groups_per_step, 1
    version, held = 1, [1] * workers  # the trainer publishes v1 before its first step
    run = Run()
    done = 0
    waiting: list[int] = []  # admitted, not started
    started: dict[int, int] = {}  # prompt → version it was started on
    finish_at: dict[int, int] = {}  # prompt → tick its group is complete (or dropped whole)
    dropped_whole: set[int] = set()  # will be dropped whole at the join, once their time has come
    left_order: set[int] = set()  # dropped whole: the trainer's order passes over them
    cursor = 0  # the next prompt in the trainer's order
    for tick in range(ticks):
        run.ticks = tick
        if run.steps >= steps:
            return run
        served = min(held) if follow_served else None
        progress = Progress(version, done, served, run.freed)
        while rule.allows(run.admitted, progress, base_version=base):
            waiting.append(run.admitted)
            run.admitted += 1
        for w in range(workers):
            if held[w] < version and tick >= freeze.get(w, 0) and rng.random() < 0.3:
                held[w] += 1  # one version at a time, as deltas
            if waiting and rng.random() < 0.5:
                prompt = waiting.pop(0)
                started[prompt] = held[w]
                finish_at[prompt] = tick + rng.randint(1, 6)
                if rng.random() < drop_rate:
                    dropped_whole.add(prompt)
        # the join drops a group whole at its timeout: it leaves the order and frees its slot at once
        for prompt in [p for p in dropped_whole if finish_at[p] <= tick]:
            dropped_whole.discard(prompt)
            left_order.add(prompt)
            done += 1
            run.freed += 1
        batch: list[int] = []
        probe = cursor
        while len(batch) < gps and probe in finish_at and (finish_at[probe] <= tick or probe in left_order):
            if probe not in left_order:
                batch.append(probe)
            probe += 1
        if len(batch) < gps or rng.random() < 0.3:  # the trainer is busy this tick, or the batch is not whole
            continue
        cursor = probe
        fresh = [p for p in batch if version - started[p] <= rule.max_staleness]
        run.dropped_stale += len(batch) - len(fresh)
        done += gps
        if fresh:
            run.staleness += [version - started[p] for p in fresh]
            run.steps += 1
            version += 1
        else:  # a step that trained nothing: the groups did not move the trainer towards a version
            run.freed += gps
    return run


runs = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1),
    "workers": st.integers(1, 4),
    "follow_served": st.booleans(),
    "drop_rate": st.sampled_from([0.0, 0.05, 0.3]),
    "freeze": st.dictionaries(st.integers(0, 3), st.integers(0, 400), max_size=4),
})
rules = st.integers(0, 3).flatmap(lambda ms: st.builds(
    Admission, max_staleness=st.just(ms), groups_per_step=st.integers(1, 4), slack=st.integers(0, ms)))


@settings(max_examples=300, deadline=None)
@given(rule=rules, run=runs)
def test_the_run_always_makes_progress_and_keeps_the_bound(rule: Admission, run: dict) -> None:
    result = simulate(rule, **run)
    assert result.steps >= 20, result
    assert max(result.staleness) <= rule.max_staleness  # the trainer's own check, never relaxed
    if run["follow_served"]:  # counting from the served version, nothing is ever stale
        assert result.dropped_stale == 0, result


def test_the_first_run_stall_deadlocked_without_the_credit() -> None:
    """The demo's first run: every worker's weight sync stalls (its codec kernels compiling) while the
    trainer, counting admission from its published version, steps on v1 rollouts; the next v1 rollouts
    arrive too stale and are dropped. Without the credit the window never reopens."""
    stall = {"seed": 7, "workers": 3, "follow_served": False, "drop_rate": 0.0, "freeze": {0: 60, 1: 60, 2: 60}}
    rule = Admission(max_staleness=2, groups_per_step=4)
    before = simulate(WithoutCredit(max_staleness=2, groups_per_step=4), **stall)
    after = simulate(rule, **stall)
    assert before.steps < 20 and before.dropped_stale > 0 and before.ticks == 3999, before  # dead for good
    assert after.steps == 20 and after.freed > 0, after


def test_groups_dropped_whole_at_the_join_deadlocked_without_the_credit() -> None:
    """Even counting from the served version (no stale drops at all), groups the join drops whole held
    their slots: a run that loses more than a window's worth stopped admitting."""
    lossy = {"seed": 3, "workers": 2, "follow_served": True, "drop_rate": 0.3, "freeze": {}}
    before = simulate(WithoutCredit(max_staleness=1, groups_per_step=2), **lossy)
    after = simulate(Admission(max_staleness=1, groups_per_step=2), **lossy)
    assert before.steps < 20 and before.dropped_stale == 0, before
    assert after.steps == 20 and after.dropped_stale == 0, after


async def test_the_producer_credits_the_groups_freed_since_it_started() -> None:
    """A restarted producer must not open the window by the run's past: only groups freed after its start
    count, one slot each."""
    bus, state = MemoryBus(topic_specs()), MemoryStateStore()
    await bus.start()
    await state.incr(VERSION_COUNTER)
    await state.incr(GROUPS_FREED_COUNTER, 5)  # freed before this producer started
    producer = PromptProducer(bus=bus, prompts=task_prompts("arith", seed=0, group_size=2),
                              admission=Admission(max_staleness=1, groups_per_step=1),
                              progress=progress_from_state(state), first_version=1, poll_s=0.005)
    stop = asyncio.Event()
    task = asyncio.create_task(producer.run(stop))

    async def settles_at(count: int) -> None:
        deadline, waits = time.monotonic() + 30, producer.waits
        while not (producer.admitted == count and producer.waits > waits + 2):
            assert producer.admitted <= count and time.monotonic() < deadline, producer.stats()
            await asyncio.sleep(0.005)

    await settles_at(2)  # (1 − 1 + 1 + 1) × 1: the run's earlier 5 freed groups are not this producer's credit
    await state.incr(GROUPS_FREED_COUNTER, 3)  # three of its groups ended untrained
    await settles_at(5)
    assert producer.stats()["freed"] == 3
    stop.set()
    await task
    await bus.close()
