"""The whole RL loop in one process for chaos scenarios: the real workers on a real bus and state store.

Prompt producer → rollout workers (tiny MoE policy, real engine, optional weight sync) → verifier reward
worker → trainer (join buffer, GRPO steps, optional weight publishing) — the classes the distributed
mode runs, as asyncio tasks, so a scenario can break the infrastructure underneath them (brokers, Redis,
the blob store) or feed them poison and then check the ledger. The policy is tiny (~50 k parameters) and
the task one-digit addition, so a few dozen groups take seconds on two cores.

The trainer's join buffer is a :class:`CountingJoin`: it counts every rollout id handed to the optimizer
*before* the ledger's exactly-once gate, so "trained twice" is measured independently of the gate it
tests. With weights flowing, every swap records the digest of the weights the engine serves from then
on (``served``), so a scenario can compare it with the trainer's truth for that version — independently
of the worker's own digest check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rlbus.blobs.base import BlobStore
from rlbus.bus.base import Bus
from rlbus.consumers.rollout import episode_threads
from rlbus.launch.arguments import model_source, producer_args, reward_args, rollout_args, trainer_args
from rlbus.launch.config import ModelSection, RewardSection, RolloutSection, RunConfig, TaskSection, TrainerSection
from rlbus.models.config import PolicyConfig
from rlbus.schemas import Rollout
from rlbus.state.base import StateStore
from rlbus.training.config import GRPOConfig
from rlbus.training.join import JoinBuffer, Outcome
from rlbus.weights.digest import state_digest
from rlbus.weights.sync import live_state
from rlbus.wiring.producer import prompt_producer
from rlbus.wiring.reward import reward_worker
from rlbus.wiring.rollout import rollout_stack
from rlbus.wiring.trainer import trainer_stack

log = logging.getLogger("rlbus_tools.chaos")

TINY = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


#: The loop's run config: the tiny policy on one-digit sums in groups of 4, two groups per step at lr 1e-3, a
#: keyframe every 3 versions and every version kept, the join in arrival order with a timeout longer than any
#: stall a scenario causes (groups wait for their rewards instead of dropping), a staleness bound so large
#: that no scenario drops stale work, and advantages only centred (the scenarios audit the ledger, not learning).
CHAOS_RUN = RunConfig(
    task=TaskSection(group_size=4),
    model=ModelSection(options=TINY),
    trainer=TrainerSection(lr=1e-3, groups_per_step=2, keyframe_every=3, retain_versions=1000, join_timeout_s=60.0,
                           ordered=False, grpo=GRPOConfig(max_staleness=1_000_000, normalize_std=False)),
    rollout=RolloutSection(max_batch=32),
    reward=RewardSection(concurrency=4),
)


@dataclass(frozen=True)
class PipelineConfig:
    """How much work a scenario pushes through the loop; the loop itself is a run config (``run``: task,
    model, trainer, rollout and reward settings, read by the builders' argument functions as every role's)."""

    run: RunConfig = CHAOS_RUN
    #: Prompts the producer publishes (each a group of ``run.task.group_size`` rollouts).
    prompts: int = 24
    rollout_workers: int = 2
    #: Publish weights every step (needs a blob store) and make workers follow them.
    weights: bool = False
    model_id: str = "policy"

    @classmethod
    def seeded(cls, seed: int, *, trainer: dict[str, Any] | None = None, **fields: Any) -> PipelineConfig:
        """``CHAOS_RUN`` with ``task.seed = seed`` (and these ``[trainer]`` fields), and these fields."""
        return cls(run=CHAOS_RUN.tuned(task={"seed": seed}, trainer=trainer or {}), **fields)


class CountingJoin(JoinBuffer):
    """A join buffer that also counts every id recorded as trained, before the exactly-once gate."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.handed_to_optimizer: Counter[str] = Counter()

    async def record(self, outcome: Outcome, rollout_ids: Iterable[str]) -> int:
        ids = list(rollout_ids)
        if outcome is Outcome.TRAINED:
            self.handed_to_optimizer.update(ids)
        return await super().record(outcome, ids)

    @property
    def trained_twice(self) -> int:
        return sum(n - 1 for n in self.handed_to_optimizer.values() if n > 1)


class Pipeline:
    """Every role of the loop over ``bus`` + ``state`` (+ ``store`` when weights flow)."""

    def __init__(
        self,
        *,
        bus: Bus,
        state: StateStore,
        config: PipelineConfig,
        run_id: str,
        store: BlobStore | None = None,
    ) -> None:
        if config.weights and store is None:
            raise ValueError("a pipeline with weights needs a blob store")
        self.bus = bus
        self.state = state
        self.config = config
        self.run_id = run_id
        self.store = store
        run, seed = config.run, config.run.task.seed
        source = model_source(run)
        trainer = trainer_stack(
            bus=bus, state=state, store=store if config.weights else None, model=source.build(seed=seed),
            model_id=config.model_id, join_class=CountingJoin, expire_every_s=0.5, **trainer_args(run),
        )
        self.trainer, self.publisher, self.trainer_worker = trainer.trainer, trainer.publisher, trainer.worker
        assert isinstance(trainer.join, CountingJoin)
        self.join: CountingJoin = trainer.join
        #: (monotonic time, worker index, version, digest of the weights the engine serves from then on)
        self.served: list[tuple[float, int, int, str]] = []
        #: (monotonic time, worker id, newest policy version among the rollout's tokens, rollout id)
        self.rollouts_made: list[tuple[float, str, int, str]] = []
        self.stacks = [
            rollout_stack(
                bus=bus, store=store if config.weights else None, model=source,
                worker_id=f"rollout-{i}", seed=seed + 100 + i, model_id=config.model_id,
                # no sync: every worker starts from the trainer's initial weights
                initial=None if config.weights else self.trainer.model.state_dict(),
                on_swap=self._on_swap(i), on_rollout=self._on_rollout, **rollout_args(run),
            )
            for i in range(config.rollout_workers)
        ]
        self.engines = [s.engine for s in self.stacks]
        self.syncs = [s.sync for s in self.stacks if s.sync is not None]
        self.rollout_workers = [s.worker for s in self.stacks]
        self.chat = self.stacks[0].chat
        self.reward_worker = reward_worker(bus=bus, **reward_args(run))
        self.producer = prompt_producer(bus=bus, state=state, run_id=run_id, limit=config.prompts,
                                        **producer_args(run))

    def corrupt_served(self, truth: dict[int, str]) -> int:
        """Swaps after which an engine served weights whose digest is not ``truth[version]``."""
        return sum(1 for _, _, version, digest in self.served if truth.get(version) != digest)

    def first_served(self, index: int, at_least: int) -> float | None:
        """When worker ``index`` first served a version ≥ ``at_least``."""
        return next((t for t, i, v, _ in self.served if i == index and v >= at_least), None)

    @property
    def expected(self) -> int:
        return self.config.prompts * self.config.run.task.group_size

    async def outcomes(self) -> int:
        """Rollouts that reached an outcome so far (the ledger's counters)."""
        counts = await self.join.counts()
        return sum(v for k, v in counts.items() if k != Outcome.DUPLICATE.value)

    async def run(self, stop: asyncio.Event, *, ready: asyncio.Event | None = None) -> None:
        """Run every role until ``stop``; ``ready`` is set once the workers hold weights and run."""
        episode_threads(self.config.run.rollout.episode_threads)
        if self.publisher is not None:
            await self.trainer.publish()  # version 1: the initial weights, as a keyframe
        async with asyncio.TaskGroup() as tasks:
            for sync in self.syncs:
                tasks.create_task(sync.run(stop))
            await asyncio.gather(*(sync.ready.wait() for sync in self.syncs))
            tasks.create_task(self.trainer_worker.run(stop))
            tasks.create_task(self.reward_worker.run(stop))
            for worker in self.rollout_workers:
                tasks.create_task(worker.run(stop))
            tasks.create_task(self.producer.run(stop))
            if ready is not None:
                ready.set()

    async def wait_outcomes(self, at_least: int, timeout_s: float) -> bool:
        """Wait until ``at_least`` rollouts have an outcome; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.outcomes() >= at_least:
                return True
            await asyncio.sleep(0.1)
        return False

    def _on_swap(self, index: int) -> Callable[[int, Any], None]:
        def swapped(version: int, weights: Any) -> None:  # inside the swap: the model now holds ``version``
            self.served.append((time.monotonic(), index, version, state_digest(live_state(weights))))

        return swapped

    def _on_rollout(self, rollout: Rollout) -> None:
        versions = rollout.token_versions.to_numpy()
        self.rollouts_made.append(
            (time.monotonic(), rollout.worker_id, int(versions.max(initial=-1)), rollout.rollout_id)
        )
