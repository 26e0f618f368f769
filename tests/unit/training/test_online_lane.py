"""The trainer's online lane on the embedded bus: served rollouts train when their user rewards arrive,
a version every N rewards or T seconds (whichever first), the age bound in wall time and the version bound,
a mixed run (GRPO groups and served rollouts side by side), and the per-key baselines surviving a restart."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from rlbus.bus import MemoryBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.consumers.trainer import TrainerWorker
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.schemas import Reward, Rollout, TensorData
from rlbus.state import MemoryStateStore, StateStore
from rlbus.training.config import GRPOConfig, OnlineConfig, OptimConfig
from rlbus.training.join import ROLLED_BACK, TRAINED_AGAIN, JoinBuffer, Outcome, RewardPolicy, ServedJoin
from rlbus.training.online_lane import OnlineLane
from rlbus.training.ordered import OrderedJoin
from rlbus.training.trainer import Trainer

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)
NOW = 1_700_000_000.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def rollout(rid: str, *, prompt: str = "arith", version: int = 0, created_at: float = NOW, served: bool = True,
            index: int = 0, size: int = 1) -> Rollout:
    rng = np.random.default_rng(abs(hash(rid)) % 2**32)
    mask = np.zeros(10, dtype=np.uint8)
    mask[4:] = 1
    return Rollout(
        rollout_id=rid, prompt_id=prompt, group_index=index, group_size=size,
        token_ids=TensorData.from_numpy(rng.integers(0, 256, 10).astype(np.int32)),
        loss_mask=TensorData.from_numpy(mask),
        logprobs=TensorData.from_numpy(np.where(mask == 1, -5.5, 0.0).astype(np.float32)),
        token_versions=TensorData.from_numpy(np.where(mask == 1, version, -1).astype(np.int32)),
        created_at=created_at, metadata={"origin": "served", "tenant": "acme", "session_id": rid} if served else {},
    )


def reward(rid: str, value: float, *, source: str = "user", prompt: str = "arith") -> Reward:
    return Reward(reward_id=uuid.uuid4().hex, rollout_id=rid, prompt_id=prompt, source=source, value=value)


class Rig:
    """A trainer worker with an online lane whose cadence clock and wall clock the test moves."""

    def __init__(self, bus: MemoryBus, state: StateStore, config: OnlineConfig) -> None:
        self.clock, self.wall = Clock(0.0), Clock(NOW)
        torch.manual_seed(0)
        trainer = Trainer(model=Policy(CFG), optim=OptimConfig(lr=1e-2), grpo=GRPOConfig(max_staleness=2))
        join = JoinBuffer(state=state, policy=RewardPolicy(sources=("verifier",), timeout_s=600))
        served = ServedJoin(ledger=join, state=state, sources=config.sources, max_age_s=config.max_age_s,
                            clock=self.wall)
        self.lane = OnlineLane(join=served, state=state, config=config, clock=self.clock, wall=self.wall)
        self.worker = TrainerWorker(bus=bus, trainer=trainer, join=join, state=state, groups_per_step=1,
                                    expire_every_s=0.05, online=self.lane)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Rig:
        self.task = asyncio.create_task(self.worker.run(self.stop))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await self.task


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    instance = MemoryBus(topic_specs())
    await instance.start()
    yield instance
    await instance.close()


async def test_a_version_every_n_rewards_or_t_seconds_whichever_first(bus: MemoryBus) -> None:
    state = MemoryStateStore()
    config = OnlineConfig(enabled=True, release_every_rewards=3, release_every_s=300.0, min_count=0)
    async with Rig(bus, state, config) as rig:
        for i in range(3):
            await bus.send(ROLLOUTS, rollout(f"s{i}"))
        for i in range(3):
            await bus.send(REWARDS, reward(f"s{i}", float(i % 2)))
        await until(lambda: len(rig.worker.steps) == 1, "the release at 3 rewards")
        first = rig.worker.steps[-1]
        assert (first["online_samples"], first["published"], rig.worker.trainer.version) == (3, True, 1)
        for i in range(3, 5):
            await bus.send(ROLLOUTS, rollout(f"s{i}"))
            await bus.send(REWARDS, reward(f"s{i}", 1.0))
        await until(lambda: len(rig.lane.ready) == 2, "two rewarded samples waiting")
        assert not rig.lane.due() and rig.worker.trainer.step == 1  # 2 < 3 rewards, 0 of 300 s
        rig.clock.now += 301  # the interval passes: release what waits
        await until(lambda: len(rig.worker.steps) == 2, "the release at 300 s")
        assert rig.worker.steps[-1]["online_samples"] == 2 and rig.worker.trainer.version == 2
        assert rig.lane.totals == {"samples": 5, "dropped_age": 0, "dropped_stale": 0, "releases": 2}
    counts = await rig.worker.join.counts()
    assert counts["trained"] == 5
    for i in range(5):
        assert await rig.worker.join.outcome_of(f"s{i}") == [Outcome.TRAINED]
    assert await state.field_names(rig.lane.join.ready_key) == set()  # forgotten once trained


async def test_the_age_bound_in_wall_time_and_the_version_bound(bus: MemoryBus) -> None:
    state = MemoryStateStore()
    config = OnlineConfig(enabled=True, release_every_rewards=3, max_age_s=3600.0, max_staleness=4)
    rig = Rig(bus, state, config)
    rig.worker.trainer.continue_after(10)  # the trainer is at v10
    await bus.send(ROLLOUTS, rollout("fresh", version=9, created_at=NOW - 60))
    await bus.send(ROLLOUTS, rollout("aged", version=9, created_at=NOW - 3700))  # rated, but > max_age_s old
    await bus.send(ROLLOUTS, rollout("behind", version=5, created_at=NOW - 60))  # 5 versions behind > 4
    for rid in ("fresh", "aged", "behind"):
        await bus.send(REWARDS, reward(rid, 1.0))
    async with rig:
        await until(lambda: len(rig.worker.steps) == 1, "the release")
    metrics = rig.worker.steps[-1]
    assert metrics["online_samples"] == 1 and metrics["online_dropped_age_total"] == 1
    assert metrics["online_dropped_stale_total"] == 1 and rig.worker.trainer.version == 11
    assert await rig.worker.join.outcome_of("aged") == [Outcome.TOO_OLD]
    assert await rig.worker.join.outcome_of("behind") == [Outcome.STALE]
    assert await rig.worker.join.outcome_of("fresh") == [Outcome.TRAINED]


async def test_a_release_where_everything_is_too_old_trains_nothing(bus: MemoryBus) -> None:
    state = MemoryStateStore()
    config = OnlineConfig(enabled=True, release_every_rewards=1, max_age_s=60.0)
    async with Rig(bus, state, config) as rig:
        await bus.send(ROLLOUTS, rollout("late", created_at=NOW - 61))
        await bus.send(REWARDS, reward("late", 1.0))
        await until(lambda: rig.lane.totals["dropped_age"] == 1, "the drop")
        assert rig.worker.trainer.step == 0 and rig.worker.trainer.version == 0
    assert await rig.worker.join.outcome_of("late") == [Outcome.TOO_OLD]


async def test_a_mixed_run_trains_groups_with_grpo_and_served_rollouts_online(bus: MemoryBus) -> None:
    state = MemoryStateStore()
    config = OnlineConfig(enabled=True, release_every_rewards=2, min_count=0)
    async with Rig(bus, state, config) as rig:
        for i in range(2):  # a GRPO group of two, scored by the verifier
            await bus.send(ROLLOUTS, rollout(f"g/{i}", prompt="g", served=False, index=i, size=2))
            await bus.send(REWARDS, reward(f"g/{i}", float(i), source="verifier", prompt="g"))
        for rid in ("u1", "u2"):  # two served completions, thumbs from users; one user reward for g/0 as well
            await bus.send(ROLLOUTS, rollout(rid, prompt="task-a"))
            await bus.send(REWARDS, reward(rid, 1.0 if rid == "u1" else 0.0))
        await bus.send(REWARDS, reward("g/0", 1.0, prompt="g"))
        await until(lambda: len(rig.worker.steps) == 2, "a GRPO step and an online step")
    online = [m for m in rig.worker.steps if "online_samples" in m]
    grpo = [m for m in rig.worker.steps if "online_samples" not in m]
    assert len(online) == 1 and len(grpo) == 1
    assert online[0]["rollouts"] == 2 and grpo[0]["rollouts"] == 2
    # EMA (α 0.1) from 0.5: A = 1 − 0.5 = 0.5, then b = 0.55 and A = 0 − 0.55: mean −0.025
    assert online[0]["online_advantage_mean"] == pytest.approx(-0.025)
    counts = await rig.worker.join.counts()
    assert counts["trained"] == 4 and counts["dropped_stale"] == 0


async def test_the_baselines_survive_a_trainer_restart(bus: MemoryBus) -> None:
    state = MemoryStateStore()
    config = OnlineConfig(enabled=True, release_every_rewards=2, min_count=1, ema=0.5)
    async with Rig(bus, state, config) as rig:
        for rid in ("a", "b"):
            await bus.send(ROLLOUTS, rollout(rid, prompt="task-a"))
            await bus.send(REWARDS, reward(rid, 1.0))
        await until(lambda: len(rig.worker.steps) == 1, "the release")
    before = rig.lane.baseline.value("task:task-a")
    assert before == pytest.approx(0.875)  # 0.5 → 0.75 → 0.875
    again = Rig(bus, state, config)
    await again.lane.load()
    assert again.lane.baseline.value("task:task-a") == pytest.approx(before)


async def test_a_served_group_of_several_choices_stays_on_the_grpo_join(bus: MemoryBus) -> None:
    """n > 1 choices of one request are one GRPO group (the gateway's contract): not single samples."""
    state = MemoryStateStore()
    async with Rig(bus, state, OnlineConfig(enabled=True, release_every_rewards=1)) as rig:
        for i in range(2):
            await bus.send(ROLLOUTS, rollout(f"cmpl-x/{i}", prompt="cmpl-x", index=i, size=2))
            await bus.send(REWARDS, reward(f"cmpl-x/{i}", float(i), source="verifier", prompt="cmpl-x"))
        await until(lambda: len(rig.worker.steps) == 1, "the GRPO step")
    assert "online_samples" not in rig.worker.steps[0] and rig.worker.steps[0]["rollouts"] == 2
    assert rig.lane.totals["samples"] == 0


async def test_a_crash_between_checkpoints_trains_the_served_rollouts_again(bus: MemoryBus, tmp_path: Path) -> None:
    """With the ordered join and checkpoints, served rollouts count as trained once a checkpoint holds
    their step; a crash after an uncheckpointed online step releases them to be trained once more."""
    state = MemoryStateStore()
    config = OnlineConfig(enabled=True, release_every_rewards=2, min_count=0)

    def worker() -> tuple[TrainerWorker, OnlineLane]:
        torch.manual_seed(0)
        trainer = Trainer(model=Policy(CFG), optim=OptimConfig(lr=1e-3), grpo=GRPOConfig(max_staleness=100),
                          checkpoint_dir=tmp_path, checkpoint_every=2)
        join = OrderedJoin(state=state, policy=RewardPolicy(sources=("verifier",)), batch=1)
        served = ServedJoin(ledger=join, state=state, sources=("user",), max_age_s=3600.0, clock=lambda: NOW)
        lane = OnlineLane(join=served, state=state, config=config, wall=lambda: NOW)
        return TrainerWorker(bus=bus, trainer=trainer, join=join, state=state, groups_per_step=1,
                             expire_every_s=0.05, online=lane), lane

    first, _ = worker()
    assert first.holds
    stop = asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    for step in range(3):
        for i in range(2):
            rid = f"s{step}-{i}"
            await bus.send(ROLLOUTS, rollout(rid))
            await bus.send(REWARDS, reward(rid, float(i)))
        await until(lambda n=step: len(first.steps) == n + 1, f"online step {step + 1}")
    task.cancel()  # a crash: step 3 is in no checkpoint
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert (await first.join.counts())["trained"] == 4

    second, lane = worker()
    await second.trainer.restore()
    assert second.trainer.step == 2
    stop = asyncio.Event()
    task = asyncio.create_task(second.run(stop))
    await until(lambda: len(second.steps) == 1, "step 3's served rollouts trained again")
    stop.set()
    await task
    await second.checkpoint()
    assert second.steps[0]["online_samples"] == 2
    for step in range(3):
        for i in range(2):
            assert await second.join.outcome_of(f"s{step}-{i}") == [Outcome.TRAINED]
    assert await state.get_counter(ROLLED_BACK) == 2 and await state.get_counter(TRAINED_AGAIN) == 0
    assert second.trainer.rollouts_trained == 6  # each served rollout's update exactly once in the model
    await lane.join.expire()
    assert await state.field_names(lane.join.ready_key) == set()  # forgotten once final
