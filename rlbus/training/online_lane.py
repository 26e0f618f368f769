"""The online lane: served traffic's path through the trainer worker.

A served rollout (``metadata.origin = "served"``, group size 1) has no group to compare against; it waits
for a user reward in the `ServedJoin`, then queues here until a release is due and trains in an online step
with advantages against a running baseline (`rlbus.rl.online`). The lane holds that queue, the baseline
(saved to the state store, so a restarted trainer keeps it) and the release cadence; the worker that drives
it is `rlbus.consumers.trainer.TrainerWorker`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlbus.rl.online import OnlineBaseline
from rlbus.schemas import Rollout
from rlbus.state.base import StateStore
from rlbus.training.config import OnlineConfig
from rlbus.training.join import ScoredRollout, ServedJoin


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
