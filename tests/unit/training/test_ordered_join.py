"""The trainer's in-order release: prompt order whatever the arrival order, whole batches, kept until
every rollout has an outcome, restart, gaps and timeouts — on the in-memory store and on Redis."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from rlbus.schemas import Prompt, Reward, Rollout, TensorData
from rlbus.state import MemoryStateStore, RedisStateStore, StateStore
from rlbus.training.join import Outcome, RewardPolicy, ScoredGroup
from rlbus.training.ordered import OrderedJoin, buffered_rollouts, prompt_seq, stamp


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def make_state(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], StateStore]]:
    """Fresh stores (each its own ledger) of one kind."""
    made: list[StateStore] = []

    def make() -> StateStore:
        if request.param == "memory":
            store: StateStore = MemoryStateStore()
        else:
            url = request.getfixturevalue("redis_url")
            store = RedisStateStore.from_url(url, key_prefix=f"t{uuid.uuid4().hex}:")
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


@pytest.fixture
def state(make_state: Callable[[], StateStore]) -> StateStore:
    return make_state()


def pid(seq: int) -> str:
    return f"run-{seq:04d}"


def rollout(seq: int | None, i: int, size: int, prompt_id: str | None = None) -> Rollout:
    prompt_id = prompt_id or pid(seq if seq is not None else 9999)
    metadata = {} if seq is None else {"seq": str(seq)}
    t = TensorData.from_numpy(np.zeros(2, dtype=np.int32))
    return Rollout(
        rollout_id=f"{prompt_id}/{i}", prompt_id=prompt_id, group_index=i, group_size=size, token_ids=t,
        loss_mask=TensorData.from_numpy(np.ones(2, dtype=np.uint8)),
        logprobs=TensorData.from_numpy(np.zeros(2, dtype=np.float32)), token_versions=t,
        prompt=Prompt(prompt_id=prompt_id, env="arith", text="1+1=", group_size=size, metadata=metadata),
    )


def reward(prompt_id: str, i: int, value: float | None = None) -> Reward:
    return Reward(reward_id=f"{prompt_id}/{i}:verifier", rollout_id=f"{prompt_id}/{i}", prompt_id=prompt_id,
                  source="verifier", value=float(i) if value is None else value)


def events(seq: int, size: int = 2) -> list[Rollout | Reward]:
    return [rollout(seq, i, size) for i in range(size)] + [reward(pid(seq), i) for i in range(size)]


async def feed(join: OrderedJoin, messages: list[Rollout | Reward]) -> None:
    for m in messages:
        result = await (join.add_rollout(m) if isinstance(m, Rollout) else join.add_reward(m))
        assert result is None  # groups only ever come out of expire()


def seqs(groups: list[ScoredGroup]) -> list[int | None]:
    return [prompt_seq(g.rollouts[0].rollout) for g in groups]


async def finish(join: OrderedJoin, groups: list[ScoredGroup]) -> None:
    for g in groups:
        await join.record(Outcome.TRAINED, g.rollout_ids)


def join_for(state: StateStore, batch: int = 2, clock: Clock | None = None, **kw: float) -> OrderedJoin:
    policy = RewardPolicy(sources=("verifier",), timeout_s=kw.pop("timeout_s", 60.0))
    return OrderedJoin(state=state, policy=policy, batch=batch, clock=clock or Clock(), **kw)  # type: ignore[arg-type]


def test_stamp_numbers_prompts_from_start() -> None:
    prompts = [Prompt(prompt_id=f"p{i}", env="arith", text="", metadata={"k": "v"}) for i in range(3)]
    stamped = list(stamp(prompts, start=7))
    assert [p.metadata for p in stamped] == [{"k": "v", "seq": "7"}, {"k": "v", "seq": "8"}, {"k": "v", "seq": "9"}]


async def test_complete_groups_go_out_in_prompt_order_in_whole_batches(state: StateStore) -> None:
    join = join_for(state, batch=2)
    await feed(join, events(1))
    assert await join.expire() == []  # 0 is missing: 1 waits
    await feed(join, events(0))
    out = await join.expire()
    assert seqs(out) == [0, 1]
    assert [s.reward for s in out[0].rollouts] == [0.0, 1.0]
    await feed(join, events(3))
    assert await join.expire() == []  # 2 missing
    await feed(join, events(2))
    assert seqs(await join.expire()) == [2, 3]
    assert await join.cursor() == 4


async def test_a_partial_batch_stays_in_the_store(state: StateStore) -> None:
    join = join_for(state, batch=3)
    await feed(join, events(0) + events(1))
    assert await join.expire() == []
    assert sorted(await buffered_rollouts(state)) == [pid(0), pid(1)]
    await feed(join, events(2))
    assert seqs(await join.expire()) == [0, 1, 2]


async def test_release_order_does_not_depend_on_arrival_order(make_state: Callable[[], StateStore]) -> None:
    """The property a replay relies on: any interleaving of the same messages, checked after every
    message, gives the same groups in the same batches."""
    messages = [m for seq in range(6) for m in events(seq, size=3)]
    outcomes = []
    for shuffle_seed in range(4):
        join = OrderedJoin(state=make_state(), policy=RewardPolicy(sources=("verifier",)), batch=2)
        order = list(messages)
        random.Random(shuffle_seed).shuffle(order)
        batches = []
        for m in order:
            await feed(join, [m])
            out = await join.expire()
            if out:
                batches.append([(g.prompt_id, g.rollout_ids, [s.reward for s in g.rollouts]) for g in out])
                await finish(join, out)
        outcomes.append([group for batch in batches for group in batch])
        assert all(len(b) % 2 == 0 for b in batches)
    assert all(o == outcomes[0] for o in outcomes)
    assert [g[0] for g in outcomes[0]] == [pid(s) for s in range(6)]


async def test_a_released_group_is_deleted_once_every_rollout_has_an_outcome(state: StateStore) -> None:
    join = join_for(state, batch=1)
    await feed(join, events(0, size=3))
    (group,) = await join.expire()
    assert await buffered_rollouts(state) == {pid(0): group.rollout_ids}  # kept while training
    await join.record(Outcome.TRAINED, group.rollout_ids[:2])
    assert pid(0) in await buffered_rollouts(state)
    await join.record(Outcome.STALE, group.rollout_ids[2:])
    assert await buffered_rollouts(state) == {}
    assert await join.expire() == []  # not released again


async def test_a_restarted_trainer_releases_unfinished_groups_first(state: StateStore) -> None:
    first = join_for(state, batch=2)
    await feed(first, events(0) + events(1) + events(2))
    batch = await first.expire()
    assert seqs(batch) == [0, 1]
    await first.record(Outcome.TRAINED, batch[0].rollout_ids)  # group 0 done; the trainer dies before group 1
    await first.record(Outcome.TRAINED, batch[1].rollout_ids[:1])  # … having recorded one rollout of it
    again = join_for(state, batch=2)  # the restarted trainer: same store, fresh memory
    assert await again.cursor() == 2
    await feed(again, events(3))
    out = await again.expire()
    assert [g.prompt_id for g in out] == [pid(1), pid(2)]  # the unfinished one first, then in order
    assert out[0].rollout_ids == [f"{pid(1)}/1"]  # without the rollout that already has an outcome
    assert pid(0) not in await buffered_rollouts(state)


async def test_an_absent_prompt_is_skipped_after_the_gap_timeout(state: StateStore) -> None:
    clock = Clock()
    join = join_for(state, batch=2, clock=clock, gap_timeout_s=30.0)
    await feed(join, events(1) + events(2))
    assert await join.expire() == []
    clock.now += 29
    assert await join.expire() == []
    clock.now += 1
    assert seqs(await join.expire()) == [1, 2]
    assert join.skipped == [0]
    await feed(join, events(0))  # arriving after all: released as late, ahead of the next run
    await feed(join, events(3))
    assert seqs(await join.expire()) == [0, 3]


async def test_a_partly_arrived_head_waits_for_the_join_timeout_not_the_gap_timeout(state: StateStore) -> None:
    clock = Clock()
    join = join_for(state, batch=2, clock=clock, gap_timeout_s=5.0, timeout_s=60.0)
    await feed(join, [rollout(0, 0, 3), rollout(0, 1, 3), reward(pid(0), 0), reward(pid(0), 1)])
    await feed(join, events(1, size=3))
    clock.now += 30
    assert await join.expire() == []  # seq 0 is open: no gap jump
    clock.now += 31
    out = await join.expire()  # the join timeout releases 0 with its two scored rollouts, in its place
    assert seqs(out) == [0, 1]
    assert len(out[0].rollouts) == 2 and out[0].unscored == []
    assert join.skipped == []


async def test_a_group_dropped_whole_by_the_timeout_is_passed(state: StateStore) -> None:
    clock = Clock()
    join = join_for(state, batch=2, clock=clock, timeout_s=60.0)
    await feed(join, [rollout(0, 0, 3)])  # one rollout of three: below min_group when it times out
    await feed(join, events(1) + events(2))
    clock.now += 61
    assert seqs(await join.expire()) == [1, 2]
    assert (await join.counts())[Outcome.INCOMPLETE] == 1
    assert join.skipped == []


async def test_groups_without_a_sequence_number_go_out_as_they_complete(state: StateStore) -> None:
    join = join_for(state, batch=1)
    await feed(join, [rollout(None, 0, 2, "other"), rollout(None, 1, 2, "other"), reward("other", 0),
                      reward("other", 1)])
    out = await join.expire()
    assert [g.prompt_id for g in out] == ["other"]


async def test_twins_with_one_sequence_number_go_out_together_in_its_place(state: StateStore) -> None:
    """A producer that crashed before persisting its count hands a number out twice: both groups are
    released at that number, by prompt id, and the cursor moves on."""
    join = join_for(state, batch=3)
    twin = [rollout(1, i, 2, "run-0001b") for i in range(2)] + [reward("run-0001b", i) for i in range(2)]
    await feed(join, events(0) + twin + events(1))
    out = await join.expire()
    assert [g.prompt_id for g in out] == [pid(0), pid(1), "run-0001b"]
    assert await join.cursor() == 2
