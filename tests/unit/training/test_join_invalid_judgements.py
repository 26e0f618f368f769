"""The join with LM judges: verifier and judge combined by weight, and the reward policy's three answers
to an invalid judgement (drop, downweight, wait) — on both stores."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from rlbus.schemas import Reward
from rlbus.state import MemoryStateStore, RedisStateStore, StateStore
from rlbus.training.join import INVALID_COUNTER, JoinBuffer, Outcome, RewardPolicy, ScoredGroup
from rlbus.training.ordered import OrderedJoin
from tests.unit.training.test_join import Clock, rollout


@pytest.fixture(params=["memory", "redis"])
async def state(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        store: StateStore = MemoryStateStore()
    else:
        store = RedisStateStore.from_url(request.getfixturevalue("redis_url"), key_prefix=f"t{uuid.uuid4().hex}")
    yield store
    await store.close()


SOURCES = ("verifier", "judge")


def judged(prompt: str, i: int, value: float, *, valid: bool = True) -> Reward:
    metadata = {"judge_valid": "true" if valid else "false"}
    components = {"correct": value} if valid else {}
    return Reward(reward_id=f"{prompt}-r{i}:judge", rollout_id=f"{prompt}-r{i}", prompt_id=prompt, source="judge",
                  value=value, components=components, metadata=metadata)  # fmt: skip


def verified(prompt: str, i: int, value: float) -> Reward:
    return Reward(reward_id=f"{prompt}-r{i}:verifier", rollout_id=f"{prompt}-r{i}", prompt_id=prompt,
                  source="verifier", value=value, components={"exact": value})  # fmt: skip


async def fill(join: JoinBuffer, events: list[object]) -> ScoredGroup | None:
    result = None
    for event in events:
        if isinstance(event, Reward):
            result = await join.add_reward(event) or result
        else:
            result = await join.add_rollout(event) or result  # type: ignore[arg-type]
    return result


def group_events(judges: list[Reward]) -> list[object]:
    events: list[object] = []
    for i, judgement in enumerate(judges):
        events += [rollout("p", i), verified("p", i, [1.0, 0.0, 1.0][i]), judgement]
    return events


async def test_verifier_and_judge_combine_by_the_policys_weights(state: StateStore) -> None:
    policy = RewardPolicy(sources=SOURCES, weights={"verifier": 1.0, "judge": 0.5})
    join = JoinBuffer(state=state, policy=policy)
    group = await fill(join, group_events([judged("p", 0, 0.8), judged("p", 1, 0.2), judged("p", 2, 0.4)]))
    assert group is not None
    assert [s.reward for s in group.rollouts] == pytest.approx([1.4, 0.1, 1.2])
    assert group.rollouts[0].components["judge.correct"] == 0.8 and group.rollouts[0].components["judge"] == 0.8
    assert all(not s.invalid for s in group.rollouts)


async def test_drop_flags_the_rollout_for_the_trainer_and_counts_it(state: StateStore) -> None:
    join = JoinBuffer(state=state, policy=RewardPolicy(sources=SOURCES, invalid="drop"))
    group = await fill(join, group_events([judged("p", 0, 0.8), judged("p", 1, 0.0, valid=False), judged("p", 2, 0.4)]))
    assert group is not None and len(group.rollouts) == 3
    dropped = [s.rollout.rollout_id for s in group.rollouts if join.policy.drops(s)]
    assert dropped == ["p-r1"] and group.rollouts[1].invalid == ("judge",)
    assert await state.get_counter(INVALID_COUNTER) == 1
    assert await join.record(Outcome.INVALID_JUDGEMENT, dropped) == 1
    assert (await join.counts())[Outcome.INVALID_JUDGEMENT] == 1


async def test_downweight_makes_an_invalid_judgement_neutral(state: StateStore) -> None:
    """The invalid source moves to its group's mean valid value: (0.8 + 0.4) / 2 = 0.6 at weight 0."""
    policy = RewardPolicy(sources=SOURCES, invalid="downweight", invalid_weight=0.0)
    join = JoinBuffer(state=state, policy=policy)
    group = await fill(join, group_events([judged("p", 0, 0.8), judged("p", 1, 0.0, valid=False), judged("p", 2, 0.4)]))
    assert group is not None
    assert [s.reward for s in group.rollouts] == pytest.approx([1.8, 0.0 + 0.6, 1.4])
    assert not any(policy.drops(s) for s in group.rollouts)


async def test_downweight_keeps_a_share_of_the_invalid_value(state: StateStore) -> None:
    policy = RewardPolicy(sources=SOURCES, weights={"judge": 2.0}, invalid="downweight", invalid_weight=0.5)
    join = JoinBuffer(state=state, policy=policy)
    group = await fill(join, group_events([judged("p", 0, 0.8), judged("p", 1, 0.2, valid=False), judged("p", 2, 0.4)]))
    assert group is not None
    assert group.rollouts[1].reward == pytest.approx(0.0 + 2.0 * (0.5 * 0.2 + 0.5 * 0.6))


async def test_wait_holds_the_group_until_a_valid_judgement_arrives(state: StateStore) -> None:
    join = JoinBuffer(state=state, policy=RewardPolicy(sources=SOURCES, invalid="wait"))
    events = group_events([judged("p", 0, 0.8), judged("p", 1, 0.0, valid=False), judged("p", 2, 0.4)])
    assert await fill(join, events) is None  # the invalid judgement does not complete rollout 1
    group = await join.add_reward(judged("p", 1, 0.6))  # another judge's valid one
    assert group is not None and [s.reward for s in group.rollouts] == pytest.approx([1.8, 0.6, 1.4])
    assert await state.get_counter(INVALID_COUNTER) == 1


async def test_wait_times_out_like_any_missing_reward(state: StateStore) -> None:
    clock = Clock()
    join = JoinBuffer(state=state, policy=RewardPolicy(sources=SOURCES, invalid="wait", timeout_s=5), clock=clock)
    await fill(join, group_events([judged("p", 0, 0.8), judged("p", 1, 0.0, valid=False), judged("p", 2, 0.4)]))
    clock.now += 6
    [group] = await join.expire()
    assert group.rollout_ids == ["p-r0", "p-r2"] and group.unscored == ["p-r1"]
    assert (await join.counts())[Outcome.TIMED_OUT] == 1


async def test_an_invalid_judgement_never_replaces_a_valid_one(state: StateStore) -> None:
    join = JoinBuffer(state=state, policy=RewardPolicy(sources=SOURCES, invalid="drop"))
    events = [rollout("p", 0), verified("p", 0, 1.0), judged("p", 0, 0.9), judged("p", 0, 0.0, valid=False),
              rollout("p", 1), verified("p", 1, 0.0), judged("p", 1, 0.1), rollout("p", 2),
              judged("p", 2, 0.0, valid=False), judged("p", 2, 0.3), verified("p", 2, 0.0)]  # fmt: skip
    group = await fill(join, events)
    assert group is not None
    assert [s.components["judge"] for s in group.rollouts] == pytest.approx([0.9, 0.1, 0.3])
    assert not any(s.invalid for s in group.rollouts)  # the later valid one replaced the invalid one


async def test_the_ordered_join_releases_dropped_rollouts_for_their_outcome(state: StateStore) -> None:
    join = OrderedJoin(state=state, policy=RewardPolicy(sources=SOURCES, invalid="drop"), batch=1)
    await fill(join, group_events([judged("p", 0, 0.8), judged("p", 1, 0.0, valid=False), judged("p", 2, 0.4)]))
    [group] = await join.expire()
    dropped = [s.rollout.rollout_id for s in group.rollouts if join.policy.drops(s)]
    assert dropped == ["p-r1"]
    await join.record(Outcome.INVALID_JUDGEMENT, dropped)
    await join.record(Outcome.TRAINED, ["p-r0", "p-r2"])
    assert await join.outcome_of("p-r1") == [Outcome.INVALID_JUDGEMENT]
    assert join.stats()["released_untrained"] == 0  # every rollout has its outcome: the group is finished

