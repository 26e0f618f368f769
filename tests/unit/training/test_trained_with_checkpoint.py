"""Trained with the checkpoint: the ledger calls a rollout trained only once a checkpoint holds its step,
so a trainer that crashes between checkpoints trains those rollouts again (their update died with it)
and one that crashes right after a checkpoint does not (rlbus/training/join.py, "Trained with the
checkpoint")."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbus.aio import until
from rlbus.bus import MemoryBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.consumers.trainer import TrainerWorker
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.schemas import Reward, Rollout, TensorData
from rlbus.state import MemoryStateStore
from rlbus.training.join import ROLLED_BACK, TRAINED_AGAIN, JoinBuffer, Outcome, RewardPolicy
from rlbus.training.ordered import OrderedJoin
from rlbus.training.step import GRPOConfig, OptimConfig
from rlbus.training.trainer import Trainer

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


async def test_held_rollouts_become_trained_only_with_their_checkpoint() -> None:
    state = MemoryStateStore()
    join = JoinBuffer(state=state, policy=RewardPolicy())
    await join.hold(1, ["a/0", "a/1"])
    await join.hold(2, ["b/0", "b/1"])
    assert await join.outcome_of("a/0") == []  # held: no outcome yet
    assert await join.settle(1) == 2
    assert await join.outcome_of("a/0") == [Outcome.TRAINED]
    assert await join.outcome_of("b/0") == []

    # The process dies; its successor restored the checkpoint of step 1: b's update is gone.
    again = await JoinBuffer(state=state, policy=RewardPolicy()).recover(1)
    assert again == ["b/0", "b/1"]
    assert await state.get_fields(join.held_key) == {}
    assert await join.outcome_of("b/0") == []
    assert await state.get_counter(ROLLED_BACK) == 2


async def test_a_checkpoint_written_before_the_settle_still_counts() -> None:
    state = MemoryStateStore()
    join = JoinBuffer(state=state, policy=RewardPolicy())
    await join.hold(3, ["c/0"])
    # Died after writing the checkpoint of step 3, before settling; and once more in the middle of a
    # settle (outcome recorded, held entry not yet removed): recovery settles, never twice.
    await join.hold(3, ["d/0"])
    await join.record(Outcome.TRAINED, ["d/0"])
    successor = JoinBuffer(state=state, policy=RewardPolicy())
    assert await successor.recover(3) == []
    assert await successor.outcome_of("c/0") == [Outcome.TRAINED]
    assert await successor.outcome_of("d/0") == [Outcome.TRAINED]
    counts = await successor.counts()
    assert counts["trained"] == 2 and counts["duplicate"] == 0
    assert await state.get_counter(TRAINED_AGAIN) == 0


class Killed(BaseException):
    """The process died here (a BaseException, as SIGKILL is not catchable: nothing may handle it)."""


class DyingStore(MemoryStateStore):
    """Dies at its ``at``-th write (marks, counters, fields), leaving everything before it in place."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.writes = at, 0

    def _write(self) -> None:
        self.writes += 1
        if self.writes == self.at:
            raise Killed

    async def mark_once(self, namespace: str, id: str, ttl_s: float | None = None) -> bool:
        self._write()
        return await super().mark_once(namespace, id, ttl_s)

    async def mark_once_counted(self, namespace: str, ids: Sequence[str], **kwargs: Any) -> list[bool]:
        self._write()
        return await super().mark_once_counted(namespace, ids, **kwargs)

    async def incr(self, name: str, by: int = 1) -> int:
        self._write()
        return await super().incr(name, by)

    async def delete_field(self, key: str, field: str) -> None:
        self._write()
        await super().delete_field(key, field)


async def test_a_trainer_killed_at_any_write_of_a_settle_leaves_the_counters_equal_to_the_ledger() -> None:
    """The chaos suite's trainer_kill once waited forever: SIGKILLed inside the settle after its checkpoint,
    between the ledger's gate and the outcome's counter, the trainer left a rollout with an outcome no
    counter showed, and the restarted one's settle skipped it as already trained."""
    ids = ["e/0", "e/1", "e/2"]
    for at in range(1, 12):
        state = DyingStore(at)
        join = JoinBuffer(state=state, policy=RewardPolicy())
        await join.hold(4, ids)
        state.writes = 0
        with contextlib.suppress(Killed):
            await join.settle(4)  # the checkpoint of step 4 is written; the process dies somewhere in here
        state.at = 0
        await JoinBuffer(state=state, policy=RewardPolicy()).recover(4)
        trained = [i for i in ids if await state.seen(Outcome.TRAINED, i)]
        assert trained == ids, at
        assert all([await state.seen("outcome", i) for i in ids]), at
        assert await state.get_counter("outcome:trained") == len(ids), at
        assert await state.get_counter(TRAINED_AGAIN) == 0, at
        assert await state.get_fields(join.held_key) == {}, at


def rollout(prompt: str, i: int) -> Rollout:
    mask = np.zeros(8, dtype=np.uint8)
    mask[2:] = 1
    return Rollout(
        rollout_id=f"{prompt}/{i}", prompt_id=prompt, group_index=i, group_size=2,
        token_ids=TensorData.from_numpy(np.full(8, 65 + i, dtype=np.int32)), loss_mask=TensorData.from_numpy(mask),
        logprobs=TensorData.from_numpy(np.where(mask == 1, -1.0, 0.0).astype(np.float32)),
        token_versions=TensorData.from_numpy(np.where(mask == 1, 0, -1).astype(np.int32)),
    )


def reward(rollout_id: str, value: float) -> Reward:
    return Reward(reward_id=uuid.uuid4().hex, rollout_id=rollout_id, prompt_id=rollout_id.split("/")[0],
                  source="verifier", value=value)


def trainer(directory: Path) -> Trainer:
    torch.manual_seed(0)
    return Trainer(model=Policy(CFG), optim=OptimConfig(lr=1e-3), grpo=GRPOConfig(max_staleness=100),
                   checkpoint_dir=directory, checkpoint_every=2)


async def test_a_crash_between_checkpoints_trains_those_rollouts_again(tmp_path: Path) -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    state = MemoryStateStore()
    policy = RewardPolicy(sources=("verifier",))
    for prompt in ("p1", "p2", "p3"):
        for i in range(2):
            await bus.send(ROLLOUTS, rollout(prompt, i))
            await bus.send(REWARDS, reward(f"{prompt}/{i}", float(i)))

    first = TrainerWorker(bus=bus, trainer=trainer(tmp_path), join=OrderedJoin(state=state, policy=policy, batch=1),
                          state=state, groups_per_step=1, expire_every_s=0.05)
    assert first.holds
    stop = asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    await until(lambda: first.trainer.step >= 3, "three steps", timeout_s=60)
    task.cancel()  # a crash: no graceful checkpoint after step 3
    with contextlib.suppress(asyncio.CancelledError):
        await task
    counts = await first.join.counts()
    assert counts["trained"] == 4  # steps 1 and 2, checkpointed at step 2
    assert len(await state.get_fields(first.join.held_key)) == 2  # step 3's group, not in any checkpoint

    restarted = trainer(tmp_path)
    await restarted.restore()
    assert (restarted.step, restarted.rollouts_trained) == (2, 4)
    second = TrainerWorker(bus=bus, trainer=restarted, join=OrderedJoin(state=state, policy=policy, batch=1),
                           state=state, groups_per_step=1, expire_every_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(second.run(stop))
    await until(lambda: restarted.step >= 3, "the lost step trained again", timeout_s=60)
    stop.set()
    await task
    await second.checkpoint()  # a graceful stop: checkpoint and settle
    counts = await second.join.counts()
    assert counts["trained"] == 6 and counts["duplicate"] == 0
    assert await state.get_counter(ROLLED_BACK) == 2
    assert await state.get_counter(TRAINED_AGAIN) == 0
    for prompt in ("p1", "p2", "p3"):
        for i in range(2):
            assert await second.join.outcome_of(f"{prompt}/{i}") == [Outcome.TRAINED]
    assert (restarted.step, restarted.rollouts_trained) == (3, 6)  # each group's update exactly once
    await bus.close()


async def test_the_trainer_stops_at_max_steps_and_keeps_joining(tmp_path: Path) -> None:
    """Three groups queued, ``max_steps=2``: two steps, never a third, and the third group stays ready."""
    bus = MemoryBus(topic_specs())
    await bus.start()
    state = MemoryStateStore()
    for prompt in ("p1", "p2", "p3"):
        for i in range(2):
            await bus.send(ROLLOUTS, rollout(prompt, i))
            await bus.send(REWARDS, reward(f"{prompt}/{i}", float(i)))
    worker = TrainerWorker(bus=bus, trainer=trainer(tmp_path), join=JoinBuffer(state=state, policy=RewardPolicy()),
                           state=state, groups_per_step=1, max_steps=2, expire_every_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await until(lambda: worker.finished and worker.stats()["groups_ready"] == 1, "two steps, one group left")
    await asyncio.sleep(0.3)
    stop.set()
    await task
    assert worker.trainer.step == 2 and worker.stats()["groups_ready"] == 1
    await bus.close()
