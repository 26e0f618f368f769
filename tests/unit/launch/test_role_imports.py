"""The prompt producer and the reward worker run their real mains without ever importing torch, and stop
on SIGTERM with their work committed (in a subprocess, on the in-memory bus and state store)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import asyncio, json, os, signal, sys
import numpy as np
import rlbus.launch.roles as roles
from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import PROMPTS, REWARDS, ROLLOUTS, topic_specs
from rlbus.envs.tasks import generate_prompts
from rlbus.launch.config import config_from_dict
from rlbus.schemas import Rollout, TensorData
from rlbus.state.memory import MemoryStateStore
from rlbus.state.progress import PROMPT_SEQ

config = config_from_dict({"state": {"url": "memory://"}, "task": {"group_size": 2},
                           "trainer": {"groups_per_step": 2, "grpo": {"max_staleness": 1}}}, {})
buses = {"prompts": MemoryBus(topic_specs(partitions=2)), "reward": MemoryBus(topic_specs(partitions=2))}
state = MemoryStateStore()

async def read(bus, topic):
    async with bus.consumer([topic], group=None) as consumer:
        return [r.value for r in await consumer.getmany(timeout_s=0.2)]

async def run(role, main):
    asyncio.get_running_loop().call_later(1.0, os.kill, os.getpid(), signal.SIGTERM)
    await main(config, worker_id=role, bus=buses[role], state=state)

async def main():
    await run("prompts", roles.prompts_main)
    prompts = await read(buses["prompts"], PROMPTS)
    await buses["reward"].start()
    prompt = generate_prompts("arith", seed=0, n=1, config={"digits": 1})[0]
    ids = TensorData.from_numpy(np.array([1, 2, 3], dtype=np.int32))
    await buses["reward"].send(ROLLOUTS, Rollout(
        rollout_id="r0", prompt_id=prompt.prompt_id, group_index=0, group_size=1, token_ids=ids,
        loss_mask=TensorData.from_numpy(np.array([0, 1, 1], dtype=np.uint8)),
        logprobs=TensorData.from_numpy(np.zeros(3, dtype=np.float32)), token_versions=ids, prompt=prompt))
    await run("reward", roles.reward_main)
    rewards = await read(buses["reward"], REWARDS)
    print(json.dumps({"torch": "torch" in sys.modules, "seqs": sorted(int(p.metadata["seq"]) for p in prompts),
                      "counter": await state.get_counter(PROMPT_SEQ),
                      "rewards": [r.rollout_id for r in rewards]}))

asyncio.run(main())
"""


def test_prompts_and_reward_roles_never_import_torch() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch"] is False
    # Admission: the trainer trains its first step at v1 (it publishes its initial weights first), so before
    # it has: (version 0 − base 1 + max_staleness 1 + 1) × 2 groups per step = 2 prompts, numbered from 0.
    assert result["seqs"] == [0, 1] and result["counter"] == 2
    assert result["rewards"] == ["r0"]
