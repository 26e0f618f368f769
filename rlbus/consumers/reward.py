"""The reward worker: scores rollouts with its scorers and publishes rewards (verifiers, sandboxed tests, LM judges).

It joins the consumer group ``reward-<kind>`` on ``rl.rollouts.v1`` — any number of workers per kind,
each kind its own group, so the environment's verifier and an LM judge both see every rollout. A rollout carries
its prompt (environment, config, reference), so scoring needs nothing else. The worker holds a list of scorers
(`rlbus.rewards.scorers`: the ``verifier`` asks the prompt's environment or the user's reward function, the
``judge`` an LM judge with a rubric, a user's scorer whatever it does) and scores each rollout with all of them
concurrently, publishing every reward (``kind = "both"`` is the verifier and the judge in one group,
``reward-both``; the trainer's ``reward_sources`` say which it waits for). The reward's ``source`` is what the
scorer says (``verifier`` for exact answers, ``sandbox`` for hidden unit tests, ``judge``). When a scorer raises
(a reward function that fails, a judge that keeps failing) the rollout is dead-lettered with that reason and none
of its rewards is published. Rewards go to
``rl.rewards.v1`` keyed by rollout id, with the id ``<rollout>:<source>``, so a redelivered rollout
scored twice changes nothing downstream. Served traffic (``rlbus serve``: ``metadata.origin = "served"``,
no prompt) is skipped and counted, not dead-lettered: its rewards come from its users (the feedback API,
a session's reward), and without a prompt there is no reference to verify against. A rollout that cannot
be scored (no prompt, unknown environment, a judge that keeps failing) goes to the DLQ with the reason; the
worker never stops for bad input.

Never imports torch for verifiers and HTTP judges: scoring is CPU-light and lives beside the sandbox,
away from the GPUs. Only a judge on a local engine (``[reward.judge] backend = "engine"``) loads torch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from rlbus.bus.base import Bus
from rlbus.bus.dlq import DeadLetters, handle_batch
from rlbus.bus.topics import REWARDS, ROLLOUTS
from rlbus.bus.types import Record
from rlbus.envs.episode import rollout_to_episode
from rlbus.errors import MalformedMessage
from rlbus.metrics import HACKS, REWARD, observe_processing
from rlbus.observe.lag import LagProbe
from rlbus.observe.logs import record_fields
from rlbus.rewards.hacks import HackPolicy, apply_hack_policy
from rlbus.rewards.scorers import Scorer
from rlbus.rewards.verifier import VerifierScorer
from rlbus.schemas import Reward, Rollout
from rlbus.training.join import is_served

log = logging.getLogger("rlbus.consumers.reward")


class RewardWorker:
    def __init__(
        self,
        *,
        bus: Bus,
        kind: str = "verifier",
        scorers: Sequence[Scorer] | None = None,
        worker_id: str = "reward-0",
        concurrency: int = 4,
        max_batch: int = 64,
        on_reward: Callable[[Reward, Rollout], None] | None = None,
        hack_policy: HackPolicy = "zero",
        hack_penalty: float = 0.5,
    ) -> None:
        """A worker of group ``reward-<kind>`` scoring with ``scorers`` (default: the environments' verifier)."""
        self._bus = bus
        self.kind = kind
        self.scorers: list[Scorer] = list(scorers) if scorers is not None else [VerifierScorer()]
        if not self.scorers:
            raise ValueError("a reward worker needs at least one scorer")
        self.worker_id = worker_id
        self._concurrency = concurrency
        self._max_batch = max_batch
        self._on_reward = on_reward
        self.scored = 0
        #: Served rollouts (no prompt: rated by their users) passed over.
        self.skipped_served = 0
        self.dead_letters = DeadLetters(bus)
        self.lag_probe = LagProbe()
        self.hack_policy: HackPolicy = hack_policy
        self.hack_penalty = hack_penalty
        #: Rollouts whose environment found reward hacking, by kind (`Reward.hack_kinds`).
        self.hacks: Counter[str] = Counter()

    def stats(self) -> dict[str, Any]:
        """What this worker's heartbeat carries (``processed`` = rollouts scored)."""
        return {
            "group": self.group, "topics": [ROLLOUTS.name], "kind": self.kind, "processed": self.scored,
            "scored": self.scored, "skipped_served": self.skipped_served,
            "dead_letters": sum(self.dead_letters.counts.values()),
            "lag": self.lag_probe.total, "hacks": dict(self.hacks), "hack_policy": self.hack_policy,
            **{k: v for scorer in self.scorers for k, v in scorer.stats().items()},
        }

    @property
    def group(self) -> str:
        return f"reward-{self.kind}"

    async def score(self, rollout: Rollout) -> list[Reward]:
        """The rewards of every scorer for ``rollout``, scored concurrently, in the scorers' order."""
        prompt = rollout.prompt
        if prompt is None:
            raise MalformedMessage(f"rollout {rollout.rollout_id} carries no prompt; it cannot be scored")
        episode = rollout_to_episode(rollout)
        rewards = await asyncio.gather(*(scorer.score(episode, prompt) for scorer in self.scorers))
        return [msgspec.structs.replace(r, rollout_created_at=rollout.created_at) for r in rewards]

    async def _handle(self, record: Record[Any]) -> None:
        rollout: Rollout = record.value
        if rollout.prompt is None and is_served(rollout):
            self.skipped_served += 1
            log.debug("skipped served rollout %s rollout=%s (rated by its users)", record.where, rollout.rollout_id,
                      extra=record_fields(record, rollout_id=rollout.rollout_id, worker=self.worker_id))  # fmt: skip
            return
        t0 = time.perf_counter()
        rewards = [self._police(r, record) for r in await self.score(rollout)]
        for reward in rewards:
            if not math.isfinite(reward.value):  # a NaN reward would poison the whole batch's advantages
                raise MalformedMessage(f"rollout {rollout.rollout_id}: {reward.source} scored {reward.value}")
        for reward in rewards:
            await self._bus.send(REWARDS, reward)
            REWARD.labels(reward.source).observe(reward.value)
            if self._on_reward is not None:
                self._on_reward(reward, rollout)
            log.debug(
                "scored %s rollout=%s source=%s value=%.3f in %.3fs",
                record.where, rollout.rollout_id, reward.source, reward.value, time.perf_counter() - t0,
                extra=record_fields(record, rollout_id=rollout.rollout_id, worker=self.worker_id),
            )
        self.scored += 1
        observe_processing("reward", t0)

    def _police(self, reward: Reward, record: Record[Any]) -> Reward:
        """``[reward] hack_policy`` on a reward whose environment found hacking (`Reward.hack_kinds`); counted
        by kind."""
        kinds = reward.hack_kinds
        if not kinds:
            return reward
        self.hacks.update(kinds)
        for kind in kinds:
            HACKS.labels(kind).inc()
        policed = apply_hack_policy(reward, self.hack_policy, self.hack_penalty)
        log.warning("hack monitor %s rollout=%s found %s: reward %g → %g (hack_policy %s)", record.where,
                    reward.rollout_id, ",".join(kinds), reward.value, policed.value, self.hack_policy,
                    extra=record_fields(record, rollout_id=reward.rollout_id, worker=self.worker_id))
        return policed

    async def run(self, stop: asyncio.Event) -> None:
        try:
            async with self._bus.consumer([ROLLOUTS], group=self.group, instance_id=None) as consumer:
                while not stop.is_set():
                    await self.lag_probe.refresh(consumer)
                    batch = await consumer.getmany(timeout_s=0.2, max_records=self._max_batch)
                    if not batch:
                        continue
                    await handle_batch(consumer, batch, self._handle, self.dead_letters,
                                       concurrency=self._concurrency)  # fmt: skip
                    await consumer.commit_or_defer()
        finally:
            for scorer in self.scorers:
                await scorer.close()
