"""The trainer: GRPO steps on scored groups, a weight version every K steps, atomic checkpoints.

Joining rollouts with their rewards off the bus and handing complete groups to `Trainer.train_on` is the
trainer worker's job (`rlbus.consumers.trainer`); this class owns what happens next: the step itself (in a
worker thread, so the event loop that also serves the bus stays responsive: docs/architecture.md §9.2),
publishing every K-th step's weights through the `WeightPublisher` (the model's parameters, a tied
embedding once: `rlbus.models.base.weight_tensors`; the publisher casts them to the inference dtype and
delta-encodes them, docs/architecture.md §4), and checkpoints that make a restart continue bit-exactly.
The model is any `rlbus.models.base.TrainableLM`.

Versions. ``version`` is the newest policy version published (0 = the initial weights every engine starts
from) and the reference for staleness. Without a publisher it still advances every K steps, so staleness
behaves the same in tests and single-process runs.

The trainer owns the version sequence: `_publish` numbers each new version (``version + 1``) and hands
it to the publisher, which only refuses to go backwards; `continue_after` moves the numbering past what a
run has already announced.

On N ranks (``ranks``: `rlbus.training.ranks`, the model sharded with FSDP2 before the trainer is built)
every rank holds a `Trainer`. The leader's (rank 0) is the one the worker drives; each of its collective
operations — a step, publishing a version, a checkpoint, a restore — is broadcast as a command with its
arguments (the step's batch included) and then run by every rank alike (`_collective`);
the followers' trainers sit in `follow` running those commands until the leader's `release`. A version is
published sharded: each rank encodes and uploads its own run of tensors and the leader writes and announces
the one manifest (`rlbus.training.shard_publish`). Versions, offsets and the checkpoint file stay the
leader's. Checkpoints are DCP shards plus the gathered weights (`rlbus.training.sharded`); `restore` reads
either kind on any number of ranks.

Overlapped publishing (``overlap_publish``, one process). Publishing a version costs a cast and copy of
the weights (the snapshot, taken right after the step: the next step changes them) and then encoding,
uploading and announcing, which only read the snapshot. With overlap the trainer takes the snapshot and
returns to training while a background task publishes it: version N is encoded and uploaded while step
N+1 trains. There is at most one such task: the next publish, a checkpoint, `publish` and `drain` wait
for it first (back-pressure when publishing is slower than training). ``version`` still moves only when
a version is announced, so staleness is measured against what workers can hold, as before; a step's
record names the version that holds its weights either way (the one in flight, when overlapped), so the
step log reads the same with and without overlap, and a graceful stop's checkpoint names the last step's
version. A step's metrics say how long the loop spent on publishing (``publish_s``: the snapshot and any wait) and the
publisher logs the encode and upload times of each version. A crash while a version is in flight loses
no data: nothing was announced, the checkpoint (which waits for the publish) names the version before.

Restart. `restore` loads the newest checkpoint — weights, optimizer, step, version, RNG state and the
consumed offsets, which it returns so the caller can seek its consumers there. The next publish is then
version + 1 — a keyframe, since a fresh publisher holds no base snapshot — and engines see no gap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlbus.errors import BlobStoreError
from rlbus.models.base import TrainableLM, weight_tensors
from rlbus.training.batch import Group, Sample
from rlbus.training.checkpoint import (
    TrainerState,
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from rlbus.training.ranks import Ranks, full_state, full_weights
from rlbus.training.shard_publish import ShardOrder, ShardPublisher
from rlbus.training.sharded import load_full, load_sharded, save_sharded, sharded_name
from rlbus.training.step import GRPOConfig, OptimConfig, StepMetrics, build_optimizer, grpo_step, online_step
from rlbus.weights.publish import WeightPublisher

log = logging.getLogger("rlbus.training.trainer")


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
        ranks: Ranks | None = None,
        shards: ShardPublisher | None = None,
        overlap_publish: bool = False,
    ) -> None:
        """``publish_every`` = K steps per weight version; ``checkpoint_every`` steps per checkpoint (0 = only
        when `save` is called); ``clock`` times the phases reported in the metrics. The model is switched to
        ``grpo.gradient_checkpointing`` here. ``ranks``: this trainer is one of several (the model already
        sharded over them, `rlbus.training.ranks.shard_model`). ``shards``: this rank's side of sharded
        publishing (default: the leader uploads its chunks to the publisher's store, a follower hands them
        to the leader; `rlbus.training.shard_publish`). ``overlap_publish``: a version is encoded, uploaded and
        announced while the next step trains (one process; see "Overlapped publishing")."""
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
        self.ranks = ranks
        self.shards = shards
        if ranks is not None and shards is None:
            self.shards = ShardPublisher(store=publisher.store if isinstance(publisher, WeightPublisher) else None)
        #: The step whose DCP shards this trainer wrote or restored: a second checkpoint at that step (a
        #: graceful stop right after a cadence checkpoint) reuses them instead of rewriting what `latest` names.
        self._sharded_step: int | None = None
        self.step = 0
        self.version = 0 if publisher is None else publisher.version
        self.offsets: dict[str, int] = {}
        #: Rollouts in the updates the model holds (saved with checkpoints).
        self.rollouts_trained = 0
        self._lock = asyncio.Lock()
        self.overlap_publish = overlap_publish and ranks is None
        #: The version being encoded and uploaded from its snapshot while the next step trains (at most one).
        self._publishing: asyncio.Task[bool] | None = None

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
            version = self.version
            return await self._apply(
                lambda: self._collective("grpo", groups, version),
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
            version = self.version
            return await self._apply(
                lambda: self._collective("online", samples, advantages, rewards, version, max_staleness),
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
        record: dict[str, Any] = {}
        wait_s = 0.0
        holds = self.version  # the version that holds this step's weights (what the step log names)
        if published and self.overlap_publish and self.publisher is not None:
            wait_s = await self.drain()
            holds = await self._start_publish(record)
        elif published:
            published = await self._publish()
            holds = self.version
        t2 = self.clock()
        checkpointed = updated and self.checkpoint_every > 0 and self.step % self.checkpoint_every == 0
        if checkpointed:
            await self._save()
        t3 = self.clock()
        record.update({
            **metrics.as_dict(),
            "step": self.step,
            "version": holds,
            "published": published,
            "checkpointed": checkpointed,
            "step_s": t1 - t0,
            "publish_s": t2 - t1,
            "publish_wait_s": wait_s,
            "checkpoint_s": t3 - t2,
        })
        return record

    async def _start_publish(self, record: dict[str, Any]) -> int:
        """Snapshot the weights (before the next step changes them) and publish that snapshot as the next
        version in the background; returns that version's number. A failure flips ``record["published"]``
        to False when it happens (the number is then given to the next publish)."""
        assert self.publisher is not None
        publisher = self.publisher
        snapshot = await asyncio.to_thread(publisher.snapshot, weight_tensors(self.model))
        version, step = self.version + 1, self.step

        async def finish() -> bool:
            try:
                manifest = await publisher.publish_snapshot(snapshot, version=version, step=step)
            except BlobStoreError as exc:  # the store is down past its retries: train on, publish next time
                log.warning("publishing v%d (step %d) failed (%s); still on v%d", version, step, exc, self.version)
                record["published"], record["version"] = False, self.version
                return False
            self.version = manifest.version
            return True

        self._publishing = asyncio.create_task(finish(), name=f"publish-v{version}")
        return version

    async def drain(self) -> float:
        """Wait for the version being published in the background, if any (back-pressure: there is at most
        one); returns the seconds waited. Raises what that publish raised, other than the store being down."""
        task, self._publishing = self._publishing, None
        if task is None:
            return 0.0
        t0 = self.clock()
        await task
        return self.clock() - t0

    async def publish(self) -> int:
        """Publish the current weights as the next version now; returns it. Raises BlobStoreError when
        the blob store cannot take it (a step's publish, by contrast, is retried at the next step)."""
        async with self._lock:
            await self.drain()
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
            await self.drain()
            file = latest_checkpoint(self.checkpoint_dir)
            state = None if file is None else await asyncio.to_thread(load_checkpoint, file)
            if file is None or state is None:
                return None
            if self.ranks is None and state.sharded is None:
                self.model.load_state_dict(state.model)
                if state.optimizer is not None:
                    self.optimizer.load_state_dict(state.optimizer)
            else:  # DCP shards, or a one-process checkpoint into a sharded model
                await asyncio.to_thread(self._collective, "restore", str(file))
                self._sharded_step = state.step if state.sharded is not None and self.ranks is not None else None
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
            if self.ranks is not None and isinstance(self.publisher, WeightPublisher):
                manifest = await self._publish_sharded(self.publisher)
            else:  # one process, or a stand-in publisher that takes the whole weights (gathered on rank 0)
                weights = (weight_tensors(self.model) if self.ranks is None
                           else await asyncio.to_thread(self._collective, "weights"))
                manifest = await self.publisher.publish(weights, version=self.version + 1, step=self.step)
        except BlobStoreError as exc:  # the store is down past its retries: train on, publish next time
            log.warning("publishing after step %d failed (%s); still on v%d", self.step, exc, self.version)
            return False
        self.version = manifest.version
        return True

    async def _publish_sharded(self, publisher: WeightPublisher) -> Any:
        """Every rank encodes and uploads its part (`rlbus.training.shard_publish`); the leader announces."""
        assert self.shards is not None
        if self.shards.store is not None:
            self.shards.loop = asyncio.get_running_loop()  # the store's loop: uploads from the command's thread
        order = ShardOrder(model_id=publisher.model_id, version=self.version + 1, base_version=publisher.version,
                           keyframe_every=publisher.keyframe_every, dtype=publisher.dtype,
                           chunk_bytes=publisher.chunk_bytes)
        t0 = time.perf_counter()
        parts, digest = await asyncio.to_thread(self._collective, "publish", order)
        return await publisher.publish_sharded(parts, digest=digest, version=order.version, step=self.step,
                                               encode_s=time.perf_counter() - t0)

    async def _save(self) -> Path:
        if self.checkpoint_dir is None:
            raise ValueError("saving a checkpoint needs a checkpoint_dir")
        await self.drain()  # a checkpoint names the version its weights were published as
        sharded = None
        if self.ranks is None:
            model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        else:  # shards first; the file that names them (and `latest`) after
            sharded = sharded_name(self.step)
            write = self._sharded_step != self.step  # no update since the shards of this step were written
            model = await asyncio.to_thread(self._collective, "save", str(self.checkpoint_dir / sharded), write)
            self._sharded_step, optimizer = self.step, None
        state = TrainerState(
            step=self.step,
            version=self.version,
            model=model,
            optimizer=optimizer,
            rng=capture_rng(),
            offsets=dict(self.offsets),
            model_description=self.model.describe(),
            rollouts_trained=self.rollouts_trained,
            sharded=sharded,
        )
        return await asyncio.to_thread(save_checkpoint, self.checkpoint_dir, state, keep=self.keep_checkpoints)

    # --- N ranks ---------------------------------------------------------------------------------------------
    def _collective(self, command: str, *args: Any) -> Any:
        """Run ``command`` on every rank: the leader broadcasts it with its arguments, then runs it as the
        followers do (in a worker thread: collectives block). One process: just run it."""
        if self.ranks is not None:
            self.ranks.broadcast((command, args))
        return self._run(command, args)

    def _run(self, command: str, args: tuple[Any, ...]) -> Any:
        """One command, the same on every rank."""
        if command == "grpo":
            groups, version = args
            return grpo_step(self.model, self.optimizer, groups, config=self.grpo, version=version, ranks=self.ranks)
        if command == "online":
            samples, advantages, rewards, version, max_staleness = args
            return online_step(self.model, self.optimizer, samples, advantages, rewards, config=self.grpo,
                               version=version, max_staleness=max_staleness, ranks=self.ranks)
        if command == "weights":
            return full_weights(self.model)
        if command == "publish":
            assert self.ranks is not None and self.shards is not None
            return self.shards.publish(self.model, self.ranks, args[0])
        if command == "save":
            path, write = args
            if write:
                save_sharded(Path(path), self.model, self.optimizer)
            return full_state(self.model)
        if command == "restore":
            file = Path(args[0])
            state = load_checkpoint(file)
            assert state is not None
            if state.sharded is not None:
                load_sharded(file.with_name(state.sharded), self.model, self.optimizer)
            else:
                load_full(self.model, self.optimizer, state.model, state.optimizer)
            return None
        raise ValueError(f"unknown trainer command {command!r}")

    def follow(self) -> None:
        """A follower's loop (rank > 0): run the leader's commands until it releases the ranks. Blocking."""
        if self.ranks is None or self.ranks.leader:
            raise ValueError("only a trainer on rank > 0 follows")
        while True:
            command, args = self.ranks.broadcast()
            if command == "stop":
                return
            self._run(command, args)

    def release(self) -> None:
        """The leader's last word: the followers leave `follow` (nothing for one process)."""
        if self.ranks is not None and self.ranks.leader:
            self.ranks.broadcast(("stop", ()))
