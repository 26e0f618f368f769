"""Heartbeats in the worker registry, and the workers' ``stats()`` they carry."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace
from typing import Any

import pytest

from rlbus.aio import until
from rlbus.bus import MemoryBus
from rlbus.bus.topics import PROMPTS, topic_specs
from rlbus.consumers.reward import RewardWorker
from rlbus.consumers.rollout import RolloutWorker
from rlbus.consumers.trainer import TrainerWorker
from rlbus.errors import StateError
from rlbus.observe.heartbeat import Heartbeat
from rlbus.producers.prompts import Admission, Progress, PromptProducer, task_prompts
from rlbus.state.memory import MemoryStateStore


async def test_a_beat_carries_identity_info_and_throughput() -> None:
    state = MemoryStateStore()
    now = [100.0]
    processed = [10]
    beat = Heartbeat(
        state=state, role="rollout", worker_id="r-1", region="eu-west",
        info=lambda: {"processed": processed[0], "version": 4, "swap_pause_ms": [0.1, 0.2]}, clock=lambda: now[0],
    )
    now[0] = 105.0
    await beat.beat()
    (record,) = await state.workers("rollout")
    info = record["info"]
    assert (record["role"], record["worker_id"]) == ("rollout", "r-1")
    assert info["region"] == "eu-west" and info["pid"] == os.getpid() and info["host"]
    assert info["started_at"] == 100.0 and info["uptime_s"] == 5.0 and info["rlbus_version"]
    assert info["version"] == 4 and info["swap_pause_ms"] == [0.1, 0.2] and info["status"] == "running"
    assert info["throughput"] == pytest.approx(2.0)  # 10 since start, over 5 s
    now[0], processed[0] = 110.0, 30
    await beat.beat()
    assert (await state.workers("rollout"))[0]["info"]["throughput"] == pytest.approx(3.0)  # 30 in 10 s
    now[0] = 160.0  # idle for 50 s: the 30 s window starts at the beat of t=110
    await beat.beat()
    assert (await state.workers("rollout"))[0]["info"]["throughput"] == 0.0
    now[0], processed[0] = 170.0, 50
    await beat.beat()
    # the window reaches back to the last beat at or before its start (t=110)
    assert (await state.workers("rollout"))[0]["info"]["throughput"] == pytest.approx(20 / 60)


async def test_run_beats_until_stopped_then_says_it_is_stopping() -> None:
    state = MemoryStateStore()
    beat = Heartbeat(state=state, role="reward", worker_id="w", every_s=0.02, ttl_s=5)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(beat.run(stop))
        await until(lambda: beat.beats >= 3, "three beats")
        stop.set()
    assert beat.beats >= 3
    (record,) = await state.workers()
    assert record["info"]["status"] == "stopping"


class FlakyStore(MemoryStateStore):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def heartbeat(self, role: str, worker_id: str, info: dict[str, Any], ttl_s: float) -> None:
        if self.failures:
            self.failures -= 1
            raise StateError("redis heartbeat failed: connection refused")
        await super().heartbeat(role, worker_id, info, ttl_s)


async def test_an_unreachable_store_or_broken_info_costs_a_beat_not_the_worker() -> None:
    state = FlakyStore(failures=1)

    def broken() -> dict[str, Any]:
        raise RuntimeError("stats exploded")

    beat = Heartbeat(state=state, role="trainer", worker_id="t", info=broken)
    assert await beat.beat() is None
    assert await state.workers() == []
    payload = await beat.beat()
    assert payload is not None and "stats exploded" in payload["info_error"]
    assert len(await state.workers("trainer")) == 1


async def test_non_finite_numbers_are_stored_as_null() -> None:
    state = MemoryStateStore()
    beat = Heartbeat(state=state, role="trainer", worker_id="t",
                     info=lambda: {"last_step": {"kl_k3": float("nan"), "staleness": {0: 3}}})
    await beat.beat()
    info = (await state.workers())[0]["info"]
    assert info["last_step"] == {"kl_k3": None, "staleness": {"0": 3}}


def test_ttl_must_outlast_the_interval() -> None:
    with pytest.raises(ValueError, match="ttl_s > every_s"):
        Heartbeat(state=MemoryStateStore(), role="r", worker_id="w", every_s=5, ttl_s=5)


async def test_worker_stats_are_what_a_heartbeat_needs() -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    state = MemoryStateStore()

    producer = PromptProducer(
        bus=bus, prompts=task_prompts("arith", seed=1, group_size=2),
        admission=Admission(max_staleness=0, groups_per_step=2), progress=lambda: _progress(), limit=5, poll_s=0.01,
    )
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        run = tasks.create_task(producer.run(stop))
        await until(lambda: producer.waits >= 1, "the producer held back by admission")
        stop.set()
    assert run.done()
    stats = producer.stats()
    assert stats["processed"] == stats["admitted"] == 2  # admission holds the rest back
    assert stats["waits"] >= 1 and stats["topics"] == [PROMPTS.name]

    rollout = RolloutWorker(bus=bus, engine=SimpleNamespace(policy_version=3), chat=None,  # type: ignore[arg-type]
                            worker_id="r-0")
    assert rollout.stats() | {"busy_s": 0} == {
        "group": "rollout", "topics": [PROMPTS.name], "processed": 0, "rollouts": 0, "busy_s": 0, "version": 3,
        "dead_letters": 0, "lag": 0,
    }
    assert RewardWorker(bus=bus, kind="judge-x").stats()["group"] == "reward-judge-x"

    trainer = SimpleNamespace(step=2, version=1)
    worker = TrainerWorker(bus=bus, trainer=trainer, join=None, state=state)  # type: ignore[arg-type]
    worker.steps += [{"rollouts": 4, "kl_k3": 0.5, "is_ess": 0.9, "step": 1}, {"rollouts": 6, "kl_k3": 0.25}]
    stats = worker.stats()
    assert stats["processed"] == stats["rollouts_trained"] == 10
    assert (stats["step"], stats["version"], stats["group"]) == (2, 1, "trainer")
    assert stats["last_step"] == {"kl_k3": 0.25, "rollouts": 6}

    beat = Heartbeat(state=state, role="trainer", worker_id="t", info=worker.stats)
    assert (await beat.beat() or {})["last_step"]["kl_k3"] == 0.25


async def _progress() -> Progress:
    return Progress(version=0, groups_done=0)
