"""`rlbus status --json` against real Kafka and Redis: a reward worker with a heartbeat shows up with
its region and throughput, and its consumer group's lag goes from the rollouts waiting to zero."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer
from aiokafka import TopicPartition as KafkaTP
from typer.testing import CliRunner

from rlbus.aio import until
from rlbus.bus.topics import ROLLOUTS, topic_specs
from rlbus.cli.app import app
from rlbus.consumers.reward import RewardWorker
from rlbus.envs.agent import reference_episode
from rlbus.envs.base import env_for
from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import episode_to_rollout
from rlbus.envs.tasks import generate_prompts
from rlbus.observe.heartbeat import Heartbeat
from rlbus.schemas import Rollout
from rlbus.state.redis import RedisStateStore
from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus


async def rollouts(marker: str, n: int) -> list[Rollout]:
    chat = ChatFormat.for_byte_tokenizer()
    out = []
    for i, prompt in enumerate(generate_prompts("arith", seed=11, n=n)):
        prompt = msgspec.structs.replace(prompt, prompt_id=f"{marker}-{i}")
        episode = await reference_episode(env_for(prompt), prompt, chat=chat)  # type: ignore[arg-type]
        out.append(episode_to_rollout(episode, prompt=prompt, group_index=0))
    return out


async def start_group_at_end(group: str, ends: dict[int, int]) -> None:
    """Commit the group at today's end offsets, so only this test's rollouts are its backlog."""
    consumer = AIOKafkaConsumer(bootstrap_servers=KAFKA_BOOTSTRAP, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = {KafkaTP(ROLLOUTS.name, p): end for p, end in ends.items()}
        consumer.assign(list(tps))
        await consumer.commit(tps)
    finally:
        await consumer.stop()


def status_json(redis_url: str, prefix: str) -> dict[str, Any]:
    result = CliRunner().invoke(
        app, ["status", "--json", "--bootstrap", KAFKA_BOOTSTRAP, "--redis", redis_url, "--redis-prefix", prefix]
    )
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def group_lag(data: dict[str, Any], group: str) -> dict[str, Any]:
    (entry,) = [g for g in data["lag"] if g["group"] == group and g["topic"] == ROLLOUTS.name]
    for p in entry["partitions"]:
        assert p["lag"] == p["end"] - p["committed"]
    return entry


async def test_status_lists_a_live_reward_worker_and_its_group_lag(redis_url: str) -> None:
    kind = f"t{uuid.uuid4().hex[:8]}"
    group, worker_id, prefix = f"reward-{kind}", f"reward-{kind}-0", f"rlbus-test-{kind}:"
    bus = await kafka_bus()  # started already
    state = RedisStateStore.from_url(redis_url, key_prefix=prefix)
    try:
        await bus.create_topics(topic_specs())
        start = await bus.end_offsets(ROLLOUTS.name)
        await start_group_at_end(group, start)
        sent = [await bus.send(ROLLOUTS, r) for r in await rollouts(kind, 3)]

        worker = RewardWorker(bus=bus, kind=kind, worker_id=worker_id)
        beat = Heartbeat(state=state, role="reward", worker_id=worker_id, region="eu-west", info=worker.stats,
                         every_s=0.2, ttl_s=30)
        await beat.beat()  # registered, not consuming yet: its backlog is the three rollouts
        waiting = await asyncio.to_thread(status_json, redis_url, prefix)
        (listed,) = [w for w in waiting["workers"] if w["worker_id"] == worker_id]
        assert listed["role"] == "reward" and listed["info"]["region"] == "eu-west"
        assert waiting["roles"]["reward"] == {"eu-west": 1}
        backlog = group_lag(waiting, group)
        assert backlog["members"] == 1
        assert {p["partition"]: p["committed"] for p in backlog["partitions"]} == start
        assert backlog["total"] >= 3

        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(worker.run(stop))
            tasks.create_task(beat.run(stop))
            done: dict[str, Any] = {}

            async def all_committed() -> bool:
                committed = await bus.committed(group, ROLLOUTS.name)
                return all((committed[m.partition] or 0) > m.offset for m in sent)

            async def scored_beat() -> bool:  # a beat after the commit carries the scored count
                done.update(await asyncio.to_thread(status_json, redis_url, prefix))
                return any(w["worker_id"] == worker_id and w["info"]["scored"] >= 3 for w in done["workers"])

            await until(all_committed, "the three rollouts committed", every_s=0.2)
            await until(scored_beat, "a heartbeat carrying the scored count", every_s=0.2)
            stop.set()
    finally:
        await bus.close()
        await state.close()

    (listed,) = [w for w in done["workers"] if w["worker_id"] == worker_id]
    assert listed["info"]["scored"] >= 3 and listed["info"]["throughput"] > 0
    assert listed["info"]["status"] == "running" and listed["age_s"] < 5
    caught_up = group_lag(done, group)
    final = {p["partition"]: p["committed"] for p in caught_up["partitions"]}
    assert all(final[m.partition] > m.offset for m in sent)
    assert caught_up["total"] <= backlog["total"] - 3
