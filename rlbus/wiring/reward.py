"""The reward worker: the task's verifier (or a user's reward function), an LM judge, or both, scoring rollouts
on the bus.

The judge (with ``kind`` judge or both) comes in built: `rlbus.launch.arguments.judge_for` builds it from
``[reward.judge]``, a local engine or an OpenAI-compatible endpoint. Nothing here imports torch, so a reward
worker with the verifier or an HTTP judge never loads it.
"""

from __future__ import annotations

from collections.abc import Callable

from rlbus.bus.base import Bus
from rlbus.consumers.reward import RewardWorker
from rlbus.rewards.function import RewardFunction
from rlbus.rewards.hacks import HackPolicy
from rlbus.rewards.judge import Judge
from rlbus.schemas import Reward, Rollout


def reward_worker(
    *,
    bus: Bus,
    kind: str = "verifier",
    judge: Judge | None = None,
    concurrency: int = 4,
    worker_id: str = "reward-0",
    max_batch: int = 64,
    on_reward: Callable[[Reward, Rollout], None] | None = None,
    function: RewardFunction | None = None,
    hack_policy: HackPolicy = "zero",
    hack_penalty: float = 0.5,
) -> RewardWorker:
    """A reward worker of ``kind`` (``verifier``, ``judge`` or ``both``; the judge kinds need ``judge``) in the
    consumer group ``reward-<kind>``, scoring up to ``concurrency`` rollouts at once. ``function`` (a user's
    ``[reward] function``) replaces the environment's verifier; ``hack_policy`` says what a reward whose
    environment found hacking becomes (`rlbus.rewards.hacks.apply_hack_policy`)."""
    return RewardWorker(bus=bus, kind=kind, judge=judge, worker_id=worker_id, concurrency=concurrency,
                        max_batch=max_batch, on_reward=on_reward, function=function, hack_policy=hack_policy,
                        hack_penalty=hack_penalty)
