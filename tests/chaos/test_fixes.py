"""The fixes the chaos scenarios called for, each pinned by a fast test on the in-memory bus (or one
redis-server): the join's exactly-once gate, NaN rewards refused, over-long rollouts dead-lettered on
arrival, infrastructure outages never dead-lettering good input, weight sync riding out a blob-store
outage, the trainer deferring a publish it cannot make, Redis persistence and reconnects."""

from __future__ import annotations

import asyncio
import math
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlbus.aio import until
from rlbus.blobs.local import LocalStore
from rlbus.bus import MemoryBus
from rlbus.bus.dlq import DeadLetters, handle_batch, read_dead_letters
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.consumers.reward import RewardWorker
from rlbus.consumers.trainer import TrainerWorker
from rlbus.errors import BlobStoreError, JudgeUnavailable, MalformedMessage, StateError
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.rewards.scorers import NoConfig, Scorer, ScorerContext
from rlbus.schemas import Reward, Rollout, TensorData
from rlbus.state import MemoryStateStore, RedisStateStore
from rlbus.training.join import TRAINED_AGAIN, JoinBuffer, Outcome, RewardPolicy
from rlbus.training.step import OptimConfig
from rlbus.training.trainer import Trainer
from rlbus.weights.publish import WeightPublisher
from rlbus.weights.sync import WeightSync
from rlbus_tools.chaos.blobs import FaultyStore, flip_bit
from rlbus_tools.services.redis import start_redis

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


def rollout(prompt: str, i: int, *, size: int = 2, tokens: int = 8) -> Rollout:
    mask = np.zeros(tokens, dtype=np.uint8)
    mask[2:] = 1
    return Rollout(
        rollout_id=f"{prompt}/{i}", prompt_id=prompt, group_index=i, group_size=size,
        token_ids=TensorData.from_numpy(np.full(tokens, 65, dtype=np.int32)), loss_mask=TensorData.from_numpy(mask),
        logprobs=TensorData.from_numpy(np.where(mask == 1, -1.0, 0.0).astype(np.float32)),
        token_versions=TensorData.from_numpy(np.where(mask == 1, 0, -1).astype(np.int32)),
    )


def reward(rollout_id: str, value: float = 1.0) -> Reward:
    return Reward(reward_id=uuid.uuid4().hex, rollout_id=rollout_id, prompt_id=rollout_id.split("/")[0],
                  source="verifier", value=value)


# --- the join's exactly-once gate -------------------------------------------------------------------


async def test_an_outcome_is_final_whatever_it_was() -> None:
    state = MemoryStateStore()
    now = [0.0]
    join = JoinBuffer(state=state, policy=RewardPolicy(timeout_s=5, min_group=2), clock=lambda: now[0])
    await join.add_rollout(rollout("p", 0))
    now[0] = 10.0
    assert await join.expire() == []  # one rollout, unscored: dropped whole
    assert await join.outcome_of("p/0") == [Outcome.INCOMPLETE]
    # Redelivered after it was dropped: ignored, not buffered again, never trained.
    assert await join.add_rollout(rollout("p", 0)) is None
    assert await state.get_fields("join:group:p") == {}
    assert await join.record(Outcome.TRAINED, ["p/0"]) == 0
    assert await state.get_counter(TRAINED_AGAIN) == 1  # the gate saw a training it had to refuse
    assert await join.outcome_of("p/0") == [Outcome.INCOMPLETE]
    counts = await join.counts()
    assert counts["dropped_incomplete_group"] == 1 and counts["trained"] == 0 and counts["duplicate"] == 2


async def test_nan_rewards_are_refused_by_the_join() -> None:
    join = JoinBuffer(state=MemoryStateStore(), policy=RewardPolicy())
    for bad in (math.nan, math.inf):
        with pytest.raises(MalformedMessage, match="not a finite number"):
            await join.add_reward(reward("p/0", bad))
    bad_component = Reward(reward_id="x", rollout_id="p/0", prompt_id="p", source="verifier", value=1.0,
                           components={"exact": math.nan})
    with pytest.raises(MalformedMessage):
        await join.add_reward(bad_component)
    assert await join.add_reward(reward("p/0", 0.5)) is None  # a finite one is buffered


class NanJudge(Scorer):
    """A broken judge that scores NaN (a reward scorer, as the reward worker calls it)."""

    def __init__(self) -> None:
        super().__init__(NoConfig(), ScorerContext())

    async def score(self, episode: Any, prompt: Any) -> Reward:
        return Reward(reward_id="r", rollout_id=episode.episode_id, prompt_id="p", source="judge", value=math.nan)


async def test_the_reward_worker_never_publishes_a_nan() -> None:
    from rlbus.envs.agent import reference_episode
    from rlbus.envs.base import env_for
    from rlbus.envs.chat import ChatFormat
    from rlbus.envs.episode import episode_to_rollout
    from rlbus.envs.tasks import generate_prompts

    bus = MemoryBus(topic_specs())
    await bus.start()
    prompt = generate_prompts("arith", seed=1, n=1)[0]
    episode = await reference_episode(env_for(prompt), prompt, chat=ChatFormat.for_byte_tokenizer())  # type: ignore[arg-type]
    await bus.send(ROLLOUTS, episode_to_rollout(episode, prompt=prompt, group_index=0))
    worker = RewardWorker(bus=bus, kind="judge", scorers=[NanJudge()])
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await until(lambda: read_dead_letters(bus, ROLLOUTS.name), "the NaN reward dead-lettered")
    stop.set()
    await task
    (letter,) = await read_dead_letters(bus, ROLLOUTS.name)
    assert letter.error_class == "MalformedMessage" and "nan" in letter.error
    assert (await bus.end_offsets(REWARDS.name)) == {p: 0 for p in await bus.partitions(REWARDS.name)}
    await bus.close()


# --- the trainer ------------------------------------------------------------------------------------


async def test_an_over_long_rollout_is_dead_lettered_on_arrival_with_its_id() -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    state = MemoryStateStore()
    join = JoinBuffer(state=state, policy=RewardPolicy())
    worker = TrainerWorker(bus=bus, trainer=Trainer(model=Policy(CFG), optim=OptimConfig()), join=join, state=state,
                           groups_per_step=1)
    await bus.send(ROLLOUTS, rollout("long", 0, size=1, tokens=CFG.max_seq + 1))
    await bus.send(ROLLOUTS, rollout("ok", 0, tokens=CFG.max_seq))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await until(lambda: join.outcome_of("long/0"), "an outcome for the over-long rollout")
    stop.set()
    await task
    assert await join.outcome_of("long/0") == [Outcome.DEAD_LETTERED]
    (letter,) = await read_dead_letters(bus, ROLLOUTS.name)
    assert "exceeds max_seq 64" in letter.error
    assert "join:group:ok" in {f"join:group:{p}" for p in await state.get_fields("join:open")}
    await bus.close()


async def test_a_redelivered_group_is_not_trained_twice() -> None:
    from rlbus_tools.chaos.pipeline import CountingJoin

    bus = MemoryBus(topic_specs())
    await bus.start()
    state = MemoryStateStore()
    join = CountingJoin(state=state, policy=RewardPolicy())
    worker = TrainerWorker(bus=bus, trainer=Trainer(model=Policy(CFG), optim=OptimConfig()), join=join, state=state,
                           groups_per_step=2)

    async def deliver(prompt: str) -> None:  # a group's rollouts and rewards
        for i in range(2):
            await bus.send(ROLLOUTS, rollout(prompt, i))
            await bus.send(REWARDS, reward(f"{prompt}/{i}", float(i)))

    async def queued() -> bool:
        return len(worker._ready) == 1

    async def filtered() -> bool:
        return (await join.counts())["duplicate"] >= 2

    async def trained() -> bool:
        return len(join.handed_to_optimizer) >= 4

    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await deliver("a")
    await until(queued, "group a queued")  # "a" is released and waits for a second group to fill the step ...
    await deliver("a")  # ... when a rebalance redelivers it: the join builds the group again
    await until(filtered, "the redelivered copy filtered")
    await deliver("b")
    await until(trained, "four rollouts trained")
    await asyncio.sleep(0.2)
    stop.set()
    await task
    assert dict(join.handed_to_optimizer) == {"a/0": 1, "a/1": 1, "b/0": 1, "b/1": 1}
    assert await state.get_counter(TRAINED_AGAIN) == 0 and worker.trainer.step == 1
    assert (await join.counts())["duplicate"] >= 2
    await bus.close()


class DownStore(LocalStore):
    """A local store whose every call fails while ``down``."""

    down = False

    async def put(self, key: str, data: bytes) -> None:
        self._fail()
        await super().put(key, data)

    async def get(self, key: str) -> bytes:
        self._fail()
        return await super().get(key)

    async def list(self, prefix: str = "") -> list[str]:
        self._fail()
        return await super().list(prefix)

    def _fail(self) -> None:
        if self.down:
            raise BlobStoreError("connection refused")


async def test_the_trainer_defers_a_publish_the_store_cannot_take(tmp_path: Path) -> None:
    from rlbus.training.batch import Group, Sample

    bus = MemoryBus(topic_specs())
    await bus.start()
    store = DownStore(tmp_path)
    trainer = Trainer(model=Policy(CFG), optim=OptimConfig(lr=1e-3), publisher=WeightPublisher(bus=bus, store=store))
    assert await trainer.publish() == 1
    mask = torch.arange(12) >= 3
    sample = Sample(token_ids=torch.randint(0, 256, (12,)), loss_mask=mask, logprobs=torch.where(mask, -5.0, 0.0),
                    versions=torch.where(mask, 1, -1))
    group = Group(samples=(sample, sample), rewards=torch.tensor([0.0, 1.0]))
    store.down = True
    metrics = await trainer.train_on([group])
    assert metrics["step"] == 1 and metrics["published"] is False and trainer.version == 1
    with pytest.raises(BlobStoreError):
        await trainer.publish()
    store.down = False
    metrics = await trainer.train_on([group])
    assert metrics["published"] is True and trainer.version == 2  # no gap: v2 is the next one announced
    await bus.close()


# --- handle_batch ----------------------------------------------------------------------------------


async def test_an_outage_is_raised_not_dead_lettered() -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    await bus.send(REWARDS, reward("p/0"))
    seen: list[str] = []

    async def outage(record: Any) -> None:
        seen.append("state")
        raise StateError("redis get failed: connection refused")

    async def judge_down(record: Any) -> None:
        raise JudgeUnavailable("judge endpoint kept failing")

    async with bus.consumer([REWARDS], group="g") as consumer:
        records = await consumer.getmany(timeout_s=1.0)
        with pytest.raises(StateError):
            await handle_batch(consumer, records, outage, DeadLetters(bus), backoff_s=0.001)
        assert len(seen) == 3 and await read_dead_letters(bus, REWARDS.name) == []
        assert await consumer.commit() == {}  # nothing marked: the record will be redelivered
        await handle_batch(consumer, records, judge_down, DeadLetters(bus), backoff_s=0.001)
    (letter,) = await read_dead_letters(bus, REWARDS.name)
    assert letter.error_class == "JudgeUnavailable"  # an input-specific failure still ends in the DLQ
    await bus.close()


# --- weight sync -----------------------------------------------------------------------------------


async def test_weight_sync_rides_out_a_store_outage(tmp_path: Path) -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    store = DownStore(tmp_path)  # the worker's view of the blob store; the trainer's stays up
    model = Policy(CFG)
    publisher = WeightPublisher(bus=bus, store=LocalStore(tmp_path), keyframe_every=100)
    await publisher.publish(model.state_dict(), version=1)
    state = {k: v.clone() for k, v in publisher.snapshot(model.state_dict()).items()}
    sync = WeightSync(bus=bus, store=store, state=state)
    sync.retry_s = 0.1
    stop = asyncio.Event()
    task = asyncio.create_task(sync.run(stop))
    await until(lambda: sync.version == 1, "v1 applied")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    store.down = True  # the worker loses the store ...
    manifest = await publisher.publish(model.state_dict(), version=2)  # ... and v2 is announced
    await until(lambda: bool(sync.refused), "v2 refused while the store is down")
    assert sync.version == 1 and sync.behind == 1 and "BlobStoreError" in sync.refused[-1][1]
    store.down = False
    await until(lambda: sync.version == 2, "v2 fetched by the worker's own retry (no new manifest arrives)")
    stop.set()
    await task
    assert sync.version == 2 and sync.digest == manifest.model_digest and sync.behind == 0
    await bus.close()


async def test_faulty_store_damages_at_rest_and_once_in_flight(tmp_path: Path) -> None:
    store = FaultyStore(LocalStore(tmp_path), at_rest={"a/1": flip_bit}, in_flight={"b/1": flip_bit})
    await store.put("a/1", b"abcdef")
    await store.put("b/1", b"abcdef")
    assert await store.get("a/1") != b"abcdef" and await store.get("a/1") == await store.get("a/1")
    assert await store.get("b/1") != b"abcdef" and await store.get("b/1") == b"abcdef"
    assert len(store.fired) == 2


# --- Redis -----------------------------------------------------------------------------------------


async def test_persistent_redis_survives_sigkill_and_clients_reconnect(tmp_path: Path) -> None:
    server = await asyncio.to_thread(start_redis, dir=tmp_path, persist=True)
    store = RedisStateStore.from_url(server.url, key_prefix="t:", reconnect=True)
    try:
        assert await store.mark_once("outcome", "r1")
        await store.put_field("join:group:p", "r:r1", b"x", None)
        server.process.kill()
        server.process.wait()

        async def restart() -> None:
            await asyncio.sleep(0.5)
            nonlocal server
            server = await asyncio.to_thread(start_redis, server.port, dir=tmp_path, persist=True)

        restarting = asyncio.create_task(restart())
        assert not await store.mark_once("outcome", "r1")  # waits for the restart, then sees the old mark
        await restarting
        assert await store.get_fields("join:group:p") == {"r:r1": b"x"}
    finally:
        await store.close()
        server.stop()


def test_bench_chaos_summary_and_cli_wiring() -> None:
    from rlbus_tools.bench import BENCHMARKS
    from rlbus_tools.bench.chaos import summarize
    from rlbus_tools.chaos.ledger import ScenarioReport

    ok = ScenarioReport(scenario="a", produced=4, trained=4, checks={"x": True}).finish()
    bad = ScenarioReport(scenario="b", produced=4, trained=3, lost=1, checks={"x": True}).finish()
    result = summarize([ok, bad])
    assert [r["scenario"] for r in result["scenarios"]] == ["a", "b"]
    assert result["summary"] == {"scenarios": 2, "passed": 1, "lost": 1, "duplicates_trained": 0,
                                 "corrupt_applied": 0}
    fields = {"faults", "produced", "trained", "dropped", "dead_lettered", "duplicates_trained", "lost",
              "corrupt_applied", "recovery_s"}
    assert fields <= set(result["scenarios"][0])
    assert "chaos" in BENCHMARKS
