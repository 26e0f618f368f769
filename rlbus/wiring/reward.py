"""The reward worker: its scorers (the task's verifier or a user's reward function, an LM judge, a user's
scorer — `rlbus.rewards.scorers`) scoring rollouts on the bus.

The scorers come in built: `rlbus.launch.arguments.reward_args` builds them from ``[reward]`` (each from its own
table: ``[reward.judge]`` for the judge, ``[reward.<name>]`` for a user's). Nothing here imports torch, so a
reward worker with the verifier or an HTTP judge never loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rlbus.bus.base import Bus
from rlbus.consumers.reward import RewardWorker
from rlbus.rewards.hacks import HackPolicy
from rlbus.rewards.scorers import Scorer
from rlbus.schemas import Reward, Rollout


def reward_worker(
    *,
    bus: Bus,
    kind: str = "verifier",
    scorers: Sequence[Scorer] | None = None,
    concurrency: int = 4,
    worker_id: str = "reward-0",
    max_batch: int = 64,
    on_reward: Callable[[Reward, Rollout], None] | None = None,
    hack_policy: HackPolicy = "zero",
    hack_penalty: float = 0.5,
) -> RewardWorker:
    """A reward worker in the consumer group ``reward-<kind>`` scoring each rollout with every one of ``scorers``
    (default: the environments' verifier), up to ``concurrency`` rollouts at once; ``hack_policy`` says what a
    reward whose environment found hacking becomes (`rlbus.rewards.hacks.apply_hack_policy`)."""
    return RewardWorker(bus=bus, kind=kind, scorers=scorers, worker_id=worker_id, concurrency=concurrency,
                        max_batch=max_batch, on_reward=on_reward, hack_policy=hack_policy, hack_penalty=hack_penalty)
