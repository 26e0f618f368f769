"""Replay reproduces a training run's inputs: a run over real Kafka and Redis, then `rlbus replay` of its
rollouts and rewards into fresh topics and a fresh trainer on them — which trains the same groups, rollout
ids and rewards at every step (rlbus/training/ordered.py says why it can).

The roles run in this process (the same mains `rlbus worker` runs, sharing one stop event), so the test
pays for one torch import, not four."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.launch.config import RunConfig, config_from_dict
from rlbus.launch.roles import prompts_main, reward_main, rollout_main, trainer_main
from rlbus.observe.runlog import INPUTS, STEPS, read
from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus

STEPS_WANTED = 4


def run_config(namespace: str, run_dir: Path, redis_url: str, warm_steps: int) -> RunConfig:
    return config_from_dict(
        {
            "bus": {"bootstrap": KAFKA_BOOTSTRAP},
            "state": {"url": redis_url},
            "task": {"group_size": 4, "seed": 3},
            "trainer": {"groups_per_step": 2, "warm_steps": warm_steps, "teacher_error": 0.0, "join_timeout_s": 120.0},
            "rollout": {"episode_threads": 16},
            "run": {"run_dir": str(run_dir), "namespace": namespace},
        },
        {},
    )


def some_reward(run_dir: Path) -> bool:
    return any(r != 0.0 for e in read(run_dir, INPUTS) for g in e["groups"] for r in g["rewards"])


async def until_steps(
    run_dir: Path, steps: int, stop: asyncio.Event, timeout_s: float, *, rewarded: bool = False
) -> None:
    """Set ``stop`` once the trainer logged ``steps`` steps (and, with ``rewarded``, some rollout was
    right, so the rewards compared below are not all zero; at most 3 × ``steps``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = len(list(read(run_dir, STEPS)))
        if done >= 3 * steps or (done >= steps and (not rewarded or some_reward(run_dir))):
            break
        await asyncio.sleep(0.5)
    stop.set()


async def cli(*args: str) -> str:
    rlbus = Path(sys.executable).with_name("rlbus")
    process = await asyncio.create_subprocess_exec(
        str(rlbus), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, out.decode()
    return out.decode()


def comparable(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != "t"}


async def test_a_fresh_trainer_fed_by_replay_trains_the_same_inputs(redis_url: str, tmp_path: Path) -> None:
    bus = await kafka_bus()
    run = uuid.uuid4().hex[:8]
    live, again = f"rp-{run}-live", f"rp-{run}-again"
    for namespace in (live, again):
        await NamespacedBus(bus, f"{namespace}.").create_topics(topic_specs(partitions=3))
    await bus.close()

    # 1. The run: prompts → one rollout worker → reward worker → trainer, until STEPS_WANTED steps.
    original = run_config(live, tmp_path / "live", redis_url, warm_steps=80)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(trainer_main(original, worker_id="trainer", stop=stop))
        tasks.create_task(reward_main(original, worker_id="reward", stop=stop))
        tasks.create_task(rollout_main(original, worker_id="rollout", region="eu-west", stop=stop))
        tasks.create_task(prompts_main(original, worker_id="prompts", stop=stop))
        tasks.create_task(until_steps(tmp_path / "live", STEPS_WANTED, stop, timeout_s=180, rewarded=True))
    trained = [comparable(e) for e in read(tmp_path / "live", INPUTS)]
    assert len(trained) >= STEPS_WANTED, "the original run did not get far enough"
    summary = (tmp_path / "live" / "summary.json").read_text()
    assert '"join_skipped": 0' in summary and '"dropped_timed_out": 0' in summary  # nothing decided by the clock
    assert some_reward(tmp_path / "live")  # the rewards compared are not all zero

    # 2. `rlbus replay` the rollouts and rewards into the fresh topics.
    for topic in (ROLLOUTS.name, REWARDS.name):
        out = await cli("replay", "--topic", f"{live}.{topic}", "--into", f"{again}.{topic}",
                        "--bootstrap", KAFKA_BOOTSTRAP)
        assert "replayed" in out

    # 3. A fresh trainer (its own topics, Redis keys and weights; no warm start: inputs do not depend on it).
    fresh = run_config(again, tmp_path / "again", redis_url, warm_steps=0)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(trainer_main(fresh, worker_id="trainer", stop=stop))
        tasks.create_task(until_steps(tmp_path / "again", len(trained), stop, timeout_s=120))
    replayed = [comparable(e) for e in read(tmp_path / "again", INPUTS)]
    assert len(replayed) >= len(trained)
    for step, (want, got) in enumerate(zip(trained, replayed, strict=False), start=1):
        assert got == want, f"step {step} differs"
    seqs = [g["seq"] for e in trained for g in e["groups"]]
    assert seqs == sorted(set(seqs)), "groups were not trained in prompt order"
