"""The served join (rlbus/training/join.py `ServedJoin`) on real Redis and in memory: a served rollout waits
for its user reward however late it comes, survives a restart of the trainer's join (the state is in the
store), is released once, and is dropped as too old when nobody rates it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest

from rlbus.errors import MalformedMessage
from rlbus.schemas import Reward, Rollout, TensorData
from rlbus.state import MemoryStateStore, RedisStateStore, StateStore
from rlbus.training.join import FINAL, SERVED_UNRATED, JoinBuffer, Outcome, RewardPolicy, ServedJoin, is_served


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

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


def served(rid: str, created_at: float, task: str = "arith") -> Rollout:
    t = TensorData.from_numpy(np.zeros(3, dtype=np.int32))
    return Rollout(
        rollout_id=rid, prompt_id=task, group_index=0, group_size=1, token_ids=t,
        loss_mask=TensorData.from_numpy(np.array([0, 1, 1], dtype=np.uint8)),
        logprobs=TensorData.from_numpy(np.zeros(3, dtype=np.float32)), token_versions=t, created_at=created_at,
        metadata={"origin": "served", "tenant": "acme", "session_id": rid},
    )


def thumb(rid: str, value: float, source: str = "user") -> Reward:
    return Reward(reward_id=uuid.uuid4().hex, rollout_id=rid, prompt_id="arith", source=source, value=value,
                  components={"up": value})


def joins(state: StateStore, clock: Clock, max_age_s: float = 3600.0) -> tuple[JoinBuffer, ServedJoin]:
    ledger = JoinBuffer(state=state, policy=RewardPolicy(sources=("verifier",)), clock=clock)
    return ledger, ServedJoin(ledger=ledger, state=state, sources=("user",), max_age_s=max_age_s, clock=clock)


async def test_a_late_user_reward_releases_the_waiting_rollout_after_a_restart(state: StateStore) -> None:
    clock = Clock()
    _, first = joins(state, clock)
    assert is_served(served("c1", clock.now))
    assert await first.add_rollout(served("c1", clock.now)) is None
    assert await first.add_rollout(served("c2", clock.now)) is None
    assert await first.add_reward(thumb("c2", 1.0, source="judge")) is None  # not a source it waits for
    assert await first.waiting() == 2
    clock.now += 1800  # half an hour later, a new trainer process (same store) gets the thumbs
    _, second = joins(state, clock)
    released = await second.add_reward(thumb("c1", 0.0))
    assert released is not None and released.rollout.rollout_id == "c1"
    assert released.reward == 0.0 and released.components == {"user": 0.0, "user.up": 0.0}
    assert released.rollout.metadata["tenant"] == "acme"
    assert await second.add_reward(thumb("c1", 1.0)) is None  # released once: a second thumb does not repeat it
    assert await second.waiting() == 1


async def test_a_reward_before_its_rollout_and_redeliveries(state: StateStore) -> None:
    clock = Clock()
    ledger, join = joins(state, clock)
    assert await join.add_reward(thumb("c3", 1.0)) is None
    released = await join.add_rollout(served("c3", clock.now))
    assert released is not None and released.reward == 1.0
    assert await join.add_rollout(served("c3", clock.now + 5)) is None  # a second copy: counted, not released
    await ledger.record(Outcome.TRAINED, ["c3"])
    assert await join.add_reward(thumb("c3", 0.0)) is None  # it has an outcome: ignored
    assert await join.add_rollout(served("c3", clock.now)) is None
    assert (await ledger.counts())["duplicate"] == 1


async def test_released_but_untrained_rollouts_are_pending_after_a_restart(state: StateStore) -> None:
    clock = Clock()
    ledger, join = joins(state, clock)
    for rid in ("a", "b"):
        await join.add_rollout(served(rid, clock.now))
        clock.now += 1
        assert await join.add_reward(thumb(rid, 1.0)) is not None
    await ledger.record(Outcome.TRAINED, ["a"])  # "a" trained; "b" released, then the trainer died
    _, restarted = joins(state, clock)
    assert [s.rollout.rollout_id for s in await restarted.pending()] == ["b"]
    assert await state.field_names(restarted.ready_key) == {"b"}  # "a" forgotten: it has its outcome


async def test_unrated_rollouts_are_dropped_after_max_age(state: StateStore) -> None:
    clock = Clock()
    ledger, join = joins(state, clock, max_age_s=600)
    await join.add_rollout(served("old", clock.now))
    clock.now += 300
    await join.add_rollout(served("young", clock.now))
    assert await join.expire() == 0
    clock.now += 301  # "old" is 601 s old, "young" 301 s
    assert await join.expire() == 1
    assert await ledger.outcome_of("old") == [Outcome.TOO_OLD]
    assert await state.get_counter(SERVED_UNRATED) == 1
    assert await join.add_reward(thumb("old", 1.0)) is None  # too late
    assert await join.add_reward(thumb("young", 1.0)) is not None
    assert not await state.seen(FINAL, "young")


async def test_a_reward_that_is_not_a_number_is_refused(state: StateStore) -> None:
    _, join = joins(state, Clock())
    with pytest.raises(MalformedMessage, match="finite"):
        await join.add_reward(thumb("x", float("nan")))
