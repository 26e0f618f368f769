"""The trainer worker: GRPO steps on scored groups, a weight version every K steps, atomic checkpoints.

Joining rollouts with their rewards off the bus and handing complete groups to `Trainer.train_on` is the
pipeline's job; this class owns what happens next: the step itself (in a worker thread, so the event loop
that also serves the bus stays responsive — STYLE 8), publishing every K-th step's weights through the
`WeightPublisher` (the model's parameters, a tied embedding once: `rlbus.models.base.weight_tensors`; the
publisher casts them to the inference dtype and delta-encodes them, DESIGN §4), and checkpoints that make
a restart continue bit-exactly. The model is any `rlbus.models.base.TrainableLM`.

Versions. ``version`` is the newest policy version published (0 = the initial weights every engine starts
from) and the reference for staleness. Without a publisher it still advances every K steps, so staleness
behaves the same in tests and single-process runs.

The trainer owns the version sequence: `_publish` numbers each new version (``version + 1``) and hands
it to the publisher, which only refuses to go backwards; `continue_after` moves the numbering past what a
run has already announced.

Restart. `restore` loads the newest checkpoint — weights, optimizer, step, version, RNG state and the
consumed offsets, which it returns so the caller can seek its consumers there. The next publish is then
version + 1 — a keyframe, since a fresh publisher holds no base snapshot — and engines see no gap.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlbus.bus.base import Bus
from rlbus.bus.dlq import DeadLetters, handle_batch
from rlbus.bus.topics import REWARDS, ROLLOUTS
from rlbus.bus.types import Record
from rlbus.errors import BlobStoreError, MalformedMessage
from rlbus.models.base import TrainableLM, weight_tensors
from rlbus.observe.lag import LagProbe
from rlbus.observe.metrics import observe_processing, record_step
from rlbus.rl.online import OnlineBaseline
from rlbus.schemas import Rollout
from rlbus.state.base import StateStore
from rlbus.state.join import FINAL, JoinBuffer, Outcome, ScoredGroup, ScoredRollout, ServedJoin, is_served
from rlbus.state.progress import GROUPS_DONE_COUNTER, GROUPS_FREED_COUNTER, VERSION_COUNTER, outcome_counter
from rlbus.training.batch import Group, Sample, check_rollout, sample_from_rollout
from rlbus.training.checkpoint import (
    TrainerState,
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from rlbus.training.config import OnlineConfig
from rlbus.training.step import GRPOConfig, OptimConfig, StepMetrics, build_optimizer, grpo_step, online_step
from rlbus.weights.publish import WeightPublisher

log = logging.getLogger("rlbus.consumers.trainer")


class Trainer:
    """Owns the fp32 master model and its optimizer; one `train_on` call is one GRPO step."""

    def __init__(
        self,
        *,
        model: TrainableLM,
        optim: OptimConfig,
        grpo: GRPOConfig | None = None,
        publisher: WeightPublisher | None = None,
        checkpoint_dir: Path | None = None,
        publish_every: int = 1,
        checkpoint_every: int = 0,
        keep_checkpoints: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``publish_every`` = K steps per weight version; ``checkpoint_every`` steps per checkpoint (0 = only
        when `save` is called); ``clock`` times the phases reported in the metrics. The model is switched to
        ``grpo.gradient_checkpointing`` here."""
        if publish_every < 1 or checkpoint_every < 0:
            raise ValueError("publish_every must be >= 1 and checkpoint_every >= 0")
        if checkpoint_every and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        self.model = model
        self.optimizer = build_optimizer(model, optim)
        self.grpo = grpo or GRPOConfig()
        model.set_gradient_checkpointing(self.grpo.gradient_checkpointing)
        self.publisher = publisher
        self.checkpoint_dir = checkpoint_dir
        self.publish_every = publish_every
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.clock = clock
        self.step = 0
        self.version = 0 if publisher is None else publisher.version
        self.offsets: dict[str, int] = {}
        #: Rollouts in the updates the model holds (saved with checkpoints).
        self.rollouts_trained = 0
        self._lock = asyncio.Lock()

    async def train_on(
        self, groups: Sequence[Group], *, offsets: Mapping[str, int] | None = None, rollouts: int | None = None
    ) -> dict[str, Any]:
        """One GRPO step on ``groups``; then publish and checkpoint when their cadence says so.

        ``offsets`` are the bus positions the caller has consumed up to and including these groups; they
        go into the next checkpoint. A batch in which nothing is fresh enough to train on still advances
        the offsets but is not a step (no update, nothing to publish). Returns the step metrics plus
        ``step``, ``version``, ``published``, ``checkpointed`` and the seconds of each phase. ``rollouts``
        (default: every sample of ``groups``) is added to ``rollouts_trained`` when the step updates.
        """
        async with self._lock:
            return await self._apply(
                lambda: grpo_step(self.model, self.optimizer, groups, config=self.grpo, version=self.version),
                offsets=offsets, rollouts=sum(len(g.samples) for g in groups) if rollouts is None else rollouts,
                publish_now=False,
            )

    async def train_online(
        self, samples: Sequence[Sample], advantages: torch.Tensor, rewards: torch.Tensor, *, max_staleness: int,
    ) -> dict[str, Any]:
        """One step on served samples with online advantages [R] (`rlbus.training.step.online_step`). A step
        that updates always publishes: the release cadence of served traffic (every N rewards or T seconds,
        `OnlineLane`) is the version cadence, whatever ``publish_every`` says for GRPO steps."""
        async with self._lock:
            return await self._apply(
                lambda: online_step(self.model, self.optimizer, samples, advantages, rewards, config=self.grpo,
                                    version=self.version, max_staleness=max_staleness),
                offsets=None, rollouts=len(samples), publish_now=True,
            )

    async def _apply(
        self, step: Callable[[], StepMetrics], *, offsets: Mapping[str, int] | None, rollouts: int, publish_now: bool,
    ) -> dict[str, Any]:
        """Run ``step`` in a thread, then publish and checkpoint when their cadence says so (lock held)."""
        t0 = self.clock()
        metrics = await asyncio.to_thread(step)
        t1 = self.clock()
        if offsets:
            self.offsets.update(offsets)
        updated = metrics.optimizer_steps > 0
        if updated:
            self.step += 1
            self.rollouts_trained += rollouts
        published = updated and (publish_now or self.step % self.publish_every == 0)
        if published:
            published = await self._publish()
        t2 = self.clock()
        checkpointed = updated and self.checkpoint_every > 0 and self.step % self.checkpoint_every == 0
        if checkpointed:
            await self._save()
        t3 = self.clock()
        return {
            **metrics.as_dict(),
            "step": self.step,
            "version": self.version,
            "published": published,
            "checkpointed": checkpointed,
            "step_s": t1 - t0,
            "publish_s": t2 - t1,
            "checkpoint_s": t3 - t2,
        }

    async def publish(self) -> int:
        """Publish the current weights as the next version now; returns it. Raises BlobStoreError when
        the blob store cannot take it (a step's publish, by contrast, is retried at the next step)."""
        async with self._lock:
            if not await self._publish():
                raise BlobStoreError(f"could not publish v{self.version + 1}: the blob store is unavailable")
            return self.version

    async def save(self) -> Path:
        """Checkpoint now (see `rlbus.training.checkpoint`); returns the file written."""
        async with self._lock:
            return await self._save()

    async def restore(self) -> dict[str, int] | None:
        """Load the newest checkpoint of ``checkpoint_dir``; returns its offsets, or None if there is none."""
        if self.checkpoint_dir is None:
            raise ValueError("restore needs a checkpoint_dir")
        async with self._lock:
            state = await asyncio.to_thread(load_checkpoint, self.checkpoint_dir)
            if state is None:
                return None
            self.model.load_state_dict(state.model)
            if state.optimizer is not None:
                self.optimizer.load_state_dict(state.optimizer)
            restore_rng(state.rng)
            self.step, self.version, self.offsets = state.step, state.version, dict(state.offsets)
            self.rollouts_trained = state.rollouts_trained
            return dict(self.offsets)

    def continue_after(self, published: int) -> None:
        """Number the next version above ``published``, the newest version the run has announced (from
        the state store or the compacted weights topic): versions never repeat, even when the restored
        checkpoint is older than the run's newest version or the state store is younger than the topics."""
        self.version = max(self.version, published)

    async def _publish(self) -> bool:
        """Publish the next version (``version + 1``): the one place a policy version is numbered."""
        if self.publisher is None:
            self.version += 1
            return True
        try:
            manifest = await self.publisher.publish(
                weight_tensors(self.model), version=self.version + 1, step=self.step
            )
        except BlobStoreError as exc:  # the store is down past its retries: train on, publish next time
            log.warning("publishing after step %d failed (%s); still on v%d", self.step, exc, self.version)
            return False
        self.version = manifest.version
        return True

    async def _save(self) -> Path:
        if self.checkpoint_dir is None:
            raise ValueError("saving a checkpoint needs a checkpoint_dir")
        state = TrainerState(
            step=self.step,
            version=self.version,
            model=self.model.state_dict(),
            optimizer=self.optimizer.state_dict(),
            rng=capture_rng(),
            offsets=dict(self.offsets),
            model_description=self.model.describe(),
            rollouts_trained=self.rollouts_trained,
        )
        return await asyncio.to_thread(save_checkpoint, self.checkpoint_dir, state, keep=self.keep_checkpoints)


class OnlineLane:
    """Served traffic's path through the trainer: the served join, the running baseline and the cadence.

    Served rollouts wait in the `ServedJoin` for a user reward; released ones queue here (``ready``) until
    a release is due — ``release_every_rewards`` of them, or ``release_every_s`` since the last release
    with at least one waiting, whichever comes first — and then train one step that publishes a version
    (`TrainerWorker.train_online`). The baseline state goes to the state store after each step, so a
    restarted trainer keeps its baselines. ``clock`` (monotonic) times the cadence, ``wall`` (Unix time,
    as ``Rollout.created_at``) the age bound.
    """

    def __init__(
        self, *, join: ServedJoin, state: StateStore, config: OnlineConfig, namespace: str = "join",
        clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
    ) -> None:
        self.join = join
        self.config = config
        self._state = state
        self._key = f"{namespace}:served:baseline"
        self.clock, self.wall = clock, wall
        self.baseline = OnlineBaseline(estimator=config.estimator, alpha=config.ema, window=config.window,
                                       min_count=config.min_count, init=config.baseline_init)
        self.ready: list[ScoredRollout] = []
        self.last_release = clock()
        self._last_sweep = -float("inf")
        self.totals = {"samples": 0, "dropped_age": 0, "dropped_stale": 0, "releases": 0}

    def key_of(self, rollout: Rollout) -> str:
        """The baseline key of a served rollout (``config.baseline``)."""
        if self.config.baseline == "tenant":
            return "tenant:" + rollout.metadata.get("tenant", "")
        if self.config.baseline == "task":
            return "task:" + (rollout.metadata.get("task") or rollout.prompt_id)
        return "global"

    def due(self) -> bool:
        """Whether a release is due: enough rewarded samples wait, or the interval passed with some waiting."""
        if not self.ready:
            return False
        waited = self.clock() - self.last_release
        return len(self.ready) >= self.config.release_every_rewards or waited >= self.config.release_every_s

    def mark_release(self) -> None:
        self.last_release = self.clock()

    def sweep_due(self) -> bool:
        """Whether to run the served join's age sweep now: it reads every waiting rollout's entry in the
        index (hours of traffic may wait), so at most every ``max_age_s / 100`` seconds, 1–60 s."""
        now = self.clock()
        if now - self._last_sweep < min(60.0, max(1.0, self.config.max_age_s / 100)):
            return False
        self._last_sweep = now
        return True

    def count(self, **by: int) -> None:
        for name, n in by.items():
            self.totals[name] += n

    def step_metrics(self, keys: Sequence[str], advantages: Sequence[float]) -> dict[str, Any]:
        return {
            "online_samples": len(keys), "online_baseline": self.baseline.value(), "online_keys": len(set(keys)),
            "online_advantage_mean": sum(advantages) / max(1, len(advantages)),
            **{f"online_{name}_total": n for name, n in self.totals.items()},
        }

    def stats(self) -> dict[str, Any]:
        """The heartbeat's online part: totals, queue, the global baseline."""
        return {**self.totals, "ready": len(self.ready), "baseline": self.baseline.value()}

    async def load(self) -> None:
        """Restore the baselines a previous trainer saved (none: start at ``baseline_init``)."""
        saved = await self._state.get_named(self._key, ["state"])
        if "state" in saved:
            self.baseline.restore(json.loads(saved["state"]))

    async def save(self) -> None:
        await self._state.put_field(self._key, "state", json.dumps(self.baseline.state()).encode(), None)


class TrainerWorker:
    """The trainer process's bus side: join rollouts with rewards, batch complete groups, train.

    Consumes ``rl.rollouts.v1`` and ``rl.rewards.v1`` in the group ``trainer``. Each message goes into
    the :class:`~rlbus.state.join.JoinBuffer` (state store) before its offset is committed, so a restart
    loses nothing. Ready groups (and groups released by the join timeout) queue until ``groups_per_step``
    are there; rollouts older than ``max_staleness`` versions are dropped with that reason, the rest are
    trained in one GRPO step, and every rollout id is entered in the ledger so a redelivery is never
    trained twice. When the trainer checkpoints and the join keeps released groups (:attr:`holds`), the
    ledger calls a rollout trained only once a checkpoint holds its step, so a crash between checkpoints
    neither loses an update the ledger counts nor applies one twice (:mod:`rlbus.state.join`). A rollout
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
        self._on_step = on_step
        self._on_train = on_train
        self._ready: list[ScoredGroup] = []
        self.dead_letters = DeadLetters(bus, on_dead=self._dead)
        self.steps: list[dict[str, Any]] = []
        self.lag_probe = LagProbe()
        self.online = online

    def stats(self) -> dict[str, Any]:
        """What the trainer's heartbeat carries (``processed`` = rollouts trained) and its latest step."""
        last = self.steps[-1] if self.steps else {}
        keys = ("kl_k3", "max_abs_dlogprob", "router_flip_rate", "is_ess", "clip_fraction", "mask_fraction",
                "reward_mean", "loss", "grad_norm", "step_s", "rollouts", "stale_dropped", "staleness")
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
            self._report(metrics, kept)
            log.info(
                "step %d: %d groups, %d rollouts, reward %.3f, kl %.2e → v%d",
                metrics["step"], len(groups), len(trained), metrics["reward_mean"], metrics["kl_k3"],
                self.trainer.version, extra={"version": self.trainer.version},
            )
        await self._state.incr(GROUPS_DONE_COUNTER, len(scored))
        if self.trainer.step == step_before:  # no step: these groups did not move the trainer towards a version
            await self._state.incr(GROUPS_FREED_COUNTER, len(scored))
            log.warning(
                "no step on %d group(s): every rollout dropped (stale: more than %d versions behind v%d); their "
                "admission slots are freed", len(scored), limit, self.trainer.version,
                extra={"version": self.trainer.version, "prompt_id": scored[0].prompt_id if scored else None},
            )
        return metrics

    async def _ledgered(self, trained: list[str], step: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """Run one step on the rollouts ``trained`` and enter them in the ledger: at once, or held until a
        checkpoint holds the step (see the class docstring); count the versions it published."""
        before = self.trainer.version
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
        if self.trainer.version > before:
            await self._state.incr(VERSION_COUNTER, self.trainer.version - before)
        return metrics

    def _report(self, metrics: dict[str, Any], kept: list[ScoredGroup]) -> None:
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
                "online step %d: %d served rollouts, reward %.3f, baseline %.3f, dropped %d old / %d stale → v%d",
                metrics["step"], len(keep), metrics["reward_mean"], metrics["online_baseline"], len(too_old),
                len(stale), self.trainer.version, extra={"version": self.trainer.version},
            )
        if not self.holds:
            await lane.join.discard(s.rollout.rollout_id for s in take)
        return metrics

    async def _publish_progress(self) -> None:
        current = await self._state.get_counter(VERSION_COUNTER)
        if self.trainer.version > current:
            await self._state.incr(VERSION_COUNTER, self.trainer.version - current)

