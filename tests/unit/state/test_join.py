"""The trainer's join buffer: readiness, order independence, timeouts, duplicates — on both stores."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest

from rlbus.schemas import Reward, Rollout, TensorData
from rlbus.state import MemoryStateStore, RedisStateStore, StateStore
from rlbus.state.join import JoinBuffer, Outcome, RewardPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def state(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        store: StateStore = MemoryStateStore()
    else:
        store = RedisStateStore.from_url(request.getfixturevalue("redis_url"), key_prefix=f"t{uuid.uuid4().hex}")
    yield store
    await store.close()


def rollout(prompt: str, i: int, size: int = 3) -> Rollout:
    t = TensorData.from_numpy(np.zeros(2, dtype=np.int32))
    return Rollout(
        rollout_id=f"{prompt}-r{i}", prompt_id=prompt, group_index=i, group_size=size, token_ids=t,
        loss_mask=TensorData.from_numpy(np.ones(2, dtype=np.uint8)),
        logprobs=TensorData.from_numpy(np.zeros(2, dtype=np.float32)), token_versions=t,
    )


def reward(prompt: str, i: int, source: str = "verifier", value: float = 1.0) -> Reward:
    return Reward(reward_id=uuid.uuid4().hex, rollout_id=f"{prompt}-r{i}", prompt_id=prompt, source=source,
                  value=value, components={"exact": value})


async def test_group_is_ready_when_every_rollout_has_every_source(state: StateStore) -> None:
    join = JoinBuffer(state=state, policy=RewardPolicy(sources=("verifier", "judge"), weights={"judge": 0.5}))
    ready = []
    # Rewards may come before their rollouts; order must not matter.
    events = [reward("p", 0), rollout("p", 0), rollout("p", 1), reward("p", 1, "judge", 0.4), reward("p", 1),
              reward("p", 0, "judge", 0.2), rollout("p", 2), reward("p", 2, "judge"), reward("p", 2, "verifier", 0.0)]
    for event in events:
        result = await (join.add_rollout(event) if isinstance(event, Rollout) else join.add_reward(event))
        ready.append(result)
    assert all(r is None for r in ready[:-1])
    group = ready[-1]
    assert group is not None and group.rollout_ids == ["p-r0", "p-r1", "p-r2"]
    assert [s.reward for s in group.rollouts] == [1.0 + 0.1, 1.0 + 0.2, 0.0 + 0.5]
    assert group.rollouts[0].components["verifier.exact"] == 1.0
    assert await join.record(Outcome.TRAINED, group.rollout_ids) == 3
    # Redelivered after training: ignored and counted, never trained twice.
    assert await join.add_rollout(rollout("p", 0)) is None
    assert await join.record(Outcome.TRAINED, ["p-r0"]) == 0
    counts = await join.counts()
    assert counts["trained"] == 3 and counts["duplicate"] == 2


async def test_timed_out_groups_train_or_drop_with_reasons(state: StateStore) -> None:
    clock = Clock()
    join = JoinBuffer(state=state, policy=RewardPolicy(timeout_s=10, min_group=2), clock=clock)
    for i in range(3):
        await join.add_rollout(rollout("a", i))
        await join.add_rollout(rollout("b", i))
    await join.add_reward(reward("a", 0))
    await join.add_reward(reward("a", 1))
    await join.add_reward(reward("b", 0))
    await join.add_reward(reward("a", 0, source="judge"))  # not waited for: ignored
    clock.now += 5
    assert await join.expire() == []
    clock.now += 6
    released = await join.expire()
    assert [g.prompt_id for g in released] == ["a"]
    assert released[0].rollout_ids == ["a-r0", "a-r1"] and released[0].unscored == ["a-r2"]
    counts = await join.counts()
    assert counts["dropped_timed_out"] == 1 and counts["dropped_incomplete_group"] == 3
    assert await join.expire() == []


async def test_a_redelivered_prompts_second_copy_never_pairs_with_the_first_copys_reward(state: StateStore) -> None:
    """A worker died after publishing part of a group; the prompt was played again under the same ids.
    Every rollout must be trained with the reward of the very copy that was kept."""
    import msgspec

    from rlbus.state.join import REDELIVERED_COUNTER

    join = JoinBuffer(state=state, policy=RewardPolicy(sources=("verifier",)))

    def copy(i: int, created: float) -> Rollout:
        return msgspec.structs.replace(rollout("p", i, size=2), created_at=created)

    def scored(i: int, created: float, value: float) -> Reward:
        return msgspec.structs.replace(reward("p", i, value=value), rollout_created_at=created)

    # Copy B's reward for r0 arrives first, then copy A of r0 (kept), then copy B of r0 (ignored), then
    # copy A's reward; r1 comes only from copy B. The user's unstamped reward would match any copy.
    events = [scored(0, 2.0, 0.0), copy(0, 1.0), copy(0, 2.0), scored(0, 1.0, 1.0), copy(1, 2.0), scored(1, 2.0, 0.5)]
    results = [await (join.add_rollout(e) if isinstance(e, Rollout) else join.add_reward(e)) for e in events]
    group = results[-1]
    assert all(r is None for r in results[:-1]) and group is not None
    assert [(s.rollout.created_at, s.reward) for s in group.rollouts] == [(1.0, 1.0), (2.0, 0.5)]
    assert await state.get_counter(REDELIVERED_COUNTER) == 1
