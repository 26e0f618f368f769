"""What the distributed roles write into the run log (format: :mod:`rlbus.observe.runlog`).

The trainer writes, per GRPO step, ``steps`` (the step's metrics), ``inputs`` (the groups trained:
prompt id, sequence number, rollout ids, rewards, the policy versions each rollout's tokens came from),
``rewards`` (one line per trained rollout and reward source) and, per published version, ``weights``.
``inputs`` is what a replay must reproduce (:mod:`rlbus.training.ordered`); ``completions`` (when each of the
step's groups became complete in the join, by the clock) is timing, kept apart from it. Each rollout worker
writes its weight swaps to ``syncs-<worker>`` and one line per rollout it publishes to ``rollouts-<worker>`` (when it
finished, sampled tokens, token versions, seconds generating and in the environment): what
:mod:`rlbus_tools.sim.calibrate` measures a run's generation rate and episode lengths from. Nothing here imports
torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlbus.aio import wait_event
from rlbus.observe.runlog import COMPLETIONS, INPUTS, REWARDS, STEPS, WEIGHTS, RunLog, rollouts_name, syncs_name
from rlbus.schemas import Rollout
from rlbus.training.join import ScoredGroup
from rlbus.training.ordered import prompt_seq


def token_versions(rollout: Rollout) -> list[int]:
    """The distinct policy versions of the rollout's sampled tokens, ascending."""
    versions = rollout.token_versions.to_numpy()
    sampled = rollout.loss_mask.to_numpy().astype(bool)
    return sorted({int(v) for v in np.unique(versions[sampled]) if v >= 0})


def inputs_event(step: int, version: int, groups: Sequence[ScoredGroup]) -> dict[str, Any]:
    """One ``inputs`` line: the groups a step trained on, in the order it saw them."""
    return {
        "step": step,
        "version": version,
        "groups": [
            {
                "prompt_id": g.prompt_id,
                "seq": prompt_seq(g.rollouts[0].rollout) if g.rollouts else None,
                "rollout_ids": [s.rollout.rollout_id for s in g.rollouts],
                "rewards": [s.reward for s in g.rollouts],
                "versions": [token_versions(s.rollout) for s in g.rollouts],
            }
            for g in groups
        ],
    }


class TrainerRecorder:
    """``on_train`` for the trainer worker: writes steps, inputs, rewards and new weight versions.

    ``publisher`` is anything with a ``history`` list of publish stats (the WeightPublisher); the entries
    not yet written go to ``weights`` after each step (and on :meth:`flush`, for the first version).
    """

    def __init__(self, log: RunLog, *, publisher: Any, extra: Any = None, join: Any = None) -> None:
        self.log = log
        self._publisher = publisher
        self._extra = extra
        #: the trainer's join: an ordered one keeps ``completed_at`` per group, written to ``completions`` here
        self._completed: dict[str, float] = getattr(join, "completed_at", {})
        self._weights_written = 0

    def flush_weights(self) -> None:
        history = self._publisher.history
        for stats in history[self._weights_written :]:
            self.log.write(WEIGHTS, stats)
        self._weights_written = len(history)

    def __call__(self, groups: list[ScoredGroup], metrics: dict[str, Any]) -> None:
        step = int(metrics["step"])
        extra = self._extra() if callable(self._extra) else {}
        self.log.write(STEPS, {**metrics, **extra})
        self.log.write(INPUTS, inputs_event(step, int(metrics["version"]), groups))
        completed = {g.prompt_id: t for g in groups if (t := self._completed.pop(g.prompt_id, None)) is not None}
        if completed:  # timing, not inputs: a replay reproduces inputs.jsonl, never these clocks
            self.log.write(COMPLETIONS, {"step": step, "completed_at": completed})
        for group in groups:
            for scored in group.rollouts:
                for source, value in scored.components.items():
                    if "." not in source:  # "verifier", not its "verifier.exact" components
                        self.log.write(REWARDS, {"step": step, "prompt_id": group.prompt_id, "source": source,
                                                 "value": value, "rollout_id": scored.rollout.rollout_id})
        self.flush_weights()


def rollout_event(rollout: Rollout, *, worker_id: str) -> dict[str, Any]:
    """One ``rollouts-<worker>`` line."""
    versions = token_versions(rollout)
    return {
        "worker": worker_id, "rollout_id": rollout.rollout_id, "prompt_id": rollout.prompt_id,
        "group_index": rollout.group_index, "created_at": rollout.created_at,
        "sampled_tokens": int(rollout.loss_mask.to_numpy().sum()), "tokens": len(rollout.loss_mask.to_numpy()),
        "versions": [versions[0], versions[-1]] if versions else [],
        "timings": {k: round(v, 6) for k, v in rollout.timings.items()},
        "turns": rollout.metadata.get("stat.turns"),
    }


class RolloutRecorder:
    """``on_rollout`` for a rollout worker: one ``rollouts-<worker>`` line per rollout it publishes."""

    def __init__(self, log: RunLog, worker_id: str) -> None:
        self.log = log
        self.worker_id = worker_id
        self._name = rollouts_name(worker_id)

    def __call__(self, rollout: Rollout) -> None:
        self.log.write(self._name, rollout_event(rollout, worker_id=self.worker_id))


async def follow_syncs(sync: Any, log: RunLog, worker_id: str, stop: asyncio.Event, every_s: float = 0.25) -> None:
    """Append each new entry of ``sync.history`` (a WeightSync) to ``syncs-<worker_id>`` until ``stop``."""
    written = 0
    name = syncs_name(worker_id)
    while True:
        history = sync.history
        for stats in history[written:]:
            log.write(name, {"worker": worker_id, **_fields(stats)})
        written = len(history)
        if stop.is_set():
            return
        await wait_event(stop, every_s)


def _fields(stats: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) and not isinstance(stats, type) else dict(stats)
