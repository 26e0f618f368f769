"""A scripted hacking policy through the real reward worker and trainer (issue 27, item 5): on an in-memory bus,
each step's rollouts are played through the real harness by a scripted engine that hacks in a growing share
of them (0, 1, 2, 3 of every group of 4), scored by an environment whose tests the hacks fool but whose
monitor names them (`tests.fixtures.hacking`). Under ``hack_policy = "zero"`` every hacked rollout's reward
is 0 although the tests passed, the reward worker's counts by kind grow, and the trainer's ``hacked`` share —
in its step metrics, its log line, its heartbeat and the ``rlbus_trainer_hacked`` gauge — rises step by step
while the mean reward falls with it."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from rlbus.aio import until
from rlbus.bus import MemoryBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.consumers.reward import RewardWorker
from rlbus.consumers.trainer import TrainerWorker
from rlbus.envs.agent import run_episode
from rlbus.envs.base import env_for
from rlbus.envs.chat import ChatFormat, format_answer
from rlbus.envs.episode import episode_to_rollout
from rlbus.envs.scripted import ScriptedEngine
from rlbus.metrics import REGISTRY
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.schemas import Prompt, Reward, Rollout, SamplingInfo
from rlbus.state import MemoryStateStore
from rlbus.training.join import JoinBuffer, RewardPolicy
from rlbus.training.step import GRPOConfig, OptimConfig
from rlbus.training.trainer import Trainer
from tests.fixtures.hacking import HACKS

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=256, n_experts=4, top_k=2, d_ff=32)
CHAT = ChatFormat.for_byte_tokenizer()
FIX = "return a + b"
EXIT, ALWAYS_EQUAL = list(HACKS)
STEPS, GROUPS, G = 4, 2, 4


def answer(step: int, i: int) -> str:
    """The scripted policy: in step ``step`` the first ``step`` samples of a group hack (exits and always-equal
    in turn), the rest write the fix."""
    if i >= step:
        return FIX
    return EXIT if i % 2 == 0 else ALWAYS_EQUAL


async def rollouts(step: int, version: int) -> list[Rollout]:
    out = []
    for g in range(GROUPS):
        prompt = Prompt(prompt_id=f"s{step}g{g}", env="tests.fixtures.hacking:FooledGrader", group_size=G,
                        text="Make add(a, b) pass its tests.", reference=FIX, policy_version=version)
        for i in range(G):
            engine = ScriptedEngine([format_answer(answer(step, i))], tokenizer=CHAT.tokenizer, policy_version=version)
            episode = await run_episode(env_for(prompt), prompt, engine=engine, chat=CHAT,
                                        sampling=SamplingInfo(temperature=1.0), episode_id=f"{prompt.prompt_id}/{i}")
            out.append(episode_to_rollout(episode, prompt=prompt, group_index=i))
    return out


def counted(kind: str) -> float:
    return REGISTRY.get_sample_value("rlbus_reward_hacks_total", {"kind": kind}) or 0.0


async def test_a_hacking_policy_raises_the_hacked_share_and_earns_nothing(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    bus = MemoryBus(topic_specs())
    await bus.start()
    state = MemoryStateStore()
    trainer = Trainer(model=Policy(CFG), optim=OptimConfig(lr=1e-3), grpo=GRPOConfig(max_staleness=4))
    trainer_worker = TrainerWorker(bus=bus, trainer=trainer, join=JoinBuffer(state=state, policy=RewardPolicy()),
                                   state=state, groups_per_step=GROUPS, max_steps=STEPS)  # fmt: skip
    reward_worker = RewardWorker(bus=bus, hack_policy="zero")
    before = {kind: counted(kind) for kind in HACKS.values()}
    hack_counts: list[dict[str, int]] = []
    stop = asyncio.Event()
    with caplog.at_level(logging.INFO, logger="rlbus.consumers.trainer"):
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(reward_worker.run(stop))
            tasks.create_task(trainer_worker.run(stop))
            for step in range(STEPS):
                for rollout in await rollouts(step, trainer.version):
                    await bus.send(ROLLOUTS, rollout)
                await until(lambda: trainer.step == len(hack_counts) + 1, f"trainer step {step + 1}")
                hack_counts.append(reward_worker.stats()["hacks"])
            stop.set()

    hacked = [m["hacked"] for m in trainer_worker.steps]
    assert hacked == [0.0, 0.25, 0.5, 0.75]  # 0, 1, 2, 3 of each group's 4 rollouts
    assert [m["reward_mean"] for m in trainer_worker.steps] == [1.0, 0.75, 0.5, 0.25]  # the hacks earned nothing
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split("hacked ")[1].split(",")[0] for line in lines] == ["0.000", "0.250", "0.500", "0.750"]
    assert trainer_worker.stats()["last_step"]["hacked"] == 0.75
    assert REGISTRY.get_sample_value("rlbus_trainer_hacked") == 0.75

    assert hack_counts == [{}, {"exit": 2}, {"exit": 4, "always_equal": 2}, {"exit": 8, "always_equal": 4}]
    assert {kind: counted(kind) - before[kind] for kind in HACKS.values()} == {"exit": 8, "always_equal": 4}
    rewards: list[Reward] = []
    async with bus.consumer([REWARDS], group=None) as consumer:
        while len(rewards) < STEPS * GROUPS * G:
            rewards += [r.value for r in await consumer.getmany(timeout_s=0.1)]
    hacks = [r for r in rewards if r.hack_kinds]
    assert len(hacks) == 12 and len(rewards) == 32
    assert all(r.value == 0.0 and r.metadata["value_before_hack_policy"] == "1" for r in hacks)  # the tests passed
    assert all(r.value == 1.0 for r in rewards if not r.hack_kinds)
