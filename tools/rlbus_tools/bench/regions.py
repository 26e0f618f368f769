"""``rlbus bench regions``: the distributed loop across an emulated WAN — three regions, rack-aware brokers,
a pull-through blob relay per region, links with latency and bandwidth, and one region cut off.

The setup, all on loopback (:mod:`rlbus_tools.services.wan`):

* a three-broker KRaft cluster, one broker per region (``broker.rack``, `RackAwareReplicaSelector`), with a
  listener per region that advertises the region's Toxiproxy proxies, so every Kafka byte a region sends or
  fetches crosses its links; consumers set ``client.rack`` and fetch from their region's replica (KIP-392);
* Redis and the blob origin in the home region (eu-west, with the trainer, the reward worker and the prompt
  producer), reached from each region through a proxy shaped like its link to home; the origin has one
  listener per region, so what it serves is counted per region — the bytes that crossed each WAN link;
* per region, a relay (`rlbus.blobs.relay`) in front of the origin, the region's rollout workers reading
  through it with the origin as fallback (`rlbus.blobs.failover`);
* the links (one way; Toxiproxy applies them to both directions): eu-west <-> us-east 40 ms, eu-west <->
  ap-south 90 ms, us-east <-> ap-south 110 ms, each ±10 % jitter and 200 Mbit/s per connection.

Every role is its own ``rlbus worker`` process (as ``rlbus up`` runs them), on the chaos suite's tiny policy
and one-digit addition, so the figures are the system's, not a model's. The relay run has five phases:

1. **loopback** — the proxies carry no toxics: the same run, the same processes, on plain loopback;
2. **wan** — the links shaped: publish → swapped per region, against phase 1;
3. **relay-down** — us-east's relay stopped for a phase: its workers read from the origin across the WAN
   (each read counted in their heartbeat's ``blob_failovers``) and keep swapping; started again with its
   cache, it serves them again;
4. **cut** — ap-south's clients lose the network (Kafka, their own region's broker included; Redis; the
   origin) for ``cut_s``
   (60 s; 20 s with ``--quick``): its workers keep generating on the version they hold, their consumer
   group sessions expire and their prompts move to other regions, admission bounds how stale anything
   trained may be (``max_staleness`` 3: the rest is ``dropped_stale``, an outcome, never trained);
5. **recovery** — the links back: ``cut_recovery_s`` is the time until every ap-south worker has swapped
   to the version published at the moment the link came back and has produced a rollout again;
   ``cut.catch_up`` says where that time went, per worker (first swap, holding the newest, versions
   applied, bytes).

A second run (fresh namespace, same brokers and links, shaped from the start) has no relays: every worker
fetches from the origin across the WAN, the baseline of inter-region bytes per version. Each run ends with
the producer stopped, every rollout driven to an outcome, and the chaos suite's exactly-once audit
(`rlbus_tools.chaos.ledger`): ``lost`` and ``trained twice`` must be 0.

Not emulated: broker-to-broker replication and the KRaft quorum talk over plain loopback (only client
traffic has listeners per region), so a cut region's broker keeps replicating; a real partition would
also shrink its ISRs. Toxiproxy's bandwidth cap is per connection, not per link.

The run directories keep each run's log (:mod:`rlbus.observe.runlog`) and a ``wan.json`` — the topology
and these figures — which `rlbus_tools.sim.calibrate` reads to give the simulator the regions' links.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import signal
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from rlbus.blobs.http import BlobServer, HttpStore, serve
from rlbus.blobs.local import LocalStore
from rlbus.observe.runlog import WEIGHTS, RunLogTail, read
from rlbus.observe.stats import percentile
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, require, write_json
from rlbus_tools.chaos.ledger import ScenarioReport
from rlbus_tools.chaos.processes import Workers
from rlbus_tools.chaos.rig import ChaosRig
from rlbus_tools.services import free_port, wan
from rlbus_tools.services import toxiproxy as tp

log = logging.getLogger("rlbus_tools.bench")

HOME = "eu-west"
REGIONS = ("eu-west", "us-east", "ap-south")
#: Rollout workers per region: two where a relay can save a crossing (one copy per region, not per worker).
WORKERS = {"eu-west": 1, "us-east": 2, "ap-south": 2}
CUT = "ap-south"
#: The region whose relay is stopped for a phase (its workers then read from the origin).
RELAY_DOWN = "us-east"
LINKS = {
    ("eu-west", "us-east"): tp.Link(latency_ms=40, jitter_ms=4, bandwidth_mbit=200),
    ("eu-west", "ap-south"): tp.Link(latency_ms=90, jitter_ms=9, bandwidth_mbit=200),
    ("us-east", "ap-south"): tp.Link(latency_ms=110, jitter_ms=11, bandwidth_mbit=200),
}
WAN = wan.Topology(home=HOME, regions=REGIONS, links=LINKS)
LOOPBACK = wan.Topology(home=HOME, regions=REGIONS)
MAX_STALENESS = 3


@dataclass(frozen=True)
class Plan:
    """How long each phase runs, in seconds (the trainer publishes a version every step, about twice a
    second on this tiny policy, so a phase holds tens of versions)."""

    phase_s: float
    cut_s: float
    budget_s: float


FULL = Plan(phase_s=60.0, cut_s=60.0, budget_s=1800.0)
QUICK = Plan(phase_s=15.0, cut_s=20.0, budget_s=900.0)


@dataclass(frozen=True)
class Beat:
    """One rollout worker's heartbeat, as the bench saw it."""

    t: float
    worker: str
    region: str
    #: Consumer lag on the prompts (records on its partitions not yet committed).
    lag: int
    #: Versions its weights are behind the trainer's newest.
    behind: int
    #: Blob reads it made from the origin because its relay failed, so far.
    failovers: int


@dataclass
class Phase:
    name: str
    t0: float
    t1: float = 0.0
    #: The trainer's version at the start and the end.
    v0: int = 0
    v1: int = 0
    #: Bytes the origin served to each region during the phase (what crossed that region's WAN link).
    egress: dict[str, int] = field(default_factory=dict)


class Fleet:
    """One run's processes and the services only this bench has: the origin's listeners and the relays."""

    def __init__(self, rig: ChaosRig, links: wan.Wan, proxies: tp.Toxiproxy, root: Path, name: str, *,
                 relays: bool, plan: Plan, topology: wan.Topology) -> None:
        self.rig, self.wan, self.proxies, self.root, self.relays = rig, links, proxies, root, relays
        #: The links the proxies have now.
        self.current = topology
        self.workers = Workers(rig, root, name, seed=0, prompts=10**6, max_staleness=MAX_STALENESS,
                               budget_s=plan.budget_s, partitions=2 * sum(WORKERS.values()))
        self.secret = secrets.token_urlsafe(24)
        self.origin = BlobServer(LocalStore(root / "blobs"), secret=self.secret)
        self.port_region: dict[int, str] = {}
        self.relay_servers: dict[str, BlobServer] = {}
        self.relay_ports: dict[str, int] = {}
        self.relay_upstreams: dict[str, str] = {}
        self._relay_runners: dict[str, web.AppRunner] = {}
        #: Each relay's counts from the runs of it that were stopped (a relay killed and started again).
        self.relay_history: dict[str, list[dict[str, int]]] = defaultdict(list)
        self.phases: list[Phase] = []
        #: The run's logs, read as they grow (the phases poll them every fraction of a second).
        self.log = RunLogTail(self.run_dir)
        #: Which proxies are cut (the region's clients, toward every other region).
        self.cut_proxies: list[tp.Proxy] = []
        #: Every rollout worker heartbeat seen (`Beat`).
        self.beats: list[Beat] = []
        self.rollout_names = [f"rollout-{region}-{i}" for region in REGIONS for i in range(WORKERS[region])]

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    async def start(self, stack: AsyncExitStack) -> None:
        """The origin (a listener per region behind that region's proxy), the relays, then the processes."""
        await stack.enter_async_context(self.workers)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        runner = await serve(self.origin, "127.0.0.1", free_port())
        stack.push_async_callback(runner.cleanup)
        region_origin: dict[str, str] = {}
        for region in REGIONS:
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.port_region[port] = region
            proxy = self.proxies.proxy(f"{self.workers.namespace}-{region}-blobs", "127.0.0.1:0", f"127.0.0.1:{port}")
            self.wan.proxies[region, f"blobs-{self.workers.namespace}"] = proxy
            self.wan.located[f"blobs-{self.workers.namespace}"] = HOME
            region_origin[region] = f"http://{proxy.listen}"
        self.shape(self.current)
        stack.push_async_callback(self.stop_relays)
        rollouts: list[tuple[str, dict[str, str], str]] = []
        for region in REGIONS:
            upstream = region_origin[region]
            url = upstream
            if self.relays:
                self.relay_ports[region], self.relay_upstreams[region] = free_port(), upstream
                await self.start_relay(region)
                url = f"http://127.0.0.1:{self.relay_ports[region]}"
            for name in self.rollout_names:
                if _region(name) == region:
                    env = {**self.region_env(region), "RLBUS_BLOB_URL": url, "RLBUS_BLOB_SECRET": self.secret}
                    if self.relays:
                        env["RLBUS_BLOB_FALLBACK_URL"] = upstream
                    rollouts.append((name, env, region))
        home = {"RLBUS_KAFKA_BOOTSTRAP": self.region_env(HOME)["RLBUS_KAFKA_BOOTSTRAP"]}
        self.workers.start("trainer", home, region=HOME)  # it publishes v1 while the others load
        for name, env, region in rollouts:
            self.workers.start(name, env, region=region)
        for name in ("reward", "prompts"):
            self.workers.start(name, home, region=HOME)
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sample_lag(stop))

        async def stop_sampling() -> None:
            stop.set()
            await sampler

        stack.push_async_callback(stop_sampling)

    async def start_relay(self, region: str) -> None:
        """``region``'s relay on its port, its cache directory kept from any earlier run of it."""
        relay = BlobServer(LocalStore(self.root / f"relay-{region}"), secret=self.secret,
                           upstream=HttpStore(self.relay_upstreams[region], secret=self.secret))
        self._relay_runners[region] = await serve(relay, "127.0.0.1", self.relay_ports[region])
        self.relay_servers[region] = relay

    async def stop_relay(self, region: str) -> None:
        """The relay process goes away: its listener closes, connections in flight are cut."""
        runner = self._relay_runners.pop(region, None)
        if runner is None:
            return
        relay = self.relay_servers[region]
        await runner.cleanup()
        await relay.upstream.close()  # type: ignore[union-attr]
        self.relay_history[region].append(dataclasses.asdict(relay.upstream_count))

    def relay_upstream(self, region: str) -> dict[str, int]:
        """What ``region``'s relay fetched from the origin over all its runs, the one running now included."""
        server = self.relay_servers[region]
        running = [dataclasses.asdict(server.upstream_count)] if region in self._relay_runners else []
        runs = [*self.relay_history[region], *running]
        return {k: sum(run[k] for run in runs) for k in ("blobs", "bytes", "retried_ranges", "abandoned")}

    async def stop_relays(self) -> None:
        for region in list(self._relay_runners):
            await self.stop_relay(region)

    def region_env(self, region: str) -> dict[str, str]:
        where = self.wan.regions[region]
        return {"RLBUS_KAFKA_BOOTSTRAP": where.bootstrap, "RLBUS_REDIS_URL": f"redis://{where.redis}/0"}

    def shape(self, topology: wan.Topology) -> None:
        """Every proxy of this run (and the shared Kafka and Redis ones) shaped like ``topology``'s links."""
        self.current = topology
        for (region, what), proxy in self.wan.proxies.items():
            proxy.shape(topology.link(region, self.wan.located[what]))

    def cut(self, region: str) -> None:
        """``region``'s clients lose the network: every proxy they connect through goes down — Kafka (the
        region's own broker included), Redis, the origin (so its relay's upstream too).

        The region's broker itself stays in the cluster: the brokers replicate over plain loopback, so it
        keeps leading its partitions for the other regions' clients. Leaving the region's clients their own
        broker instead would keep them in their consumer group whenever the group's coordinator is that broker:
        they would hold their prompts for the whole cut, and the ordered join would wait on them — a hybrid no
        real partition makes (the isolated broker would lose its leaderships and coordinators)."""
        self.cut_proxies = [p for (r, _), p in self.wan.proxies.items() if r == region]
        for proxy in self.cut_proxies:
            proxy.cut()

    def restore(self) -> None:
        for proxy in self.cut_proxies:
            proxy.restore()
        self.cut_proxies = []

    # --- what the run says -----------------------------------------------------------------------
    def version(self) -> int:
        return max((int(e["version"]) for e in self.log.events(WEIGHTS)), default=0)

    def published(self) -> list[tuple[float, int]]:
        return sorted((float(e["t"]), int(e["version"])) for e in self.log.events(WEIGHTS))

    def syncs(self, name: str) -> list[dict[str, Any]]:
        return list(self.log.events(f"syncs-{name}"))

    def rollouts(self, name: str) -> list[dict[str, Any]]:
        return list(self.log.events(f"rollouts-{name}"))

    def egress(self) -> dict[str, int]:
        return {region: self.origin.served_bytes.get(port, 0) for port, region in self.port_region.items()}

    async def sample_lag(self, stop: asyncio.Event) -> None:
        """Each second, every rollout worker's last heartbeat: its consumer lag on the prompts and how many
        versions its weights are behind the trainer's (a cut region's heartbeats stop: they cannot reach Redis)."""
        seen: dict[str, float] = {}
        while not stop.is_set():
            try:
                version = self.version()
                for record in await self.workers.state.workers("rollout"):
                    info, name = record["info"], record["worker_id"]
                    if seen.get(name) == record["last_seen"] or name not in self.rollout_names:
                        continue
                    seen[name] = record["last_seen"]
                    self.beats.append(Beat(
                        t=record["last_seen"], worker=name, region=_region(name), lag=int(info.get("lag") or 0),
                        behind=max(0, version - int(info.get("version") or 0)),
                        failovers=int(info.get("blob_failovers") or 0),
                    ))
            except Exception:  # the sampler must outlive a state-store hiccup
                pass
            await asyncio.sleep(1.0)

    async def phase(self, name: str, seconds: float) -> Phase:
        """Let the run go on for ``seconds``; what it did then is phase ``name``."""
        say(f"{self.workers.namespace}: phase {name} ({seconds:.0f} s, from v{self.version()})")
        phase = Phase(name, t0=time.time(), v0=self.version())
        before = self.egress()
        await self.workers.wait_until(f"phase {name}", lambda: time.time() - phase.t0 >= seconds,
                                      timeout_s=seconds + 30)
        after = self.egress()
        phase.t1, phase.v1 = time.time(), self.version()
        phase.egress = {r: after[r] - before[r] for r in REGIONS}
        self.phases.append(phase)
        return phase

    async def wait_all_synced(self) -> None:
        """Every rollout worker has swapped in a version and produced a rollout (the loop is running)."""
        def ready() -> bool:
            return all(self.syncs(n) and self.rollouts(n) for n in self.rollout_names)

        say(f"{self.workers.namespace}: {len(self.rollout_names)} rollout workers in {len(REGIONS)} regions starting")
        await self.workers.wait_until("every rollout worker syncs and generates", ready, timeout_s=300)

    async def wind_down(self, report: ScenarioReport) -> ScenarioReport:
        """Stop the producer, drive every rollout to an outcome, and audit the ledger."""
        say(f"{self.workers.namespace}: stopping the producer, draining, auditing the ledger")
        self.workers.signal("prompts", signal.SIGTERM)
        await self.workers.wait("prompts", 60)
        report.check("every rollout reached an outcome in time", await self.workers.drain(timeout_s=300))
        return await self.workers.finish(report)


def say(line: str) -> None:
    print(f"[regions {time.strftime('%H:%M:%S')}] {line}", flush=True)


@contextmanager
def _quiet() -> Iterator[None]:
    """Links cut on purpose make aiokafka and the blob clients log loudly; the table is the output."""
    levels = {name: logging.getLogger(name).level for name in ("aiokafka", "rlbus")}
    for name in levels:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def run(quick: bool = False, json_path: Path | None = None) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    began = time.monotonic()
    with _quiet():
        result = asyncio.run(_run(plan))
    result["meta"] = {**meta(), "quick": quick, "wall_s": round(time.monotonic() - began, 1),
                      "links": {f"{a}<->{b}": vars(link) for (a, b), link in LINKS.items()},
                      "workers": WORKERS, "cut_region": CUT, "cut_s": plan.cut_s, "max_staleness": MAX_STALENESS}
    _print(result)
    write_json(json_path, result)
    return result


async def _run(plan: Plan) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rlbus-regions-") as tmp:
        home = Path(tmp)
        rig = await asyncio.to_thread(
            ChaosRig.start, home, brokers=3, racks=REGIONS, region_ports=wan.kafka_region_ports(REGIONS, brokers=3)
        )
        try:
            say(f"3 brokers (racks {', '.join(REGIONS)}) and Redis up; starting toxiproxy")
            with tp.running(log=home / "toxiproxy.log") as proxies:
                redis = f"127.0.0.1:{rig.redis.port}"
                links = wan.connect(proxies, LOOPBACK, kafka=rig.cluster, redis=redis)
                relay_run = await _relay_run(rig, links, proxies, home / "runs" / "relay", plan)
                direct_run = await _direct_run(rig, links, proxies, home / "runs" / "direct", plan)
        finally:
            await asyncio.to_thread(rig.stop)
    return _summarize(relay_run, direct_run, plan)


async def _relay_run(rig: ChaosRig, links: wan.Wan, proxies: tp.Toxiproxy, root: Path, plan: Plan) -> dict[str, Any]:
    report = ScenarioReport(scenario="regions-relay")
    fleet = Fleet(rig, links, proxies, root, "regions-relay", relays=True, plan=plan, topology=LOOPBACK)
    cut: dict[str, Any] = {}
    relay_down: dict[str, Any] = {}
    async with AsyncExitStack() as stack:
        try:
            await fleet.start(stack)
            await fleet.wait_all_synced()
            await fleet.phase("loopback", plan.phase_s)
            fleet.shape(WAN)
            await fleet.phase("wan", plan.phase_s)
            relay_down = await _relay_down(fleet, plan, report)
            cut = await _cut(fleet, plan, report)
        except Exception as exc:  # a broken run is a failed report with its reason, not a crashed bench
            report.check("the run ran to its end", False)
            report.notes.append(f"{type(exc).__name__}: {str(exc)[:600]}")
        fleet.restore()
        fleet.shape(WAN)
        await fleet.wind_down(report)
        _write_wan_json(fleet, WAN)
        figures = _figures(fleet, report.finish(), cut)
        figures["relay_down"] = relay_down
        return figures


async def _relay_down(fleet: Fleet, plan: Plan, report: ScenarioReport) -> dict[str, Any]:
    """``RELAY_DOWN``'s relay stops for a phase: its workers read from the origin across the WAN (counted) and
    keep swapping versions; started again (its cache kept), they go back to it."""
    def failovers() -> dict[str, int]:
        latest: dict[str, int] = {}
        for beat in fleet.beats:
            if beat.region == RELAY_DOWN:
                latest[beat.worker] = beat.failovers
        return latest

    before = failovers()
    say(f"{fleet.workers.namespace}: {RELAY_DOWN}'s relay stopped for {plan.phase_s:.0f} s")
    await fleet.stop_relay(RELAY_DOWN)
    phase = await fleet.phase("relay-down", plan.phase_s)
    await fleet.start_relay(RELAY_DOWN)
    await asyncio.sleep(5.0)  # a heartbeat or two: the count the phase ended with
    during = failovers()
    syncs = sum(1 for name in fleet.rollout_names if _region(name) == RELAY_DOWN
                for s in fleet.syncs(name) if phase.t0 <= float(s["t"]) < phase.t1)
    counted = sum(during.values()) - sum(before.values())
    report.faults.append(f"{RELAY_DOWN}'s relay down for {plan.phase_s:.0f} s")
    report.check(f"{RELAY_DOWN}'s workers kept swapping versions without their relay", syncs > 0)
    report.check(f"{RELAY_DOWN}'s reads from the origin were counted", counted > 0)
    return {"region": RELAY_DOWN, "seconds": plan.phase_s, "syncs_while_down": syncs, "failovers": counted,
            "versions_while_down": phase.v1 - phase.v0}


async def _cut(fleet: Fleet, plan: Plan, report: ScenarioReport) -> dict[str, Any]:
    """Cut ``CUT`` off for ``cut_s``, restore it, and time its recovery."""
    say(f"{fleet.workers.namespace}: {CUT} cut off for {plan.cut_s:.0f} s (at v{fleet.version()})")
    phase = Phase("cut", t0=time.time(), v0=fleet.version())
    before = fleet.egress()
    fleet.cut(CUT)
    held = {n: max((int(s["version"]) for s in fleet.syncs(n)), default=0) for n in fleet.rollout_names}
    await asyncio.sleep(plan.cut_s)
    during = {n: len(fleet.rollouts(n)) for n in fleet.rollout_names}
    fleet.restore()
    restored_at, target = time.time(), fleet.version()
    say(f"{fleet.workers.namespace}: {CUT} back at v{target}; waiting for it to catch up")
    phase.t1, phase.v1 = restored_at, target
    phase.egress = {r: fleet.egress()[r] - before[r] for r in REGIONS}
    fleet.phases.append(phase)
    cut_workers = [n for n in fleet.rollout_names if n.startswith(f"rollout-{CUT}-")]

    def recovered() -> bool:
        return all(
            any(int(s["version"]) >= target and float(s["t"]) >= restored_at for s in fleet.syncs(n))
            and any(float(r["created_at"]) >= restored_at for r in fleet.rollouts(n))
            for n in cut_workers
        )

    recovery_s = None
    try:
        await fleet.workers.wait_until(f"{CUT} catches up after the cut", recovered, timeout_s=300)
        recovery_s = round(time.time() - restored_at, 2)
    except TimeoutError as exc:
        report.notes.append(str(exc))
    report.check(f"{CUT} caught up after the cut", recovery_s is not None)
    report.faults.append(f"{CUT} cut off for {plan.cut_s:.0f} s")
    report.recovery_s = recovery_s
    await fleet.phase("recovery", plan.phase_s)
    return {
        "region": CUT, "cut_s": plan.cut_s, "versions_published_during": target - phase.v0,
        "held_version_at_cut": {n: held[n] for n in cut_workers},
        "rollouts_made_during_cut": {n: during[n] - _made_before(fleet, n, phase.t0) for n in cut_workers},
        "recovery_s": recovery_s,
        "catch_up": {n: _catch_up(fleet, n, restored_at, target) for n in cut_workers},
    }


def _catch_up(fleet: Fleet, name: str, restored_at: float, target: int) -> dict[str, Any]:
    """Where a cut worker's recovery went, from its own logs: how soon after the restore it applied its
    first version, how many versions it applied (and how many of them through a rebuild) until it held
    ``target``, their bytes and staging time, and when it made its first rollout again."""
    after = sorted((s for s in fleet.syncs(name) if float(s["t"]) >= restored_at), key=lambda s: float(s["t"]))
    upto = []
    for sync in after:
        upto.append(sync)
        if int(sync["version"]) >= target:
            break
    reached = upto[-1] if upto and int(upto[-1]["version"]) >= target else None
    first_rollout = min((float(r["created_at"]) for r in fleet.rollouts(name)
                         if float(r["created_at"]) >= restored_at), default=None)

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - restored_at, 2)

    return {
        "first_sync_s": since(float(upto[0]["t"]) if upto else None),
        "held_target_s": since(float(reached["t"]) if reached else None),
        "versions_applied": len(upto),
        "rebuilt": sum(1 for s in upto if s.get("rebuilt")),
        "bytes_fetched": sum(int(s.get("bytes_fetched", 0)) for s in upto),
        "stage_s": round(sum(float(s.get("stage_s", 0.0)) for s in upto), 2),
        "first_rollout_s": since(first_rollout),
    }


def _made_before(fleet: Fleet, name: str, t: float) -> int:
    return sum(1 for r in fleet.rollouts(name) if float(r["created_at"]) < t)


async def _direct_run(rig: ChaosRig, links: wan.Wan, proxies: tp.Toxiproxy, root: Path, plan: Plan) -> dict[str, Any]:
    report = ScenarioReport(scenario="regions-direct")
    fleet = Fleet(rig, links, proxies, root, "regions-direct", relays=False, plan=plan, topology=WAN)
    async with AsyncExitStack() as stack:
        try:
            await fleet.start(stack)
            await fleet.wait_all_synced()
            await fleet.phase("wan", plan.phase_s)
        except Exception as exc:
            report.check("the run ran to its end", False)
            report.notes.append(f"{type(exc).__name__}: {str(exc)[:600]}")
        await fleet.wind_down(report)
        _write_wan_json(fleet, WAN)
        return _figures(fleet, report.finish(), {})


def _region(name: str) -> str:
    return next(r for r in REGIONS if name.startswith(f"rollout-{r}-"))


def _figures(fleet: Fleet, report: ScenarioReport, cut: dict[str, Any]) -> dict[str, Any]:
    """Per phase and region: sync lag, staleness, bytes across the link; and the run's ledger."""
    published = fleet.published()
    phases = []
    for phase in fleet.phases:
        lags: dict[str, list[float]] = defaultdict(list)
        kinds: dict[str, Counter[str]] = defaultdict(Counter)
        stale: dict[str, list[int]] = defaultdict(list)
        for name in fleet.rollout_names:
            region = _region(name)
            for s in fleet.syncs(name):
                if phase.t0 <= float(s["manifest_at"]) < phase.t1:
                    lags[region].append(float(s["lag_s"]))
                    kinds[region][str(s["kind"])] += int(s["bytes_fetched"])
            for r in fleet.rollouts(name):
                if phase.t0 <= float(r["created_at"]) < phase.t1 and r.get("versions"):
                    latest = max((v for t, v in published if t <= float(r["created_at"])), default=0)
                    stale[region].append(max(0, latest - int(r["versions"][0])))
        versions = max(1, phase.v1 - phase.v0)
        lag = defaultdict(list)
        behind = defaultdict(list)
        for beat in fleet.beats:
            if phase.t0 <= beat.t < phase.t1:
                lag[beat.region].append(beat.lag)
                behind[beat.region].append(beat.behind)
        phases.append({
            "phase": phase.name, "seconds": round(phase.t1 - phase.t0, 1), "versions": phase.v1 - phase.v0,
            "regions": {
                region: {
                    "sync_lag_p50_s": _pct(lags[region], 50), "sync_lag_p99_s": _pct(lags[region], 99),
                    "syncs": len(lags[region]),
                    "staleness_mean": round(sum(stale[region]) / len(stale[region]), 3) if stale[region] else None,
                    "staleness_max": max(stale[region], default=None),
                    "rollouts": len(stale[region]),
                    "consumer_lag_mean": round(sum(lag[region]) / len(lag[region]), 2) if lag[region] else None,
                    "consumer_lag_max": max(lag[region], default=None),
                    "weights_behind_mean": (round(sum(behind[region]) / len(behind[region]), 2)
                                            if behind[region] else None),
                    "heartbeats": len(lag[region]),
                    "wan_bytes_per_version": round(phase.egress.get(region, 0) / versions),
                    "worker_bytes_by_kind": dict(kinds[region]),
                }
                for region in REGIONS
            },
        })
    relay = {region: fleet.relay_upstream(region) for region in fleet.relay_servers}
    weights = list(read(fleet.run_dir, WEIGHTS))
    return {
        "relays": fleet.relays, "phases": phases, "relay_upstream": relay, "cut": cut,
        "report": report.as_dict(),
        "delta_bytes_mean": round(sum(int(w["delta_bytes"]) for w in weights) / max(1, len(weights))),
        "full_bytes": int(weights[-1]["full_bytes"]) if weights else 0,
    }


def _pct(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 3) if values else None


def _write_wan_json(fleet: Fleet, topology: wan.Topology) -> None:
    """The topology beside the run log, for `rlbus_tools.sim.calibrate`: per region its workers and its link home."""
    regions = []
    for region in REGIONS:
        link = topology.link(region, HOME)
        regions.append({
            "name": region, "workers": WORKERS[region], "relay": fleet.relays,
            "wan_latency_ms": link.latency_ms,
            "wan_gbps": (link.bandwidth_mbit or 10_000.0) / 1000.0,
            "worker_ids": [n for n in fleet.rollout_names if _region(n) == region],
        })
    fleet.run_dir.mkdir(parents=True, exist_ok=True)
    (fleet.run_dir / "wan.json").write_text(json.dumps({"home": HOME, "regions": regions}, indent=2) + "\n")


def _summarize(relay: dict[str, Any], direct: dict[str, Any], plan: Plan) -> dict[str, Any]:
    def phase(run: dict[str, Any], name: str) -> dict[str, Any]:
        return next((p for p in run["phases"] if p["phase"] == name), {"regions": {}})

    wan_relay, wan_direct = phase(relay, "wan")["regions"], phase(direct, "wan")["regions"]
    remote = [r for r in REGIONS if r != HOME]
    reports = [relay["report"], direct["report"]]
    return {
        "runs": {"relay": relay, "direct": direct},
        "summary": {
            "lost": sum(r["lost"] for r in reports),
            "trained_twice": sum(r["duplicates_trained"] for r in reports),
            "passed": all(r["passed"] for r in reports),
            "sync_lag_p99_s_by_region": {r: wan_relay.get(r, {}).get("sync_lag_p99_s") for r in REGIONS},
            "sync_lag_p99_s_by_region_loopback": {
                r: phase(relay, "loopback")["regions"].get(r, {}).get("sync_lag_p99_s") for r in REGIONS},
            "staleness_mean_by_region": {r: wan_relay.get(r, {}).get("staleness_mean") for r in REGIONS},
            "interregion_bytes_per_version_relay": sum(
                wan_relay.get(r, {}).get("wan_bytes_per_version", 0) for r in remote),
            "interregion_bytes_per_version_no_relay": sum(
                wan_direct.get(r, {}).get("wan_bytes_per_version", 0) for r in remote),
            "cut_recovery_s": relay["cut"].get("recovery_s"),
            "cut_versions_published": relay["cut"].get("versions_published_during"),
            "relay_down_syncs": relay.get("relay_down", {}).get("syncs_while_down"),
            "relay_down_failovers": relay.get("relay_down", {}).get("failovers"),
            "cut_s": plan.cut_s,
        },
    }


def _print(result: dict[str, Any]) -> None:
    rows = []
    for run_name, run in result["runs"].items():
        for phase in run["phases"]:
            for region, f in phase["regions"].items():
                rows.append([f"{run_name}/{phase['phase']}", region, f["sync_lag_p50_s"], f["sync_lag_p99_s"],
                             f["staleness_mean"], f["consumer_lag_mean"], f["weights_behind_mean"],
                             f["wan_bytes_per_version"], f["rollouts"]])
    print_table("rlbus bench regions — per phase and region (lag: publish → swapped; staleness: versions behind "
                "when a rollout was made)",
                ["run/phase", "region", "lag p50 s", "lag p99 s", "staleness", "consumer lag", "weights behind",
                 "WAN B/version", "rollouts"], rows, width=140)
    s = result["summary"]
    ledger = [[name, r["report"]["produced"], r["report"]["trained"],
               ", ".join(f"{k.removeprefix('dropped_')} {v}" for k, v in r["report"]["dropped"].items()) or "0",
               r["report"]["duplicates_trained"], r["report"]["lost"], "yes" if r["report"]["passed"] else "NO"]
              for name, r in result["runs"].items()]
    print_table("ledger (exactly-once audit)", ["run", "produced", "trained", "dropped", "trained twice", "lost",
                                                "passed"], ledger, width=140)
    print(f"inter-region blob bytes per version: {s['interregion_bytes_per_version_relay']:,} with relays, "
          f"{s['interregion_bytes_per_version_no_relay']:,} without; {CUT} cut {s['cut_s']:.0f} s, caught up "
          f"{s['cut_recovery_s']} s after the links came back; {RELAY_DOWN}'s relay down: {s['relay_down_syncs']} "
          f"swaps, {s['relay_down_failovers']} reads from the origin instead")
    catch_up = result["runs"]["relay"]["cut"].get("catch_up", {})
    if catch_up:
        print_table(f"{CUT} catching up after the cut (seconds from the links' return)",
                    ["worker", "first swap s", "holds newest s", "versions applied", "rebuilt", "bytes",
                     "staging s", "first rollout s"],
                    [[n, c["first_sync_s"], c["held_target_s"], c["versions_applied"], c["rebuilt"],
                      f"{c['bytes_fetched']:,}", c["stage_s"], c["first_rollout_s"]] for n, c in catch_up.items()],
                    width=140)
    for name, r in result["runs"].items():
        if not r["report"]["passed"]:
            failed = [c for c, ok in r["report"]["checks"].items() if not ok]
            print(f"{name}: FAILED {failed}; {r['report']['notes'][:3]}")


def main(json_path: JsonPath = None, quick: Quick = False) -> None:
    """Regions over an emulated WAN with relays: sync lag, WAN bytes, a dead relay, a cut region's recovery."""
    result = run(quick=quick, json_path=json_path)
    require(result["summary"]["passed"], "a region run failed its checks or lost a rollout (see the ledger table)")
