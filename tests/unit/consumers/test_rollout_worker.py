"""The rollout worker plays each prompt's group with a real (tiny) policy and publishes rollouts."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from rlbus.bus import MemoryBus
from rlbus.bus.topics import PROMPTS, ROLLOUTS, topic_specs
from rlbus.consumers.rollout import RolloutWorker, episode_threads
from rlbus.engines.batching import BatchingEngine
from rlbus.engines.torch_engine import TorchEngine
from rlbus.envs.chat import ChatFormat
from rlbus.envs.tasks import generate_prompts
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.schemas import Rollout


async def test_worker_publishes_a_group_per_prompt() -> None:
    episode_threads(16)
    torch.manual_seed(0)
    tokenizer = ByteTokenizer()
    model = Policy(PolicyConfig.tiny())
    inner = TorchEngine(model, tokenizer=tokenizer, seed=0, policy_version=4)
    engine = BatchingEngine(inner, max_batch=16, window_s=0.01)
    bus = MemoryBus(topic_specs())
    await bus.start()
    prompts = generate_prompts("arith", seed=1, n=2)
    for prompt in prompts:
        await bus.send(PROMPTS, prompt)
    worker = RolloutWorker(bus=bus, engine=engine, chat=ChatFormat.for_byte_tokenizer(tokenizer), worker_id="w-eu")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    rollouts: list[Rollout] = []
    async with bus.consumer([ROLLOUTS], group=None) as consumer:
        for _ in range(600):
            rollouts += [r.value for r in await consumer.getmany(timeout_s=0.1)]
            if len(rollouts) == sum(p.group_size for p in prompts):
                break
    stop.set()
    await task
    assert len(rollouts) == sum(p.group_size for p in prompts)
    assert engine.batches < engine.requests  # episodes of a group shared forward passes
    for prompt in prompts:
        group = sorted((r for r in rollouts if r.prompt_id == prompt.prompt_id), key=lambda r: r.group_index)
        assert [r.group_index for r in group] == list(range(prompt.group_size))
        assert len({r.rollout_id for r in group}) == prompt.group_size
        for r in group:
            mask = r.loss_mask.to_numpy().astype(bool)
            versions = r.token_versions.to_numpy()
            assert mask.any() and (versions[mask] == 4).all() and (versions[~mask] == -1).all()
            assert (r.logprobs.to_numpy()[mask] <= 0).all() and np.isfinite(r.logprobs.to_numpy()).all()
            assert r.prompt is not None and r.prompt.reference == prompt.reference
            assert r.routed_experts is not None and r.worker_id == "w-eu"
    committed = await bus.committed("rollout", PROMPTS.name)
    assert sum(v or 0 for v in committed.values()) == 2


async def test_on_policy_worker_waits_for_the_prompts_version() -> None:
    """Synchronous RL: a prompt admitted at version 5 is played only once the engine serves version 5."""
    from msgspec.structs import replace

    episode_threads(16)
    torch.manual_seed(0)
    tokenizer = ByteTokenizer()
    inner = TorchEngine(Policy(PolicyConfig.tiny()), tokenizer=tokenizer, seed=0, policy_version=4)
    bus = MemoryBus(topic_specs())
    await bus.start()
    prompt = replace(generate_prompts("arith", seed=1, n=1)[0], policy_version=5, group_size=2)
    await bus.send(PROMPTS, prompt)
    worker = RolloutWorker(
        bus=bus, engine=inner, chat=ChatFormat.for_byte_tokenizer(tokenizer), worker_id="w", on_policy=True
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.sleep(0.5)
    assert worker.rollouts == 0  # still on version 4
    inner.policy_version = 5
    for _ in range(300):
        if worker.rollouts == 2:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task
    assert worker.rollouts == 2 and worker.active_s > 0
