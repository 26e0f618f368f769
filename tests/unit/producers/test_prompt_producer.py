"""Admission control bounds how far prompt production runs ahead of the trainer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rlbus.aio import until
from rlbus.bus import MemoryBus
from rlbus.bus.topics import PROMPTS, topic_specs
from rlbus.producers.prompts import (
    Admission,
    Progress,
    PromptProducer,
    progress_from_state,
    task_prompts,
)
from rlbus.state import MemoryStateStore
from rlbus.state.progress import GROUPS_DONE_COUNTER, VERSION_COUNTER


def test_admission_rule() -> None:
    rule = Admission(max_staleness=1, groups_per_step=4, max_in_flight=6)
    assert rule.allows(7, Progress(version=0, groups_done=2))
    assert not rule.allows(8, Progress(version=0, groups_done=8))  # (0 + 1 + 1) × 4 = 8 ahead is the cap
    assert not rule.allows(6, Progress(version=5, groups_done=0))  # 6 in flight
    assert rule.allows(6, Progress(version=5, groups_done=1))


async def test_producer_waits_for_the_trainer_then_resumes() -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    state = MemoryStateStore()
    producer = PromptProducer(
        bus=bus,
        prompts=task_prompts("arith", seed=0, group_size=4),
        admission=Admission(max_staleness=1, groups_per_step=3),
        progress=progress_from_state(state),
        poll_s=0.01,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(producer.run(stop))
    await settled(lambda: producer.admitted >= 6 and producer.waits > 0)
    assert producer.admitted == 6  # (0 + 1 + 1) × 3
    await state.incr(VERSION_COUNTER)
    await state.incr(GROUPS_DONE_COUNTER, 3)
    await settled(lambda: producer.admitted >= 9)
    assert producer.admitted == 9
    stop.set()
    await task
    ends = await bus.end_offsets(PROMPTS.name)
    assert sum(ends.values()) == 9
    async with bus.consumer([PROMPTS], group=None) as consumer:
        prompts = [r.value for r in await consumer.getmany(timeout_s=0.1)]
    assert len({p.prompt_id for p in prompts}) == 9
    assert all(p.group_size == 4 and p.env == "arith" and p.reference for p in prompts)
    assert sorted(p.policy_version for p in prompts) == [0] * 6 + [1] * 3


async def test_the_bound_counts_versions_since_the_producer_started() -> None:
    """A trainer resumed at version 57 (or one that published its initial weights as v1) does not open
    the gate 57 batches wide: only versions published after the producer started count."""
    bus = MemoryBus(topic_specs())
    await bus.start()
    state = MemoryStateStore()
    await state.incr(VERSION_COUNTER, 57)
    producer = PromptProducer(
        bus=bus, prompts=task_prompts("arith", seed=0, group_size=2),
        admission=Admission(max_staleness=0, groups_per_step=2), progress=progress_from_state(state), poll_s=0.01,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(producer.run(stop))
    await settled(lambda: producer.admitted >= 2 and producer.waits > 0)
    assert producer.admitted == 2  # one batch for the current version: synchronous RL
    await state.incr(VERSION_COUNTER)
    await settled(lambda: producer.admitted >= 4)
    assert producer.admitted == 4
    stop.set()
    await task


async def settled(condition: Callable[[], bool]) -> None:
    """Wait until ``condition`` holds (up to 30 s on a loaded machine), then 0.2 s more, in which a
    producer that admits too much would go past the count the caller asserts."""
    await until(condition, "the producer's admissions")
    await asyncio.sleep(0.2)
