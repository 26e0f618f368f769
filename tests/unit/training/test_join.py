"""The trainer's join buffer: readiness, order independence, timeouts, duplicates — on both stores."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Collection

import msgspec
import numpy as np
import pytest

from rlbus.schemas import Reward, Rollout, TensorData
from rlbus.schemas.reward import HACK_KINDS, TAMPERED
from rlbus.state import MemoryStateStore, RedisStateStore, StateStore
from rlbus.training.join import JoinBuffer, Outcome, RewardPolicy


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


async def test_a_scored_rollout_carries_the_hacking_its_rewards_report(state: StateStore) -> None:
    """`ScoredRollout.hacks`: every kind the waited-for sources report (`Reward.hack_kinds`), each once, a
    tampered test run among them; the value is the rewards' as published (the reward worker policed it)."""
    join = JoinBuffer(state=state, policy=RewardPolicy(sources=("verifier", "judge")))
    flagged = {
        ("verifier", 0): {HACK_KINDS: "exit,always_equal"}, ("judge", 0): {HACK_KINDS: "exit"},
        ("verifier", 1): {TAMPERED: "pytest internals replaced"},
    }
    group = None
    for i in range(3):
        await join.add_rollout(rollout("p", i))
        for source in ("verifier", "judge"):
            scored = msgspec.structs.replace(reward("p", i, source, 0.0), metadata=flagged.get((source, i), {}))
            group = await join.add_reward(scored) or group
    assert group is not None
    assert [s.hacks for s in group.rollouts] == [("exit", "always_equal"), ("tampered",), ()]
    assert [s.reward for s in group.rollouts] == [0.0, 0.0, 0.0]


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

    from rlbus.training.join import REDELIVERED_COUNTER

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


def shuffled_group(prompt: str, size: int, sources: tuple[str, ...], seed: int = 0) -> list[Rollout | Reward]:
    import random

    events: list[Rollout | Reward] = [rollout(prompt, i, size) for i in range(size)]
    events += [reward(prompt, i, source, value=i / size) for i in range(size) for source in sources]
    random.Random(seed).shuffle(events)
    return events


async def test_a_group_of_128_is_released_once_with_every_rollout_and_reward(state: StateStore) -> None:
    sources = ("verifier", "judge")
    join = JoinBuffer(state=state, policy=RewardPolicy(sources=sources))
    released = []
    for event in shuffled_group("big", 128, sources):
        group = await (join.add_rollout(event) if isinstance(event, Rollout) else join.add_reward(event))
        if group is not None:
            released.append(group)
    assert len(released) == 1
    group = released[0]
    assert group.rollout_ids == [f"big-r{i}" for i in range(128)] and group.unscored == []
    assert [s.reward for s in group.rollouts] == [2 * i / 128 for i in range(128)]
    assert all(set(s.components) == {"verifier", "judge", "verifier.exact", "judge.exact"} for s in group.rollouts)
    assert await state.get_fields("join:group:big") == {} and await state.get_fields("join:open") == {}
    assert await join.add_reward(reward("big", 0)) is None  # a late copy opens a fresh, incomplete entry


class CountingStore(MemoryStateStore):
    """Counts what the join reads: field-name listings, and the rollout / reward values it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.name_reads = 0
        self.value_reads: list[str] = []  # "r:…" / "w:…" fields whose values were returned, in order

    async def field_names(self, key: str) -> set[str]:
        self.name_reads += 1
        return await super().field_names(key)

    async def get_named(self, key: str, fields: Collection[str]) -> dict[str, bytes]:
        got = await super().get_named(key, fields)
        self.value_reads += [f for f in got if f[:2] in ("r:", "w:")]
        return got

    async def get_fields(self, key: str) -> dict[str, bytes]:
        got = await super().get_fields(key)
        self.value_reads += [f for f in got if f[:2] in ("r:", "w:")]
        return got


@pytest.mark.parametrize("kind", ["plain", "ordered"])
async def test_readiness_reads_names_only_and_each_rollout_is_decoded_once(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from msgspec.structs import replace

    import rlbus.training.join as join_module
    from rlbus.schemas import Prompt, decode
    from rlbus.training.ordered import OrderedJoin

    decoded: list[str] = []

    def counting_decode(kind_: type, raw: bytes) -> object:
        message = decode(kind_, raw)
        if isinstance(message, Rollout):
            decoded.append(message.rollout_id)
        return message

    monkeypatch.setattr(join_module, "decode", counting_decode)
    store, size, sources = CountingStore(), 64, ("verifier", "judge")
    policy = RewardPolicy(sources=sources)
    join = JoinBuffer(state=store, policy=policy)
    events = shuffled_group("g", size, sources, seed=3)
    if kind == "ordered":  # numbered, as the prompt producer numbers them
        join = OrderedJoin(state=store, policy=policy, batch=1)
        prompt = Prompt(prompt_id="g", env="arith", text="", group_size=size, metadata={"seq": "0"})
        events = [replace(e, prompt=prompt) if isinstance(e, Rollout) else e for e in events]
    released = []
    for event in events:
        group = await (join.add_rollout(event) if isinstance(event, Rollout) else join.add_reward(event))
        if group is not None:
            released.append(group)
        else:
            assert store.value_reads == [], "a value was read before the group was complete"
    if kind == "ordered":
        assert released == []
        released = await join.expire()
    assert len(released) == 1 and len(released[0].rollouts) == size
    assert sorted(decoded) == sorted(f"g-r{i}" for i in range(size))  # each rollout decoded once, at release
    assert sorted(store.value_reads) == sorted([f"r:g-r{i}" for i in range(size)]
                                               + [f"w:g-r{i}:{s}:" for i in range(size) for s in sources])
    assert store.name_reads == 1  # the field count kept the names unread until the last arrival
