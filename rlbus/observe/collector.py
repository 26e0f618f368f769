"""The dashboard's data: bounded time series built by reading the run's topics, registry and counters.

A `Collector` follows ``rl.rewards.v1``, ``rl.weights.v1`` and ``rl.rollouts.v1`` with a group-less
consumer (every partition assigned, nothing committed — like replay and tail, it never joins or
disturbs a production group), starting at a time or offset. Beside the topics it polls the state store:
the worker registry (heartbeat ``info``: version, recent swap pauses, trainer step metrics), the counter
``trainer:version``, and each known consumer group's lag (end offsets − committed offsets). So the
dashboard works from the topics alone and gets richer where workers heartbeat.

What it keeps, each bounded (oldest points fall off):

* reward values by source, at the reward's creation time;
* the policy version of each worker over time — the newest token version of each rollout it wrote, and
  the ``version`` its heartbeat reports — plus the trainer's published versions;
* lag per (topic, consumer group), sampled every poll;
* staleness of arriving rollouts: the newest version published on ``rl.weights.v1`` when the rollout
  reached the log, minus the oldest version among its tokens (computed when a snapshot is taken, so
  topics read out of order at start-up still pair correctly; timestamps are the producers' clocks);
* delta / keyframe bytes against the full size, per published version (from the manifests);
* swap pauses per worker and version, and the trainer's metrics per step (KL k3, max |Δlog-prob|, IS-weight
  ESS, router flips, the share of hacked rollouts), from heartbeats or fed in directly (`add_swap`,
  `add_step`) by an embedded run;
* the reward workers' counts of reward hacking by kind and their ``hack_policy``, from heartbeats.

`snapshot` turns all of it into one JSON-ready dict — what ``/api/snapshot`` serves.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbus.aio import wait_event
from rlbus.bus.base import Bus, Consumer
from rlbus.bus.replay import Bound, plan_window
from rlbus.bus.topics import REWARDS, ROLLOUTS, WEIGHTS
from rlbus.bus.types import Record, TopicPartition
from rlbus.errors import RlbusError
from rlbus.observe.lag import DEFAULT_GROUPS as GROUP_TOPICS
from rlbus.observe.lag import group_lag
from rlbus.schemas import Reward, Rollout, WeightVersion
from rlbus.state.base import StateStore, WorkerRecord
from rlbus.state.progress import VERSION_COUNTER

log = logging.getLogger("rlbus.observe.collector")

#: Consumer groups whose lag the dashboard shows, per topic (the groups the workers join).
DEFAULT_GROUPS: dict[str, tuple[str, ...]] = {
    topic: tuple(group for group, topics in GROUP_TOPICS.items() if topic in topics)
    for topic in dict.fromkeys(t for topics in GROUP_TOPICS.values() for t in topics)
}

#: Trainer step metrics the step charts draw (mismatch: docs/architecture.md §5; reward hacking), in the order
#: the snapshot lists them.
STEP_FIELDS = ("kl_k3", "max_abs_dlogprob", "is_ess", "router_flip_rate", "reward_mean", "hacked")


@dataclass(frozen=True)
class Limits:
    """How much history the collector keeps; memory stays flat however long the run."""

    #: Points per time series (per reward source, per worker, per lag series …).
    points: int = 4000
    #: Rollouts remembered for the staleness histogram (the newest ones).
    rollouts: int = 20_000
    #: Weight versions remembered (bytes chart, version timeline).
    versions: int = 5000
    #: Time bins a reward series is averaged into for the chart.
    reward_bins: int = 150


@dataclass(frozen=True)
class _Arrival:
    t: float
    oldest: int
    newest: int


class Collector:
    """Reads the run's topics and state into bounded series; `run` follows them until ``stop``."""

    def __init__(
        self,
        *,
        bus: Bus,
        state: StateStore | None = None,
        start: Bound | None = None,
        model_id: str = "policy",
        groups: Mapping[str, Sequence[str]] = DEFAULT_GROUPS,
        poll_s: float = 1.0,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``start`` = where to begin reading each topic (None: the beginning of the log); ``model_id`` =
        the policy whose versions are followed (a weights topic may carry several models)."""
        self._bus = bus
        self._state = state
        self._start = start
        self.model_id = model_id
        self._groups = {topic: tuple(names) for topic, names in groups.items()}
        self._poll_s = poll_s
        self.limits = limits or Limits()
        self._clock = clock
        n = self.limits.points
        self.started = clock()
        self.rewards: dict[str, deque[tuple[float, float]]] = {}
        self.worker_versions: dict[str, deque[tuple[float, int]]] = {}
        self.worker_regions: dict[str, str] = {}
        self.published: list[tuple[float, int]] = []  # (log time, version), sorted by time
        self.weights: dict[int, dict[str, Any]] = {}
        self.arrivals: deque[_Arrival] = deque(maxlen=self.limits.rollouts)
        self.lag: dict[str, deque[tuple[float, int]]] = {}
        self.swaps: dict[str, deque[tuple[float, int | None, float]]] = {}
        self._last_swap: dict[str, int] = {}  # per worker, the highest swap number recorded
        self.steps: deque[dict[str, Any]] = deque(maxlen=n)
        self._last_step = -1
        self.workers: list[WorkerRecord] = []
        self.trainer_version: int | None = None
        self.counts = {"rewards": 0, "rollouts": 0, "weights": 0, "unreadable": 0, "claimed": 0}
        #: Per judging reward worker, its heartbeat's judge figures (`rlbus.rewards.judge.JudgeStats`).
        self.judges: dict[str, dict[str, float]] = {}
        #: Per reward worker that found reward hacking, its heartbeat's counts by kind and its policy.
        self.hacks: dict[str, dict[str, Any]] = {}
        self.error: str | None = None

    # --- following ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Follow the topics and poll the state store until ``stop`` is set."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._follow(stop))
            tasks.create_task(self._poll(stop))

    async def _follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async with self._bus.consumer([REWARDS, WEIGHTS, ROLLOUTS], group=None) as consumer:
                    await self._seek(consumer)
                    self.error = None
                    while not stop.is_set():
                        self.ingest(await consumer.getmany(timeout_s=0.5, max_records=1000))
            except RlbusError as exc:  # broker down, topics not created yet: show it and retry
                self.error = f"reading topics: {exc}"
                log.warning("%s; retrying", self.error)
                await wait_event(stop, 2.0)

    async def _seek(self, consumer: Consumer) -> None:
        for topic in (REWARDS.name, WEIGHTS.name, ROLLOUTS.name):
            window = await plan_window(self._bus, topic, self._start, None)
            for partition, offset in window.starts.items():
                await consumer.seek(TopicPartition(topic, partition), offset)

    async def _poll(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.poll_once()
            except RlbusError as exc:
                self.error = f"polling state and lag: {exc}"
                log.warning("%s", self.error)
            await wait_event(stop, self._poll_s)

    async def poll_once(self) -> None:
        """One look at the registry, the trainer's version counter and every known group's lag."""
        now = self._clock()
        if self._state is not None:
            self.workers = await self._state.workers()
            for worker in self.workers:
                self.add_heartbeat(worker, now)
            self.trainer_version = await self._state.get_counter(VERSION_COUNTER)
        for topic, groups in self._groups.items():
            ends = await self._bus.end_offsets(topic)
            begins = await self._bus.beginning_offsets(topic)
            for group in groups:
                lag = await group_lag(self._bus, group, topic, ends=ends, starts=begins)
                if lag.ever_committed:  # else the group has not consumed this topic (yet)
                    self._append(self.lag, f"{topic} ← {group}", (now, lag.total))

    # --- ingesting ---------------------------------------------------------------------------------
    def ingest(self, records: Iterable[Record[Any]]) -> None:
        """Add consumed records; an unreadable one is counted and skipped (the workers dead-letter it).
        A claim-checked record (payload in the blob store) is readable only through a
        :class:`rlbus.bus.claimcheck.ClaimCheckBus`; on a plain bus it is counted as ``claimed``."""
        for record in records:
            try:
                message = record.value
            except RlbusError as exc:
                self.counts["claimed" if record.header("rlbus.claim") is not None else "unreadable"] += 1
                log.debug("unreadable record at %s: %s", record.where, exc)
                continue
            arrived = record.timestamp_ms / 1000
            if isinstance(message, Reward):
                self.add_reward(message.source, message.value, message.created_at or arrived)
            elif isinstance(message, WeightVersion):
                self.add_manifest(message, arrived)
            elif isinstance(message, Rollout):
                self.add_rollout(message, arrived)

    def add_reward(self, source: str, value: float, t: float) -> None:
        self.counts["rewards"] += 1
        if not math.isfinite(value):  # JSON has no NaN; a broken scorer shows as a gap, not a broken page
            return
        self._append(self.rewards, source or "unknown", (t, float(value)))

    def add_manifest(self, manifest: WeightVersion, t: float) -> None:
        """A published version: its place on the version timeline and its bytes against the full size."""
        if manifest.model_id != self.model_id:
            return
        self.counts["weights"] += 1
        if manifest.version not in self.weights:
            bisect.insort(self.published, (t, manifest.version))
            del self.published[: -self.limits.versions]
        entry = self.weights.setdefault(
            manifest.version, {"version": manifest.version, "t": t, "full_bytes": manifest.full_bytes}
        )
        entry[f"{manifest.kind}_bytes"] = manifest.encoded_bytes
        entry["t"] = min(entry["t"], t)
        if len(self.weights) > self.limits.versions:
            del self.weights[min(self.weights)]

    def add_rollout(self, rollout: Rollout, t: float) -> None:
        """A rollout's token versions: its worker's version then, and its staleness on arrival."""
        if rollout.model_id != self.model_id:
            return
        self.counts["rollouts"] += 1
        versions = rollout.token_versions.to_numpy() if rollout.token_versions.numel else np.zeros(0)
        sampled = versions[versions >= 0]
        if not sampled.size:  # arrays in the blob store, or nothing sampled: no version to show
            return
        newest, oldest = int(sampled.max()), int(sampled.min())
        worker = rollout.worker_id or rollout.region or "unknown"
        if rollout.region:
            self.worker_regions[worker] = rollout.region
        self.add_worker_version(worker, newest, rollout.created_at or t)
        self.arrivals.append(_Arrival(t, oldest, newest))

    def add_worker_version(self, worker: str, version: int, t: float) -> None:
        """Keep change points only (and the latest sighting), so a steady worker costs two points."""
        series = self.worker_versions.setdefault(worker, deque(maxlen=self.limits.points))
        if len(series) >= 2 and series[-1][1] == version and series[-2][1] == version:
            series[-1] = (max(series[-1][0], t), version)
        else:
            series.append((t, version))

    def add_swap(self, worker: str, seq: int, pause_s: float, t: float, version: int | None = None) -> None:
        """The ``seq``-th version a worker applied (its index in `WeightSync.history`) and its swap pause.
        Reporters (heartbeats, the demo) report a worker's swaps in order, so anything at or below the
        highest ``seq`` recorded is a repeat."""
        if seq <= self._last_swap.get(worker, -1):
            return
        self._last_swap[worker] = seq
        self._append(self.swaps, worker, (t, version, pause_s * 1000))

    def add_step(self, metrics: Mapping[str, Any], t: float) -> None:
        """One trainer step's metrics; a step number at or below the newest recorded is a repeat."""
        step = metrics.get("step")
        if not isinstance(step, int) or step <= self._last_step:
            return
        self._last_step = step
        point = {"t": t, "step": step, "version": metrics.get("version")}
        point |= {k: _finite(metrics.get(k)) for k in STEP_FIELDS}
        self.steps.append(point)

    def add_heartbeat(self, worker: WorkerRecord, t: float) -> None:
        """What a registry entry adds (the ``stats()`` of the workers, see :mod:`rlbus.observe.heartbeat`):
        a rollout worker's version and recent swap pauses, a reward worker's judge figures and hack counts,
        the trainer's latest step."""
        info = worker["info"]
        worker_id = worker["worker_id"]
        region = info.get("region")
        if isinstance(region, str) and region:
            self.worker_regions[worker_id] = region
        version = info.get("version")
        pauses = info.get("swap_pause_ms")
        if isinstance(pauses, list):  # the newest len(pauses) of `syncs` applied versions, oldest first
            first = int(info.get("syncs") or len(pauses)) - len(pauses)
            for i, ms in enumerate(pauses):
                if isinstance(ms, int | float):
                    last = i == len(pauses) - 1
                    self.add_swap(worker_id, first + i, ms / 1000, t, version if last else None)
        if worker["role"] == "rollout" and isinstance(version, int):
            self.add_worker_version(worker_id, version, worker["last_seen"])
        judge = {k: v for k, v in info.items() if k.startswith("judge_") and isinstance(v, int | float)}
        if worker["role"] == "reward" and judge:
            self.judges[worker_id] = judge
        hacks = info.get("hacks")
        if worker["role"] == "reward" and isinstance(hacks, dict):
            kinds = {k: v for k, v in hacks.items() if isinstance(v, int) and v > 0}
            if kinds:
                self.hacks[worker_id] = {"kinds": kinds, "policy": info.get("hack_policy")}
        step = info.get("step")
        last_step = info.get("last_step")
        if isinstance(step, int) and isinstance(last_step, dict) and last_step:
            self.add_step({**last_step, "step": step, "version": version}, t)

    # --- the snapshot ------------------------------------------------------------------------------
    def staleness(self) -> dict[int, int]:
        """{versions behind the newest published version at arrival: rollouts} over remembered arrivals."""
        times = [t for t, _ in self.published]
        histogram: dict[int, int] = {}
        for arrival in self.arrivals:
            i = bisect.bisect_right(times, arrival.t)
            current = max(arrival.newest, self.published[i - 1][1] if i else arrival.newest)
            lag = current - arrival.oldest
            histogram[lag] = histogram.get(lag, 0) + 1
        return dict(sorted(histogram.items()))

    def snapshot(self) -> dict[str, Any]:
        """Everything the dashboard draws, JSON-ready; times are Unix seconds."""
        published = max((v for _, v in self.published), default=None)
        latest_step = self.steps[-1] if self.steps else None
        return {
            "now": self._clock(),
            "started": self.started,
            "error": self.error,
            "counts": dict(self.counts),
            "trainer": {
                "version": self.trainer_version if self.trainer_version is not None else published,
                "published": published,
                "step": latest_step["step"] if latest_step else None,
            },
            "workers": [_worker_row(w, self.worker_regions) for w in self.workers],
            "rewards": {s: _binned(list(p), self.limits.reward_bins) for s, p in sorted(self.rewards.items())},
            "versions": {
                "trainer": [[t, v] for t, v in self.published],
                **{
                    w: [[t, v] for t, v in series]
                    for w, series in sorted(self.worker_versions.items())
                },
            },
            "regions": dict(self.worker_regions),
            "lag": {k: [[t, n] for t, n in series] for k, series in sorted(self.lag.items())},
            "staleness": {str(k): n for k, n in self.staleness().items()},
            "weights": [self.weights[v] for v in sorted(self.weights)],
            "swaps": {w: [[t, v, ms] for t, v, ms in s] for w, s in sorted(self.swaps.items())},
            "steps": list(self.steps),
            "judges": {w: dict(figures) for w, figures in sorted(self.judges.items())},
            "hacks": {w: {"kinds": dict(h["kinds"]), "policy": h["policy"]} for w, h in sorted(self.hacks.items())},
        }

    def _append(self, table: dict[str, deque[Any]], key: str, point: Any) -> None:
        table.setdefault(key, deque(maxlen=self.limits.points)).append(point)


def _binned(points: list[tuple[float, float]], bins: int) -> list[list[float]]:
    """[[t, mean, n]] over at most ``bins`` equal time bins (each bin's time is its points' mean time)."""
    if not points:
        return []
    points.sort()
    lo, hi = points[0][0], points[-1][0]
    width = (hi - lo) / bins or 1.0
    sums: dict[int, list[float]] = {}
    for t, value in points:
        acc = sums.setdefault(min(bins - 1, int((t - lo) / width)), [0.0, 0.0, 0.0])
        acc[0] += t
        acc[1] += value
        acc[2] += 1
    return [[acc[0] / acc[2], acc[1] / acc[2], acc[2]] for _, acc in sorted(sums.items())]


def _worker_row(worker: WorkerRecord, regions: Mapping[str, str]) -> dict[str, Any]:
    info = worker["info"]
    scalars = {k: v for k, v in info.items() if isinstance(v, str | int | float | bool) or v is None}
    return {
        "role": worker["role"],
        "worker_id": worker["worker_id"],
        "region": info.get("region") or regions.get(worker["worker_id"], ""),
        "version": info.get("version"),
        "last_seen": worker["last_seen"],
        "info": scalars,
    }


def _finite(value: Any) -> float | None:
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None
