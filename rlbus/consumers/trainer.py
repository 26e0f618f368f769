"""The trainer worker: GRPO steps on scored groups, a weight version every K steps, atomic checkpoints.

Joining rollouts with their rewards off the bus and handing complete groups to `Trainer.train_on` is the
pipeline's job; this class owns what happens next: the step itself (in a worker thread, so the event loop
that also serves the bus stays responsive — STYLE 8), publishing every K-th step's weights through the
`WeightPublisher` (which casts them to the inference dtype and delta-encodes them, DESIGN §4), and
checkpoints that make a restart continue bit-exactly.

Versions. ``version`` is the newest policy version published (0 = the initial weights every engine starts
from) and the reference for staleness. Without a publisher it still advances every K steps, so staleness
behaves the same in tests and single-process runs.

Restart. `restore` loads the newest checkpoint — weights, optimizer, step, version, RNG state and the
consumed offsets, which it returns so the caller can seek its consumers there. A publisher that starts
fresh is moved to the restored version, so its first publish is version + 1 — a keyframe, since it holds
no base snapshot yet — and engines see no version gap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlbus.models.policy import Policy
from rlbus.training.batch import Group
from rlbus.training.checkpoint import (
    TrainerState,
    capture_rng,
    load_checkpoint,
    policy_config_dict,
    restore_rng,
    save_checkpoint,
)
from rlbus.training.step import GRPOConfig, OptimConfig, build_optimizer, grpo_step
from rlbus.weights.publish import WeightPublisher


class Trainer:
    """Owns the fp32 master model and its optimizer; one `train_on` call is one GRPO step."""

    def __init__(
        self,
        *,
        model: Policy,
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
        when `save` is called); ``clock`` times the phases reported in the metrics."""
        if publish_every < 1 or checkpoint_every < 0:
            raise ValueError("publish_every must be >= 1 and checkpoint_every >= 0")
        if checkpoint_every and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        self.model = model
        self.optimizer = build_optimizer(model, optim)
        self.grpo = grpo or GRPOConfig()
        self.publisher = publisher
        self.checkpoint_dir = checkpoint_dir
        self.publish_every = publish_every
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.clock = clock
        self.step = 0
        self.version = 0 if publisher is None else publisher.version
        self.offsets: dict[str, int] = {}
        self._lock = asyncio.Lock()

    async def train_on(self, groups: Sequence[Group], *, offsets: Mapping[str, int] | None = None) -> dict[str, Any]:
        """One GRPO step on ``groups``; then publish and checkpoint when their cadence says so.

        ``offsets`` are the bus positions the caller has consumed up to and including these groups; they
        go into the next checkpoint. A batch in which nothing is fresh enough to train on still advances
        the offsets but is not a step (no update, nothing to publish). Returns the step metrics plus
        ``step``, ``version``, ``published``, ``checkpointed`` and the seconds of each phase.
        """
        async with self._lock:
            t0 = self.clock()
            metrics = await asyncio.to_thread(
                grpo_step, self.model, self.optimizer, groups, config=self.grpo, version=self.version
            )
            t1 = self.clock()
            if offsets:
                self.offsets.update(offsets)
            updated = metrics.optimizer_steps > 0
            if updated:
                self.step += 1
            published = updated and self.step % self.publish_every == 0
            if published:
                await self._publish()
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
        """Publish the current weights as the next version now; returns it."""
        async with self._lock:
            await self._publish()
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
            if self.publisher is not None and self.publisher.version < state.version:
                self.publisher.version = state.version
            return dict(self.offsets)

    async def _publish(self) -> None:
        if self.publisher is None:
            self.version += 1
            return
        manifest = await self.publisher.publish(self.model.state_dict(), step=self.step)
        self.version = manifest.version

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
            policy_config=policy_config_dict(self.model.config),
        )
        return await asyncio.to_thread(save_checkpoint, self.checkpoint_dir, state, keep=self.keep_checkpoints)
