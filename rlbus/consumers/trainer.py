"""The trainer worker: the trainer process's bus side.

It consumes rollouts and rewards, joins them in the state store, queues complete groups and hands them to
the `Trainer` (`rlbus.training.trainer`: the model, its optimizer, publishing and checkpoints) one GRPO
step at a time; served traffic takes the `OnlineLane` (`rlbus.training.online_lane`). Each rollout's outcome
(trained, stale, dead-lettered, …) goes into the ledger, so a redelivery is never trained twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from rlbus.bus.base import Bus
from rlbus.bus.dlq import DeadLetters, handle_batch
from rlbus.bus.topics import REWARDS, ROLLOUTS
from rlbus.bus.types import Record
from rlbus.errors import MalformedMessage
from rlbus.metrics import observe_processing, record_step
from rlbus.observe.lag import LagProbe
from rlbus.schemas import Rollout
from rlbus.state.base import StateStore
from rlbus.state.progress import GROUPS_DONE_COUNTER, GROUPS_FREED_COUNTER, VERSION_COUNTER, outcome_counter
from rlbus.training.batch import Group, Sample, check_rollout, sample_from_rollout
from rlbus.training.join import FINAL, JoinBuffer, Outcome, ScoredGroup, ScoredRollout, is_served
from rlbus.training.online_lane import OnlineLane
from rlbus.training.trainer import Trainer

log = logging.getLogger("rlbus.consumers.trainer")


class TrainerWorker:
    """The trainer process's bus side: join rollouts with rewards, batch complete groups, train.

    Consumes ``rl.rollouts.v1`` and ``rl.rewards.v1`` in the group ``trainer``. Each message goes into
    the :class:`~rlbus.training.join.JoinBuffer` (state store) before its offset is committed, so a restart
    loses nothing. Ready groups (and groups released by the join timeout) queue until ``groups_per_step``
    are there; rollouts older than ``max_staleness`` versions are dropped with that reason, the rest are
    trained in one GRPO step, and every rollout id is entered in the ledger so a redelivery is never
    trained twice. When the trainer checkpoints and the join keeps released groups (:attr:`holds`), the
    ledger calls a rollout trained only once a checkpoint holds its step, so a crash between checkpoints
    neither loses an update the ledger counts nor applies one twice (:mod:`rlbus.training.join`). A rollout
    that cannot be trained (inconsistent arrays) is dead-lettered on arrival; that check builds no tensor,
    so each rollout's `Sample` is built once, when :meth:`train` trains it. The trainer's version and
    finished-group count go to the state store, where the prompt producer's admission control reads them.

    Served traffic (with an `OnlineLane`): a rollout with ``metadata.origin = "served"`` and group_size 1
    waits in the lane's `ServedJoin` for a user reward instead of entering a group, and trains in online
    steps (`train_online`) at the lane's release cadence; groups keep training GRPO steps, so a run may
    mix both. The ledger, the hold-until-checkpoint rule and the dead-letter path are the same for both.
    """

    def __init__(
        self,
        *,
        bus: Bus,
        trainer: Trainer,
        join: JoinBuffer,
        state: StateStore,
        groups_per_step: int = 4,
        max_steps: int | None = None,
        expire_every_s: float = 1.0,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        on_train: Callable[[list[ScoredGroup], dict[str, Any]], None] | None = None,
        online: OnlineLane | None = None,
    ) -> None:
        """``on_train(groups, metrics)`` gets each step's trained groups (stale rollouts removed); an online
        step's served rollouts come as one group of prompt id ``"served"``. ``online`` trains served rollouts
        (`OnlineLane`); without it they go to the GRPO join like any rollout.
        ``max_steps`` stops training at that step (the worker keeps joining, so nothing it reads is lost):
        a driver that polls ``trainer.step`` would otherwise see a step or two more, from groups queued
        while it slept."""
        self._bus = bus
        self.trainer = trainer
        self.join = join
        self._state = state
        self.groups_per_step = groups_per_step
        self.max_steps = max_steps
        self._expire_every_s = expire_every_s
        #: rollouts dropped as stale since the last step's metrics (which carry them as ``dropped_stale``)
        self._stale_unreported = 0
        self._on_step = on_step
        self._on_train = on_train
        self._ready: list[ScoredGroup] = []
        self.dead_letters = DeadLetters(bus, on_dead=self._dead)
        self.steps: list[dict[str, Any]] = []
        self.lag_probe = LagProbe()
        self.online = online
        #: The trainer version VERSION_COUNTER has counted up to (versions may land between steps).
        self._counted: int | None = None

    def stats(self) -> dict[str, Any]:
        """What the trainer's heartbeat carries (``processed`` = rollouts trained) and its latest step."""
        last = self.steps[-1] if self.steps else {}
        keys = ("kl_k3", "max_abs_dlogprob", "router_flip_rate", "is_ess", "clip_fraction", "mask_fraction",
                "reward_mean", "hacked", "loss", "grad_norm", "step_s", "rollouts", "stale_dropped", "staleness")
        trained = sum(int(m.get("rollouts", 0)) for m in self.steps)
        return {
            "group": "trainer", "topics": [ROLLOUTS.name, REWARDS.name], "processed": trained,
            "rollouts_trained": trained, "step": self.trainer.step, "version": self.trainer.version,
            "groups_ready": len(self._ready), "dead_letters": sum(self.dead_letters.counts.values()),
            "lag": self.lag_probe.total, "last_step": {k: last[k] for k in keys if k in last},
            **({"online": self.online.stats()} if self.online is not None else {}),
        }

    async def _dead(self, record: Record[Any], error: BaseException) -> None:
        if record.topic == ROLLOUTS.name:  # the rollout's id when it decodes, else the record's place
            try:
                name = record.value.rollout_id
            except Exception:
                name = record.where
            await self.join.record(Outcome.DEAD_LETTERED, [name])

    async def _handle(self, record: Record[Any]) -> None:
        started = time.perf_counter()
        message = record.value
        if isinstance(message, Rollout):
            spans = check_rollout(message)  # raises ValueError for arrays that do not line up → DLQ
            longest, limit = max(e - s for s, e in spans), self.trainer.model.max_seq_len
            if longest > limit:  # would fail the whole step later, taking its groups with it
                raise MalformedMessage(f"rollout {message.rollout_id}: {longest}-token context exceeds max_seq {limit}")
            if self.online is not None and is_served(message) and message.group_size == 1:
                await self._queue_online(await self.online.join.add_rollout(message))
                observe_processing("trainer", started)
                return
            group = await self.join.add_rollout(message)
        else:
            if self.online is not None:
                await self._queue_online(await self.online.join.add_reward(message))
            group = await self.join.add_reward(message)
        if group is not None:
            await self._queue([group])
        observe_processing("trainer", started)

    @property
    def finished(self) -> bool:
        """Whether the trainer has taken ``max_steps`` steps."""
        return self.max_steps is not None and self.trainer.step >= self.max_steps

    @property
    def holds(self) -> bool:
        """Whether trained rollouts wait for a checkpoint before the ledger calls them trained: the
        trainer checkpoints every few steps and the join keeps released groups until then."""
        return self.trainer.checkpoint_every > 0 and self.join.keeps_released

    async def checkpoint(self) -> Path:
        """Checkpoint now (a graceful stop) and settle the rollouts it holds; returns the file."""
        path = await self.trainer.save()
        if self.holds:
            await self.join.settle(self.trainer.step)
        return path

    async def run(self, stop: asyncio.Event) -> None:
        if self.holds:  # the model was restored (or not) before run: its step decides what was trained
            await self.join.recover(self.trainer.step)
        await self._publish_progress()
        if self.online is not None:  # released before a restart, not trained: their update died with it
            await self.online.load()
            for scored_rollout in await self.online.join.pending():
                await self._queue_online(scored_rollout)
        last_expire = time.monotonic()
        async with self._bus.consumer([ROLLOUTS, REWARDS], group="trainer") as consumer:
            while not stop.is_set():
                await self.lag_probe.refresh(consumer)
                batch = await consumer.getmany(timeout_s=0.1, max_records=1000)
                if batch:
                    await handle_batch(consumer, batch, self._handle, self.dead_letters)
                    await consumer.commit_or_defer()
                if time.monotonic() - last_expire > self._expire_every_s:
                    await self._queue(await self.join.expire())
                    if self.online is not None and self.online.sweep_due():
                        await self.online.join.expire()
                    last_expire = time.monotonic()
                if self.online is not None and self.online.due() and not stop.is_set() and not self.finished:
                    await self.train_online()
                while len(self._ready) >= self.groups_per_step and not stop.is_set() and not self.finished:
                    take, self._ready = self._ready[: self.groups_per_step], self._ready[self.groups_per_step :]
                    await self.train(take)
                await self._count_versions()
        await self.trainer.drain()  # the version published in the background, if any, is announced
        await self._count_versions()

    async def _queue(self, groups: list[ScoredGroup]) -> None:
        """Queue released groups for training, minus rollouts already queued or with an outcome: a
        redelivery (rebalance, restart) can rebuild a group the join released earlier, and training
        both copies would train its rollouts twice (the chaos suite saw it under a rebalance)."""
        queued = {s.rollout.rollout_id for g in self._ready for s in g.rollouts}
        held = await self.join.held() if self.holds else {}
        for group in groups:
            fresh = [s for s in group.rollouts
                     if s.rollout.rollout_id not in queued and s.rollout.rollout_id not in held
                     and not await self._state.seen(FINAL, s.rollout.rollout_id)]
            if len(fresh) < len(group.rollouts):
                await self._state.incr(outcome_counter(Outcome.DUPLICATE), len(group.rollouts) - len(fresh))
                group = ScoredGroup(group.prompt_id, fresh, group.unscored)
            if fresh:
                queued.update(s.rollout.rollout_id for s in fresh)
                self._ready.append(group)

    async def train(self, scored: list[ScoredGroup]) -> dict[str, Any] | None:
        """Drop stale rollouts (recorded), train on the rest, record them as trained. Groups consumed by a
        call that took no step free their admission slots (``trainer:groups_freed``)."""
        limit = self.trainer.grpo.max_staleness
        step_before = self.trainer.step
        groups: list[Group] = []
        trained: list[str] = []
        kept: list[ScoredGroup] = []
        for group in scored:
            keep: list[tuple[ScoredRollout, Sample]] = []
            stale: list[tuple[ScoredRollout, Sample]] = []
            invalid = [s.rollout.rollout_id for s in group.rollouts if self.join.policy.drops(s)]
            await self.join.record(Outcome.INVALID_JUDGEMENT, invalid)
            for scored_rollout in group.rollouts:
                if self.join.policy.drops(scored_rollout):
                    continue
                sample = sample_from_rollout(scored_rollout.rollout)
                oldest = sample.oldest_version()
                fresh = oldest is None or self.trainer.version - oldest <= limit
                (keep if fresh else stale).append((scored_rollout, sample))
            if len(keep) < 2:  # a group of one has no baseline to compare against
                stale, keep = stale + keep, []
            await self.join.record(Outcome.STALE, [s.rollout.rollout_id for s, _ in stale])
            self._stale_unreported += len(stale)
            if keep:
                groups.append(
                    Group(
                        samples=tuple(sample for _, sample in keep),
                        rewards=torch.tensor([s.reward for s, _ in keep], dtype=torch.float32),
                        prompt_id=group.prompt_id,
                    )
                )
                trained += [s.rollout.rollout_id for s, _ in keep]
                kept.append(ScoredGroup(group.prompt_id, [s for s, _ in keep]))
        metrics = None
        if groups:
            metrics = await self._ledgered(trained, lambda: self.trainer.train_on(groups, rollouts=len(trained)))
            metrics["reward_mean"] = float(torch.cat([g.rewards for g in groups]).mean())
            # rollouts dropped as stale before this step saw them (and before any earlier call that took no
            # step): the step's own ``stale_dropped`` counts only what the GRPO step itself dropped
            metrics["dropped_stale"], self._stale_unreported = self._stale_unreported, 0
            self._report(metrics, kept)
            log.info(
                "step %d: %d groups, %d rollouts, reward %.3f, hacked %.3f, kl %.2e → v%d; step %.2fs, publish %.2fs",
                metrics["step"], len(groups), len(trained), metrics["reward_mean"], metrics["hacked"],
                metrics["kl_k3"], self.trainer.version, metrics["step_s"], metrics["publish_s"],
                extra={"version": self.trainer.version},
            )
        await self._state.incr(GROUPS_DONE_COUNTER, len(scored))
        if self.trainer.step == step_before:  # no step: these groups did not move the trainer towards a version
            await self._state.incr(GROUPS_FREED_COUNTER, len(scored))
            total = sum(len(g.rollouts) for g in scored)
            log.warning(
                "no step on %d group(s): %d of %d rollouts dropped (stale: more than %d versions behind v%d, or "
                "an invalid judgement), the rest gave no update; their admission slots are freed",
                len(scored), total - len(trained), total, limit, self.trainer.version,
                extra={"version": self.trainer.version, "prompt_id": scored[0].prompt_id if scored else None},
            )
        return metrics

    async def _ledgered(self, trained: list[str], step: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """Run one step on the rollouts ``trained`` and enter them in the ledger: at once, or held until a
        checkpoint holds the step (see the class docstring); count the versions it published."""
        if self._counted is None:
            self._counted = self.trainer.version
        at = self.trainer.step + 1
        if self.holds:  # trained in the ledger once a checkpoint holds the step (join.settle)
            await self.join.hold(at, trained)
        metrics = await step()
        metrics["rollouts"] = len(trained)
        if not self.holds:
            await self.join.record(Outcome.TRAINED, trained)
        elif self.trainer.step < at:  # no update: the model does not depend on them, nothing to wait for
            await self.join.settle(at, only=set(trained))
        elif metrics["checkpointed"]:
            await self.join.settle(self.trainer.step)
        await self._count_versions()
        return metrics

    async def _count_versions(self) -> None:
        """Count the versions announced since the last count: a step's own, or one published in the
        background while the next step trained (`Trainer` overlaps publishing)."""
        if self._counted is None:
            self._counted = self.trainer.version
        if self.trainer.version > self._counted:
            await self._state.incr(VERSION_COUNTER, self.trainer.version - self._counted)
            self._counted = self.trainer.version

    def _report(self, metrics: dict[str, Any], kept: list[ScoredGroup]) -> None:
        """Publish a step's metrics (heartbeat, Prometheus, callbacks), with ``hacked``: the share of the
        rollouts it trained whose rewards report reward hacking (`ScoredRollout.hacks`)."""
        trained = [s for g in kept for s in g.rollouts]
        metrics["hacked"] = sum(1 for s in trained if s.hacks) / len(trained) if trained else 0.0
        self.steps.append(metrics)
        record_step(metrics)
        if self._on_step is not None:
            self._on_step(metrics)
        if self._on_train is not None:
            self._on_train(kept, metrics)

    # --- served traffic ----------------------------------------------------------------------------------
    async def _queue_online(self, scored: ScoredRollout | None) -> None:
        """Queue a released served rollout, unless it is queued, held or has an outcome already."""
        if scored is None or self.online is None:
            return
        rid = scored.rollout.rollout_id
        held = await self.join.held() if self.holds else {}
        queued = any(s.rollout.rollout_id == rid for s in self.online.ready)
        if rid in held or queued or await self._state.seen(FINAL, rid):
            await self._state.incr(outcome_counter(Outcome.DUPLICATE))
            return
        self.online.ready.append(scored)

    async def train_online(self) -> dict[str, Any] | None:
        """One release of served traffic: drop what is past the age or version bound (recorded), compute the
        online advantages of the rest (`rlbus.rl.online`), train one step and publish a version."""
        lane = self.online
        assert lane is not None
        take, lane.ready = lane.ready, []
        lane.mark_release()
        now = lane.wall()
        too_old = [s for s in take if now - s.rollout.created_at > lane.config.max_age_s]
        old_ids = {s.rollout.rollout_id for s in too_old}
        keep: list[tuple[ScoredRollout, Sample]] = []
        stale: list[ScoredRollout] = []
        for scored in take:
            if scored.rollout.rollout_id in old_ids:
                continue
            sample = sample_from_rollout(scored.rollout)
            oldest = sample.oldest_version()
            if oldest is not None and self.trainer.version - oldest > lane.config.max_staleness:
                stale.append(scored)
            else:
                keep.append((scored, sample))
        await self.join.record(Outcome.TOO_OLD, [s.rollout.rollout_id for s in too_old])
        await self.join.record(Outcome.STALE, [s.rollout.rollout_id for s in stale])
        lane.count(dropped_age=len(too_old), dropped_stale=len(stale))
        if too_old:
            log.info("%d served rollout(s) older than %.0f s dropped, e.g. %s", len(too_old),
                     lane.config.max_age_s, too_old[0].rollout.rollout_id)
        metrics = None
        if keep:
            keys = [lane.key_of(s.rollout) for s, _ in keep]
            rewards = [s.reward for s, _ in keep]
            advantages = lane.baseline.advantages(keys, rewards)
            trained = [s.rollout.rollout_id for s, _ in keep]
            samples = [sample for _, sample in keep]
            metrics = await self._ledgered(trained, lambda: self.trainer.train_online(
                samples, torch.tensor(advantages, dtype=torch.float32), torch.tensor(rewards, dtype=torch.float32),
                max_staleness=lane.config.max_staleness))
            await lane.save()
            lane.count(samples=len(keep), releases=1)
            metrics.update(lane.step_metrics(keys, advantages))
            metrics["reward_mean"] = sum(rewards) / len(rewards)
            self._report(metrics, [ScoredGroup("served", [s for s, _ in keep])])
            log.info(
                "online step %d: %d served rollouts, reward %.3f, hacked %.3f, baseline %.3f, dropped %d old / %d"
                " stale → v%d", metrics["step"], len(keep), metrics["reward_mean"], metrics["hacked"],
                metrics["online_baseline"], len(too_old), len(stale), self.trainer.version,
                extra={"version": self.trainer.version},
            )
        if not self.holds:
            await lane.join.discard(s.rollout.rollout_id for s in take)
        return metrics

    async def _publish_progress(self) -> None:
        current = await self._state.get_counter(VERSION_COUNTER)
        if self.trainer.version > current:
            await self._state.incr(VERSION_COUNTER, self.trainer.version - current)
        self._counted = self.trainer.version

