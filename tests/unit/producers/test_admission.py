"""Admission counts from the version the rollout workers serve, from the version the trainer trains first,
and in groups per *version*: under it no admitted prompt is trained more than max_staleness versions after
the weights it was started with, however far the workers' weight sync lags."""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from typing import Any, cast

import pytest

from rlbus.aio import until
from rlbus.bus import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.errors import ConfigError
from rlbus.launch.arguments import producer_args
from rlbus.launch.config import config_from_dict
from rlbus.launch.roles import beat_on_swap
from rlbus.observe.heartbeat import Heartbeat
from rlbus.producers.prompts import (
    Admission,
    Progress,
    PromptProducer,
    lowest_served,
    progress_from_state,
    task_prompts,
)
from rlbus.state import MemoryStateStore
from rlbus.state.base import WorkerRecord
from rlbus.state.progress import VERSION_COUNTER
from rlbus.wiring.producer import prompt_producer


def test_the_window_counts_from_the_lowest_version_served() -> None:
    rule = Admission(max_staleness=2, groups_per_step=2)
    at = {served: rule.window(Progress(version=5, groups_done=0, served=served), base_version=5)
          for served in (None, 7, 5, 4, 3, 2, 1)}
    # (reference − base + 2 + 1) × 2, reference = min(published, served); never below 0
    assert at == {None: 6, 7: 6, 5: 6, 4: 4, 3: 2, 2: 0, 1: 0}
    assert rule.allows(3, Progress(version=5, groups_done=0, served=4), base_version=5)
    assert not rule.allows(4, Progress(version=5, groups_done=0, served=4), base_version=5)


def test_slack_budgets_lag_the_reference_cannot_see() -> None:
    progress = Progress(version=3, groups_done=0)
    assert [Admission(max_staleness=2, groups_per_step=4, slack=s).window(progress, base_version=1)
            for s in (0, 1, 2)] == [20, 16, 12]
    for slack in (-1, 3):  # beyond max_staleness nothing would be admitted at the start: a stalled run
        with pytest.raises(ValueError, match="slack"):
            Admission(max_staleness=2, slack=slack)
    with pytest.raises(ValueError, match="groups_per_step"):
        Admission(groups_per_step=0)


def record(version: object, status: str = "running", worker_id: str = "w") -> WorkerRecord:
    return {"role": "rollout", "worker_id": worker_id, "info": {"version": version, "status": status},
            "last_seen": 0.0}


def test_lowest_served_ignores_workers_without_weights_or_stopping() -> None:
    assert lowest_served([]) is None
    assert lowest_served([record(None), record(True), record("3")]) is None
    assert lowest_served([record(4), record(2, status="stopping"), record(None), record(6)]) == 4


def simulate(rule: Admission, *, follow_served: bool, seed: int, prompts: int = 48, workers: int = 3) -> list[int]:
    """A seeded run of the pipeline's version arithmetic: the trainer publishes v1 first and then one version
    per batch of ``rule.groups_per_step`` prompts, in prompt order; each worker starts prompts on the version
    it holds and syncs to the newest one a version at a time, at random moments (the lag admission must
    survive). Returns each prompt's staleness when trained: trainer version − version it was started on."""
    rng = random.Random(seed)
    batch, trainer, base = rule.groups_per_step, 1, 1
    held = [1] * workers
    admitted, waiting = 0, deque[int]()
    started: dict[int, int] = {}
    staleness: list[int] = []
    for _ in range(100_000):
        if len(staleness) >= prompts:
            return staleness
        progress = Progress(trainer, len(staleness), min(held) if follow_served else None)
        while admitted < prompts and rule.allows(admitted, progress, base_version=base):
            waiting.append(admitted)
            admitted += 1
        worker = rng.randrange(workers)
        if held[worker] < trainer and rng.random() < 0.15:
            held[worker] += 1
        elif waiting and rng.random() < 0.5:
            started[waiting.popleft()] = held[worker]
        batch_ids = range(len(staleness), len(staleness) + batch)
        if all(n in started for n in batch_ids) and rng.random() < 0.5:
            staleness += [trainer - started[n] for n in batch_ids]
            trainer += 1
    raise AssertionError("the simulated run stalled")


def test_counting_from_the_served_version_keeps_every_prompt_within_the_bound() -> None:
    rule = Admission(max_staleness=2, groups_per_step=2)
    for seed in range(20):
        assert max(simulate(rule, follow_served=True, seed=seed)) <= 2, seed
    # Counting from the published version, the same runs start prompts on weights the bound did not assume.
    assert max(max(simulate(rule, follow_served=False, seed=seed)) for seed in range(20)) > 2


async def test_the_producer_follows_the_registry_and_starts_from_the_first_trained_version() -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    state = MemoryStateStore()
    read = progress_from_state(state, served_by="rollout")
    producer = PromptProducer(
        bus=bus, prompts=task_prompts("arith", seed=0, group_size=2), admission=Admission(max_staleness=1,
                                                                                           groups_per_step=2),
        progress=read, first_version=1, poll_s=0.005,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(producer.run(stop))

    async def settles_at(count: int) -> None:  # admitted reaches count, then the producer waits
        deadline = time.monotonic() + 30  # a loaded CI machine
        waits = producer.waits
        while not (producer.admitted == count and producer.waits > waits + 2):
            assert producer.admitted <= count and time.monotonic() < deadline, producer.stats()
            await asyncio.sleep(0.005)

    # No trainer version yet: it trains its first step at v1, so (0 − 1 + 1 + 1) × 2 prompts, not 4.
    await settles_at(2)
    await state.incr(VERSION_COUNTER)  # v1 published
    await settles_at(4)
    await state.incr(VERSION_COUNTER)  # v2 published, but one worker still serves v1 and one has no weights
    await state.heartbeat("rollout", "a", {"version": 2, "status": "running"}, 10)
    await state.heartbeat("rollout", "b", {"version": 1, "status": "running"}, 10)
    await state.heartbeat("rollout", "c", {"version": None, "status": "running"}, 10)
    await settles_at(4)
    assert producer.sync_waits > 0 and producer.stats()["reference_version"] == 1
    await state.heartbeat("rollout", "b", {"version": 2, "status": "running"}, 10)
    await settles_at(6)
    assert (await read()).served == 2
    stop.set()
    await task
    await bus.close()


def test_the_distributed_bound_counts_groups_per_version_and_names_its_fields() -> None:
    config = config_from_dict({"trainer": {"groups_per_step": 3, "publish_every": 4, "admission_slack": 1,
                                           "grpo": {"max_staleness": 1}}}, {})
    assert config.trainer.admission == "served"
    producer = prompt_producer(bus=MemoryBus(), state=MemoryStateStore(), **producer_args(config))
    assert producer.admission == Admission(max_staleness=1, groups_per_step=12, slack=1)
    for table, field in (({"admission_slack": 3}, "trainer.admission_slack"),
                         ({"admission_slack": -1}, "trainer.admission_slack"),
                         ({"admission": "trainer"}, "trainer.admission")):
        with pytest.raises(ConfigError) as info:
            config_from_dict({"trainer": table}, {})
        assert info.value.field == field


async def test_a_rollout_worker_beats_as_soon_as_it_swaps_a_version_in() -> None:
    class Sync:
        version: int | None = None

    sync, state = Sync(), MemoryStateStore()
    heartbeat = Heartbeat(state=state, role="rollout", worker_id="r", info=lambda: {"version": sync.version},
                          every_s=60, ttl_s=120)  # the periodic beat would come a minute late
    stop = asyncio.Event()
    task = asyncio.create_task(beat_on_swap(cast(Any, sync), heartbeat, stop, every_s=0.005))

    async def registered(version: int) -> bool:
        return lowest_served(await state.workers("rollout")) == version

    for version in (1, 2):
        sync.version = version
        await until(lambda v=version: registered(v), f"v{version} registered", every_s=0.005)
    stop.set()
    await task
    assert heartbeat.beats == 2
