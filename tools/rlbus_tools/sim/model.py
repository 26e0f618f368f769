"""The discrete-event model of an rlbus run (SimPy processes; the package docstring lists what is and is
not modelled).

Processes and what each stands for:

* ``producer`` — :class:`rlbus.producers.prompts.PromptProducer`: admits prompt ``n`` while the *same*
  :class:`~rlbus.producers.prompts.Admission` (imported, not re-derived) allows it for the trainer's
  version, the lowest version a registered worker serves, groups done and groups freed.
* ``worker`` (one per rollout worker) — :class:`rlbus.consumers.rollout.RolloutWorker`: takes prompts
  from the shared prompt queue while it has a free slot (``groups_in_flight``) and plays each group on
  the version it holds; a group takes as long as its longest episode (log-normal tokens at the worker's
  per-sequence rate, shrunk by the production traffic it serves, plus tool and setup time, plus the
  swap pauses that hit it).
* reward scoring — a pool of ``reward.workers`` slots, one rollout at a time.
* the ordered join — :mod:`rlbus.training.ordered`: groups leave for the trainer in prompt order.
* ``trainer`` — its loop releases complete groups from the join on a timer (whole batches, in prompt
  order), takes ``groups_per_step`` of them, drops rollouts more than ``max_staleness``
  versions old (their group frees its admission slot), steps, and every ``publish_every`` steps casts,
  delta-encodes (ranks in parallel) and uploads a version.
* ``relay`` (one per region with a relay) and ``sync`` (one per worker) — :mod:`rlbus.weights.sync`:
  each version crosses the region's WAN link once to the relay (or once per worker without one), then
  is staged and swapped in; a worker that fell behind a keyframe takes the keyframe.
* ``autoscaler`` — KEDA's Kafka scaler on the prompts consumer group's lag; ``faults`` — region cuts
  and preemptions, whose in-flight groups go back to the queue after the consumer session times out.

Sync mode is the baseline of ``async_vs_sync_speedup``: one batch of ``groups_per_step × publish_every``
prompts per version, workers start them only on that version, the trainer waits for the whole batch.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Literal

import simpy

from rlbus.producers.prompts import Admission, Progress
from rlbus_tools.sim.fleet import Fleet, RegionSection

Mode = Literal["async", "sync"]
GBIT = 1e9 / 8


class Signal:
    """Wakes every process waiting on it: ``wait()`` is the current event, ``fire()`` triggers it and arms a
    new one (so a waiter never misses a change, and nobody polls)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.event = env.event()

    def wait(self) -> simpy.Event:
        return self.event

    def fire(self) -> None:
        event, self.event = self.event, self.env.event()
        event.succeed()


class PromptQueue:
    """The prompts topic as the rollout consumer group sees it: FIFO, and a redelivered prompt (its worker
    vanished) comes round again first."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.items: deque[Group] = deque()
        self.waiters: deque[simpy.Event] = deque()

    def put(self, group: Group, *, front: bool = False) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.triggered:
                waiter.succeed(group)
                return
        (self.items.appendleft if front else self.items.append)(group)

    def get(self) -> simpy.Event:
        event = self.env.event()
        if self.items:
            event.succeed(self.items.popleft())
        else:
            self.waiters.append(event)
        return event

    def cancel(self, event: simpy.Event) -> None:
        """Withdraw a get nobody will use; a group it already took goes back to the head."""
        if event.triggered:
            assert isinstance(event.value, Group)
            self.put(event.value, front=True)
        elif event in self.waiters:
            self.waiters.remove(event)


@dataclass
class Group:
    seq: int
    #: sync mode: the version the group must be generated with
    version: int = 0
    #: the version of the group's first sampled token (what the trainer's staleness check reads)
    start_version: int = 0
    tokens: int = 0


@dataclass
class Worker:
    name: str
    region: str
    slots: int
    wake: Signal
    version: int = 0
    alive: bool = False
    connected: bool = True
    retiring: bool = False
    #: when the registry last heard from a worker that went silent (cut or dead)
    silent_since: float = 0.0
    playing: dict[int, tuple[Any, Group]] = field(default_factory=dict)
    pause_total: float = 0.0


@dataclass
class Stats:
    window_start: float | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    staleness: Counter[int] = field(default_factory=Counter)
    redelivered: int = 0
    publishes: dict[int, float] = field(default_factory=dict)
    #: worker → {version: swapped at}; region → {version: every worker of the region swapped at}
    swaps: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    worker_region: dict[str, str] = field(default_factory=dict)
    region_swapped: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    wan_bytes: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    wan_keyframe_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    delta_transfer_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    version_bytes: dict[int, float] = field(default_factory=dict)
    trainer_busy_s: float = 0.0
    reward_busy_s: float = 0.0
    slot_busy_s: float = 0.0
    wasted_gen_s: float = 0.0
    #: (time, admitted-but-untrained groups), for Little's law
    in_system: list[tuple[float, int]] = field(default_factory=list)
    #: (time, live workers, their slots)
    fleet: list[tuple[float, int, int]] = field(default_factory=list)


class Simulation:
    """One simulated run of ``fleet`` in ``mode``; :meth:`run` returns its figures (:mod:`rlbus_tools.sim.report`)."""

    def __init__(self, fleet: Fleet, mode: Mode = "async") -> None:
        self.fleet = fleet
        self.mode = mode
        self.env = simpy.Environment()
        self.rng = random.Random(fleet.sim.seed)
        t = fleet.trainer
        self.per_version = t.groups_per_step * t.publish_every
        self.admission = Admission(
            max_staleness=t.max_staleness if mode == "async" else 0,
            groups_per_step=self.per_version,
            max_in_flight=t.prompts_in_flight_cap,
            slack=t.slack if mode == "async" else 0,
        )
        self.version = 0
        #: the trainer's version as admission reads it (the state store's counter, raised after the ledger)
        self.counter_version = 0
        #: the newest version whose manifest consumers have received
        self.announced = 0
        self.groups_done = 0
        #: groups the trainer has taken (``groups_done`` counts them only once the step's counters are written)
        self.groups_taken = 0
        #: groups on their way between places (the prompt hop, a redelivery's wait, scoring and the join hop)
        self.in_transit = 0
        self.groups_freed = 0
        self.admitted = 0
        self.in_system = 0
        self.queue = PromptQueue(self.env)
        #: groups released by the join, not yet taken by a step
        self.ready: list[Group] = []
        self.joined = Signal(self.env)
        self.join: dict[int, Group] = {}
        self.next_seq = 0
        self.rewards = simpy.Resource(self.env, capacity=fleet.reward.workers)
        self.changed = Signal(self.env)
        self.published = Signal(self.env)
        self.workers: list[Worker] = []
        self.regions = {r.name: r for r in fleet.region}
        self.region_up = {r.name: True for r in fleet.region}
        #: the newest version each region's relay holds, and the signal of a new one
        self.relay_version = {r.name: 0 for r in fleet.region}
        self.relay_new = {r.name: Signal(self.env) for r in fleet.region}
        self.stats = Stats()
        self._count = 0
        #: versions a worker can still reach by deltas (the publisher retains this many)
        self.retain = 2 * fleet.model.keyframe_every

    # --- shared state -------------------------------------------------------------------------------
    def served(self) -> int | None:
        """The lowest version a worker in the registry serves: live, or silent for under five beats
        (:func:`rlbus.producers.prompts.lowest_served`)."""
        horizon = 5 * self.fleet.bus.heartbeat_s
        versions = [
            w.version
            for w in self.workers
            if w.version > 0
            and not w.retiring
            and ((w.alive and w.connected) or self.env.now - w.silent_since < horizon)
        ]
        return min(versions, default=None)

    def progress(self) -> Progress:
        served = self.served() if self.fleet.trainer.admission == "served" else None
        return Progress(self.counter_version, self.groups_done, served, self.groups_freed)

    def _counting(self) -> bool:
        return self.stats.window_start is not None

    def _clipped(self, start: float) -> float:
        """Seconds of [start, now] inside the measurement window."""
        if self.stats.window_start is None:
            return 0.0
        return max(0.0, self.env.now - max(start, self.stats.window_start))

    def _in_system(self, delta: int) -> None:
        self.in_system += delta
        self.stats.in_system.append((self.env.now, self.in_system))

    # --- prompts ------------------------------------------------------------------------------------
    def producer(self) -> Any:
        """Admission exactly as the prompt producer decides it; sync: one batch per version."""
        while True:
            if self.mode == "sync":
                while self.counter_version < 1:
                    yield self.changed.wait()
                target = self.counter_version
                for _ in range(self.per_version):
                    self._admit(target)
                while self.counter_version == target:
                    yield self.changed.wait()
                continue
            while self.admission.allows(self.admitted, self.progress(), base_version=1):
                self._admit(0)
                if self.fleet.bus.admit_s:  # each admission re-reads the counters and awaits its send
                    yield self.env.timeout(self.fleet.bus.admit_s)
            yield self.changed.wait()
            poll = self.fleet.bus.producer_poll_s
            if poll:  # held back, it notices a change at its next poll
                yield self.env.timeout(self.rng.uniform(0.0, poll))

    def _admit(self, version: int) -> None:
        group = Group(seq=self.admitted, version=version)
        self.admitted += 1
        self._in_system(+1)
        self.in_transit += 1
        hop = self._hop(self.fleet.bus.prompt_hop_s, self.fleet.bus.prompt_sigma, self.fleet.bus.prompt_samples)
        self.env.process(self._later(hop, functools.partial(self._arrive, group)))

    def _arrive(self, group: Group) -> None:
        self.in_transit -= 1
        self.queue.put(group)

    def _redeliver(self, group: Group) -> None:
        self.in_transit -= 1
        self.queue.put(group, front=True)

    def _hop(self, median: float, sigma: float, samples: list[float] | None) -> float:
        if samples:
            return self.rng.choice(samples)
        return self.rng.lognormvariate(math.log(median), sigma) if sigma and median > 0 else median

    def _later(self, delay: float, action: Any) -> Any:
        yield self.env.timeout(delay)
        action()

    # --- rollout workers ----------------------------------------------------------------------------
    def worker(self, w: Worker) -> Any:
        """Take prompts while a slot is free; each group plays in its own process."""
        while not w.retiring:
            if not (w.alive and w.connected) or len(w.playing) >= w.slots or w.version == 0:
                yield w.wake.wait()
                continue
            get = self.queue.get()
            yield get | w.wake.wait()
            if not get.triggered:
                self.queue.cancel(get)
                continue
            group = get.value
            assert isinstance(group, Group)
            if not (w.alive and w.connected) or w.retiring:
                self.queue.put(group, front=True)
                continue
            w.playing[group.seq] = (self.env.process(self.play(w, group)), group)

    def play(self, w: Worker, group: Group) -> Any:
        f = self.fleet
        region = self.regions[w.region]
        started = self.env.now
        try:
            while self.mode == "sync" and w.version < group.version:
                yield w.wake.wait()
            rate = region.tokens_per_s / region.concurrency * (1.0 - f.traffic.share_at(self.env.now))
            longest, tokens = 0.0, 0
            for _ in range(f.trainer.group_size):
                n = min(
                    f.episode.max_tokens,
                    max(1, round(self.rng.lognormvariate(math.log(f.episode.tokens_median), f.episode.tokens_sigma))),
                )
                tokens += n
                longest = max(longest, f.episode.setup_s + n / rate + (f.episode.turns - 1) * f.episode.tool_s)
            paused = w.pause_total
            # the trainer's staleness check reads the version of the group's first sampled token, which comes
            # one decode step after the world is open (a swap may land in between)
            first = min(longest, f.episode.setup_s + 1.0 / rate)
            yield self.env.timeout(first)
            group.start_version = w.version
            yield self.env.timeout(longest - first)
            while w.pause_total > paused:  # swaps during the group paused its decoding
                extra, paused = w.pause_total - paused, w.pause_total
                yield self.env.timeout(extra)
            group.tokens = tokens
        except simpy.Interrupt:
            self.stats.wasted_gen_s += self._clipped(started)
            self.stats.slot_busy_s += self._clipped(started)
            return
        finally:
            w.playing.pop(group.seq, None)
            w.wake.fire()
        self.stats.slot_busy_s += self._clipped(started)
        self.in_transit += 1
        self.env.process(self.score(group))

    def score(self, group: Group) -> Any:
        """Reward scoring (one slot per rollout), then the ordered join."""
        f = self.fleet
        hop = self._hop(f.bus.join_hop_s, f.bus.join_sigma, f.bus.join_samples)
        yield self.env.timeout(hop / 2)
        yield self.env.all_of([self.env.process(self._score_one()) for _ in range(f.trainer.group_size)])
        yield self.env.timeout(hop / 2)
        self.in_transit -= 1
        self.join[group.seq] = group
        self.joined.fire()

    def _release(self) -> None:
        """The ordered join's release: the run of consecutive complete groups from the cursor, in whole
        batches of ``groups_per_step`` (:mod:`rlbus.training.ordered`)."""
        run = 0
        while self.next_seq + run in self.join:
            run += 1
        batch = self.fleet.trainer.groups_per_step
        for _ in range(run // batch * batch):
            self.ready.append(self.join.pop(self.next_seq))
            self.next_seq += 1

    def _score_one(self) -> Any:
        f = self.fleet
        seconds = f.reward.verifier_s + (f.reward.judge_s if self.rng.random() < f.reward.judge_fraction else 0.0)
        with self.rewards.request() as slot:
            yield slot
            started = self.env.now
            yield self.env.timeout(seconds)
            self.stats.reward_busy_s += self._clipped(started)

    # --- trainer ------------------------------------------------------------------------------------
    def trainer(self) -> Any:
        f, t = self.fleet, self.fleet.trainer
        yield from self.publish()
        steps = 0
        last_expire = -math.inf
        while True:
            # the trainer's loop (rlbus.consumers.trainer): the join releases on its expire call, at most
            # every release_every_s and right after a step when that long has passed
            while len(self.ready) < t.groups_per_step:
                if not t.release_every_s:
                    self._release()
                    if len(self.ready) < t.groups_per_step:
                        yield self.joined.wait()
                    continue
                due = last_expire + t.release_every_s
                if self.env.now < due:
                    yield self.env.timeout(due - self.env.now)
                self._release()
                last_expire = self.env.now
            groups, self.ready = self.ready[: t.groups_per_step], self.ready[t.groups_per_step :]
            limit = self.admission.max_staleness
            ages = [self.version - g.start_version for g in groups]
            trained = [(g, age) for g, age in zip(groups, ages, strict=True) if age <= limit]
            stale = len(groups) - len(trained)
            self.groups_taken += len(groups)
            self._in_system(-len(groups))
            if not trained:  # no step: these groups did not move the trainer, their slots are freed at once
                self.groups_freed += len(groups)
                self.groups_done += len(groups)
                self.changed.fire()
                if self._counting():
                    self.stats.steps.append(
                        {
                            "t": self.env.now,
                            "step": steps,
                            "version": self.version,
                            "groups": 0,
                            "rollouts": 0,
                            "tokens": 0,
                            "dropped": stale * t.group_size,
                        }
                    )
                continue
            busy_from = self.env.now
            step_s = t.step_s * len(trained) / len(groups)
            if t.step_cv > 0:
                shape = 1.0 / t.step_cv**2
                step_s *= self.rng.gammavariate(shape, 1.0 / shape)
            yield self.env.timeout(step_s)
            steps += 1
            if steps % t.publish_every == 0:
                yield from self.publish()
            # the ledger, then the state store's counters: admission sees the step (and the version) now
            counted = functools.partial(self._counted, len(groups), self.version)
            self.env.process(self._later(t.counter_delay_s, counted))
            if not self._counting():
                if self.env.now >= f.sim.warmup_s:
                    self.stats.window_start = self.env.now
                continue
            self.stats.trainer_busy_s += self.env.now - busy_from
            for _, age in trained:
                self.stats.staleness[age] += t.group_size
            self.stats.steps.append(
                {
                    "t": self.env.now,
                    "step": steps,
                    "version": self.version,
                    "groups": len(trained),
                    "rollouts": len(trained) * t.group_size,
                    "tokens": sum(g.tokens for g, _ in trained),
                    "dropped": stale * t.group_size,
                }
            )

    def _counted(self, groups: int, version: int) -> None:
        self.groups_done += groups
        self.counter_version = max(self.counter_version, version)
        self.changed.fire()

    def publish(self) -> Any:
        """Cast and delta-encode (every rank its shard), upload, announce: the next version."""
        f, t = self.fleet, self.fleet.trainer
        version = self.version + 1
        full = f.model.full_bytes
        nbytes = full * f.model.keyframe_fraction if version == 1 else full * f.delta_fraction(version)
        yield self.env.timeout(full / t.world_size / t.encode_bytes_per_s + nbytes / (t.egress_gbps * GBIT))
        self.stats.version_bytes[version] = nbytes
        self.version = version
        if version == 1:  # the initial publish, before any step: its counter goes up at once
            self.counter_version = 1
            self.changed.fire()
        self.stats.publishes[version] = self.env.now
        self.env.process(self._later(t.publish_latency_s, lambda: self._announce(version)))

    def _announce(self, version: int) -> None:
        """The manifest reaches the weights topic's consumers (relays, workers without one)."""
        self.announced = max(self.announced, version)
        self.published.fire()

    # --- weights ------------------------------------------------------------------------------------
    def _bytes_between(self, held: int, target: int) -> tuple[float, bool]:
        """Bytes from ``held`` to ``target``: the deltas while the publisher still retains the chain, else
        the newest keyframe at or before ``target`` and the deltas after it. (bytes, took a keyframe)."""
        if held > 0 and target - held <= self.retain:
            return sum(self.stats.version_bytes[v] for v in range(held + 1, target + 1)), False
        every = self.fleet.model.keyframe_every
        keyframe = (target - 1) // every * every + 1
        full = self.fleet.model.full_bytes * self.fleet.model.keyframe_fraction
        return full + sum(self.stats.version_bytes[v] for v in range(keyframe + 1, target + 1)), True

    def _wan_s(self, region: RegionSection, nbytes: float, sharers: int = 1) -> float:
        """Seconds to move ``nbytes`` from the origin into ``region`` while ``sharers`` transfers share its
        link; the origin's egress is split evenly between the regions; three round trips of set-up
        (manifest, then chunks fetched in parallel)."""
        egress = self.fleet.trainer.egress_gbps / len(self.regions)
        gbps = min(region.wan_gbps, egress) / max(1, sharers)
        return 3 * region.wan_latency_ms / 1000.0 + nbytes / (gbps * GBIT)

    def _count_wan(self, region: str, version: int, nbytes: float, keyframe: bool, took: float) -> None:
        if not self._counting():
            return
        if keyframe:
            self.stats.wan_keyframe_bytes[region] += nbytes
        else:
            self.stats.wan_bytes[region][version] += nbytes
            self.stats.delta_transfer_s[region].append(took)

    def relay(self, region: RegionSection) -> Any:
        """The region's pull-through relay: each new version crosses the WAN once."""
        name = region.name
        while True:
            if not self.region_up[name] or self.relay_version[name] >= self.announced:
                yield self.published.wait()
                continue
            target, held = self.announced, self.relay_version[name]
            nbytes, keyframe = self._bytes_between(held, target)
            took = self._wan_s(region, nbytes)
            yield self.env.timeout(took)
            if not self.region_up[name]:
                continue  # the cut broke the transfer: resumed once the link is back
            self._count_wan(name, target, nbytes, keyframe, took)
            self.relay_version[name] = target
            self.relay_new[name].fire()

    def sync(self, w: Worker) -> Any:
        """A worker's weight sync: stage the next version (from the relay, or across the WAN itself), swap
        it in, beat."""
        f = self.fleet
        region = self.regions[w.region]
        while not w.retiring:
            source = self.relay_version[w.region] if region.relay else self.announced
            if not (w.alive and w.connected) or w.version >= source:
                yield (self.relay_new[w.region] if region.relay else self.published).wait() | w.wake.wait()
                continue
            nbytes, keyframe = self._bytes_between(w.version, source)
            sharers = max(1, sum(1 for o in self.workers if o.region == w.region and o.alive and o.connected))
            if region.relay:
                move_s = nbytes / (region.lan_gbps * GBIT / sharers)
            else:
                move_s = self._wan_s(region, nbytes, sharers)
            samples = f.model.stage_samples
            stage_s = self.rng.choice(samples) if samples and not keyframe else nbytes / f.model.decode_bytes_per_s
            yield self.env.timeout(move_s + stage_s)
            if not (w.alive and w.connected):
                continue
            if not region.relay:
                self._count_wan(w.region, source, nbytes, keyframe, move_s)
            yield self.env.timeout(f.model.swap_pause_s)
            w.pause_total += f.model.swap_pause_s
            w.version = source
            self.stats.swaps[w.name][source] = self.env.now
            members = [o for o in self.workers if o.region == w.region and o.alive and not o.retiring]
            if all(o.version >= source for o in members):
                for v in range(source, 0, -1):
                    if v in self.stats.region_swapped[w.region]:
                        break
                    self.stats.region_swapped[w.region][v] = self.env.now
            self.changed.fire()
            w.wake.fire()

    # --- fleet --------------------------------------------------------------------------------------
    def start_worker(self, region: RegionSection, delay: float = 0.0) -> Worker:
        slots = region.groups_in_flight or max(1, region.concurrency // self.fleet.trainer.group_size)
        w = Worker(name=f"{region.name}-{self._count}", region=region.name, slots=slots, wake=Signal(self.env))
        self._count += 1
        self.workers.append(w)
        self.stats.worker_region[w.name] = region.name

        def boot() -> Any:
            yield self.env.timeout(delay)
            w.alive = True
            w.wake.fire()

        self.env.process(boot())
        self.env.process(self.worker(w))
        self.env.process(self.sync(w))
        return w

    def vanish(self, w: Worker) -> None:
        """A worker the bus lost (cut off, preempted): its groups come back after the session timeout."""
        w.silent_since = self.env.now
        for proc, group in list(w.playing.values()):
            if proc.is_alive:
                proc.interrupt()
            self.stats.redelivered += self.fleet.trainer.group_size if self._counting() else 0
            self.in_transit += 1
            self.env.process(self._later(self.fleet.bus.session_timeout_s, functools.partial(self._redeliver, group)))
        w.wake.fire()

    def monitor(self) -> Any:
        """Samples the fleet's size each heartbeat, and re-evaluates admission (registry entries expire)."""
        while True:
            live = [w for w in self.workers if w.alive and w.connected and not w.retiring]
            self.stats.fleet.append((self.env.now, len(live), sum(w.slots for w in live)))
            yield self.env.timeout(self.fleet.bus.heartbeat_s)
            self.changed.fire()

    def autoscaler(self) -> Any:
        """KEDA's Kafka scaler per region: desired = ceil(lag / lag_per_worker) over the regions, clamped;
        the lag of the prompts group counts every admitted prompt not yet finished (workers commit a prompt
        only once it is played)."""
        a = self.fleet.autoscale
        while True:
            yield self.env.timeout(a.poll_s)
            lag = self.admitted - self.groups_done
            for region in self.fleet.region:
                if not self.region_up[region.name]:
                    continue
                members = [w for w in self.workers if w.region == region.name and not w.retiring]
                desired = min(
                    a.max_workers, max(a.min_workers, math.ceil(lag / (a.lag_per_worker * len(self.regions))))
                )
                for _ in range(desired - len(members)):
                    self.start_worker(region, a.cold_start_s)
                for w in sorted(members, key=lambda o: len(o.playing))[: max(0, len(members) - desired)]:
                    w.retiring = True  # finishes what it plays, takes nothing new
                    w.wake.fire()

    def region_down(self, name: str, at_s: float, for_s: float) -> Any:
        yield self.env.timeout(at_s)
        self.region_up[name] = False
        for w in self.workers:
            if w.region == name and w.connected:
                w.connected = False
                self.vanish(w)
        yield self.env.timeout(for_s)
        self.region_up[name] = True
        for w in self.workers:
            if w.region == name:
                w.connected = True
                w.wake.fire()
        self.published.fire()
        self.changed.fire()

    def preemptions(self, rate_per_hour: float, restart_s: float) -> Any:
        while True:
            alive = [w for w in self.workers if w.alive and w.connected and not w.retiring]
            yield self.env.timeout(self.rng.expovariate(rate_per_hour * max(1, len(alive)) / 3600.0))
            alive = [w for w in self.workers if w.alive and w.connected and not w.retiring]
            if alive:
                w = self.rng.choice(alive)
                w.alive = False
                self.vanish(w)
                w.version = 0  # a new process: it loads a keyframe
                self.env.process(self._later(restart_s, lambda w=w: self._revive(w)))

    def _revive(self, w: Worker) -> None:
        w.alive = True
        w.wake.fire()

    def located(self) -> int:
        """Admitted groups found somewhere in the pipeline, counted place by place (not from the admission
        and take counters): the queue, a worker, in transit, the join, the trainer's ready batches."""
        playing = sum(len(w.playing) for w in self.workers)
        return len(self.queue.items) + playing + self.in_transit + len(self.join) + len(self.ready)

    # --- run ----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from rlbus_tools.sim.report import figures

        f = self.fleet
        for region in f.region:
            for _ in range(region.workers):
                self.start_worker(region)
            if region.relay:
                self.env.process(self.relay(region))
        self.env.process(self.producer())
        self.env.process(self.trainer())
        self.env.process(self.monitor())
        if f.autoscale.enabled:
            self.env.process(self.autoscaler())
        for fault in f.fault:
            if fault.kind == "region_down":
                assert fault.region is not None
                self.env.process(self.region_down(fault.region, fault.at_s, fault.for_s))
            else:
                self.env.process(self.preemptions(fault.rate_per_worker_hour, fault.restart_s))
        self.env.run(until=f.sim.duration_s)
        return figures(self)
