"""The coding environment end to end on a real broker: a prompt on ``rl.prompts.v1``, a rollout worker
playing the scripted expert in a sandboxed repository, the rollout (its final diff included) riding the
claim check because it is large, and the reward worker grading the diff with the hidden tests."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path

import msgspec

from rlbus.blobs.local import LocalStore
from rlbus.bus.claimcheck import ClaimCheckBus
from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import PROMPTS, REWARDS, ROLLOUTS, topic_specs
from rlbus.consumers.reward import RewardWorker
from rlbus.consumers.rollout import RolloutWorker
from rlbus.envs.base import make_env
from rlbus.envs.chat import ChatFormat, format_tool_call
from rlbus.envs.scripted import ScriptedEngine
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.schemas import Reward, Rollout
from tests.conftest import kafka_bus

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "swe" / "corpus"


async def test_swe_episode_rollout_and_reward_over_kafka(tmp_path: Path) -> None:
    chat = ChatFormat.for_byte_tokenizer(ByteTokenizer())
    env = make_env("swe", {"corpus": [str(CORPUS)], "tasks": ["calc-add"]})
    [prompt] = env.generate(0, 1)
    prompt = msgspec.structs.replace(prompt, group_size=1)
    turns = await asyncio.to_thread(make_env("swe", prompt.env_config).reference_turns, prompt)  # type: ignore[attr-defined]
    # a 130 KB generated module on top of the fix: the diff pushes the rollout over the (lowered) claim threshold
    bulky = format_tool_call("bash", "python -c \"open('calc/table.py', 'w').write(''.join(f'T{i} = {i}\\n' "
                                     "for i in range(12000)))\"")  # fmt: skip
    engine = ScriptedEngine([*turns[:-1], bulky, turns[-1]], tokenizer=chat.tokenizer)

    plain = await kafka_bus()
    bus = ClaimCheckBus(NamespacedBus(plain, f"swe-{uuid.uuid4().hex[:8]}."), LocalStore(tmp_path / "blobs"),
                        threshold_bytes=64 * 1024)  # fmt: skip
    rollouts: list[Rollout] = []
    rewards: list[tuple[Reward, Rollout]] = []
    try:
        await bus.create_topics(topic_specs())
        rollout_worker = RolloutWorker(bus=bus, engine=engine, chat=chat, worker_id="swe-rollout",
                                       on_rollout=rollouts.append)  # fmt: skip
        scored = asyncio.Event()

        def on_reward(reward: Reward, rollout: Rollout) -> None:
            rewards.append((reward, rollout))
            scored.set()

        reward_worker = RewardWorker(bus=bus, worker_id="swe-reward", on_reward=on_reward)
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as group:
            group.create_task(rollout_worker.run(stop))
            group.create_task(reward_worker.run(stop))
            await bus.send(PROMPTS, prompt)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(scored.wait(), 120)
            stop.set()
    finally:
        await plain.close()

    assert len(rewards) == 1, "no reward within 120 s"
    reward, graded = rewards[0]
    assert bus.claims_written >= 1  # the rollout went through the blob store
    assert graded.metadata["swe.task"] == "calc-add" and "calc/table.py" in graded.metadata["swe.patch"]
    assert reward.value == 1.0 and reward.source == "tests" and reward.rollout_id == graded.rollout_id
    assert reward.components["fail_to_pass"] == 1.0 and reward.components["pass_to_pass"] == 1.0
    assert {ROLLOUTS.name, REWARDS.name} <= {t.name for t in topic_specs()}
