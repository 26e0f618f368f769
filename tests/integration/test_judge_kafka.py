"""A reward role rewarding through a real LM judge, from config alone, on real Kafka and Redis.

``[reward] kind = "both"`` with ``[reward.judge]`` naming SmolLM2 on the local engine: the reward worker
(`rlbus.launch.roles.reward_main`) publishes a verifier reward and a judge reward per rollout, the judge's
with one component per rubric dimension (or flagged invalid), and the trainer's join — the policy built
from the same config's ``[trainer]`` — waits for both and combines them by weight, dropping rollouts
whose judgement stayed invalid. The judge's figures ride the worker's heartbeat (what the dashboard shows).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.envs.episode import episode_to_rollout
from rlbus.envs.tasks import generate_prompts
from rlbus.launch.arguments import trainer_args
from rlbus.launch.config import config_from_dict
from rlbus.launch.roles import reward_main
from rlbus.observe.collector import Collector
from rlbus.schemas import Reward, Rollout
from rlbus.state import RedisStateStore
from rlbus.training.join import INVALID_COUNTER, JoinBuffer, RewardPolicy, ScoredGroup
from rlbus_tools.bench.judge import answered
from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 240.0


@pytest.fixture(scope="module")
def smollm2() -> str:
    from rlbus.models.sources import SHIPPED

    name = "smollm2-135m-instruct"
    if name not in SHIPPED:
        pytest.skip("SmolLM2 is not shipped in this build")
    return name


async def test_a_run_rewarded_by_verifier_and_smollm2_judge_from_config(redis_url: str, smollm2: str) -> None:
    namespace = f"judge-{uuid.uuid4().hex[:8]}"
    inner = await kafka_bus()
    bus = NamespacedBus(inner, f"{namespace}.")
    await bus.create_topics(topic_specs(partitions=2))
    config = config_from_dict({
        "bus": {"bootstrap": KAFKA_BOOTSTRAP},
        "state": {"url": redis_url},
        "reward": {"kind": "both", "concurrency": 8, "judge": {
            "rubric": str(ROOT / "infra" / "rlbus" / "rubrics" / "answer.toml"), "backend": "engine",
            "model": smollm2, "prefill": "SCORE: ", "max_tokens": 4, "parse_retries": 1}},
        "trainer": {"reward_sources": ["verifier", "judge"], "reward_weights": {"judge": 0.5},
                    "invalid_judgements": "drop"},
        "run": {"namespace": namespace, "heartbeat_s": 0.5},
    }, {})  # fmt: skip
    args = trainer_args(config)
    state = RedisStateStore.from_url(redis_url, key_prefix=f"rlbus:{namespace}:")
    join = JoinBuffer(state=state, policy=RewardPolicy(sources=args["reward_sources"], weights=args["reward_weights"],
                                                       invalid=args["invalid_judgements"]))  # fmt: skip
    prompts = generate_prompts("arith", seed=3, n=2)
    rollouts: list[Rollout] = []
    for prompt in prompts:
        prompt = msgspec.structs.replace(prompt, group_size=2)
        assert prompt.reference is not None
        for i, answer in enumerate([prompt.reference, str(int(prompt.reference) + 3)]):
            episode = answered(f"{prompt.prompt_id}-{i}", answer)
            rollouts.append(episode_to_rollout(episode, prompt=prompt, group_index=i))
    stop = asyncio.Event()
    groups: list[ScoredGroup] = []
    rewards: list[Reward] = []
    try:
        async with state:
            role = asyncio.create_task(reward_main(config, worker_id="judge-0", stop=stop))
            for rollout in rollouts:
                await bus.send(ROLLOUTS, rollout)
                assert await join.add_rollout(rollout) is None
            deadline = time.monotonic() + DEADLINE_S
            async with bus.consumer([REWARDS], group=f"{namespace}-test") as consumer:
                while len(groups) < len(prompts) and time.monotonic() < deadline and not role.done():
                    for record in await consumer.getmany(timeout_s=0.5):
                        rewards.append(record.value)
                        group = await join.add_reward(record.value)
                        if group is not None:
                            groups.append(group)
            workers = await state.workers("reward")
            while time.monotonic() < deadline and workers[0]["info"].get("judge_judgements") != len(rollouts):
                await asyncio.sleep(0.2)  # the heartbeat after the last judgement
                workers = await state.workers("reward")
            invalid_arrived = await state.get_counter(INVALID_COUNTER)
            stop.set()
            await role
    finally:
        stop.set()
        await inner.close()

    assert len(groups) == len(prompts), f"{len(rewards)} rewards: {[(r.source, r.reason) for r in rewards]}"
    by_source = {source: [r for r in rewards if r.source == source] for source in ("verifier", "judge")}
    assert len(by_source["verifier"]) == len(by_source["judge"]) == len(rollouts)
    judged = {r.rollout_id: r for r in by_source["judge"]}
    for reward in judged.values():
        assert reward.reward_id == f"{reward.rollout_id}:judge" and 0.0 <= reward.value <= 1.0
        assert set(reward.components) <= {"correct", "concise"} and "judge_seconds" in reward.metadata
        valid = reward.metadata["judge_valid"] == "true"
        assert valid == (set(reward.components) == {"correct", "concise"})
    assert invalid_arrived == sum(r.metadata["judge_valid"] == "false" for r in judged.values())
    for group in groups:
        for scored in group.rollouts:
            verifier = scored.components["verifier"]
            assert verifier == (1.0 if scored.rollout.group_index == 0 else 0.0)
            assert scored.reward == pytest.approx(verifier + 0.5 * judged[scored.rollout.rollout_id].value)
            assert join.policy.drops(scored) == (judged[scored.rollout.rollout_id].metadata["judge_valid"] == "false")
    [worker] = workers
    assert worker["info"]["group"] == "reward-both" and worker["info"]["judge_judgements"] == len(rollouts)
    collector = Collector(bus=bus, state=state)
    collector.add_heartbeat(worker, time.time())
    assert collector.snapshot()["judges"]["judge-0"]["judge_judgements"] == len(rollouts)
    print("SmolLM2 judge:", [(r.metadata["reply.correct"], r.value) for r in judged.values()])
