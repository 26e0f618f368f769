"""Process faults: ``rlbus worker`` processes SIGKILLed, restarted, and stopped with SIGTERM.

The roles run as the distributed mode runs them (:mod:`rlbus.launch.roles`): one ``rlbus worker <role>``
process each — trainer, reward worker, two rollout workers, prompt producer — on the rig's Kafka and
Redis, under a run namespace of their own (their topics, groups and Redis keys carry its prefix), with a
shared blob directory, a tiny policy and one-digit addition. The producer is stopped once the run has
its prompts, so the workload is bounded and the ledger can be audited when everything has an outcome.
``rollout_kill`` admits every prompt at once (``max_staleness`` 1000), so the killed worker leaves a
backlog behind; ``graceful_stop`` paces admission (``max_staleness`` 3) so that workers started late still
find work — and rollouts more than 3 versions behind are dropped as stale, an outcome like any other.

* ``rollout_kill``: the only rollout worker SIGKILLed mid-generation with a backlog of prompts, and a
  replacement started. Its uncommitted prompts — the ones in flight and the ones queued on its
  partitions — are redelivered to the replacement once the group notices (session timeout); a replayed
  prompt produces the same rollout ids, so copies on the log collapse in the join and every prompt
  completes exactly once.
* ``trainer_kill``: the trainer SIGKILLed at a seeded moment inside a step and started again. It restores
  its newest checkpoint, settles or releases again the rollouts it held (rlbus/training/join.py, "Trained
  with the checkpoint") and resumes from the committed offsets and the join buffer. Beyond the ledger, once
  everything has an outcome the trainer stops gracefully and the scenario compares the checkpoint's count
  of rollouts in the model's updates with the ledger's "trained": more means an update applied twice,
  fewer an update lost (each counted, never hidden).
* ``worker_lag``: one rollout worker reads the weights through a blob store that stalls for longer than
  ``max_staleness`` versions while it keeps generating (admission counting from the published version);
  its rollouts are dropped as stale, their groups free their admission slots and training goes on: the
  run admits and trains all its prompts (before the slots were freed, this run stopped admitting for good).
* ``graceful_stop``: a rollout worker stopped with one SIGTERM finishes the prompts it holds, commits and
  exits 0 (nothing redelivered); the trainer stopped with one SIGTERM checkpoints exactly the recorded
  step and a restart continues; a worker sent two SIGTERMs exits at once with 143.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbus.aio import until
from rlbus.bus.kafka import KafkaBus
from rlbus.bus.namespace import NamespacedBus, namespaced
from rlbus.bus.topics import PROMPTS, ROLLOUTS, WEIGHTS, topic_specs
from rlbus.schemas import Rollout
from rlbus.state.progress import GROUPS_FREED_COUNTER, PROMPT_SEQ, VERSION_COUNTER
from rlbus.state.redis import RedisStateStore
from rlbus.training.join import FINAL, ROLLED_BACK, JoinBuffer, Outcome, RewardPolicy
from rlbus_tools.chaos.blobs import StallingStore
from rlbus_tools.chaos.harness import Progress
from rlbus_tools.chaos.ledger import ScenarioReport, TopicTail, audit, fill, read_topic
from rlbus_tools.chaos.rig import PARTITIONS, ChaosRig
from rlbus_tools.services import free_port

if TYPE_CHECKING:
    from rlbus.training.checkpoint import TrainerState

ROLES = ("trainer", "reward", "rollout-a", "rollout-b", "prompts")
#: Exit statuses a scenario's own signals explain: running, drained, SIGKILLed, SIGTERM's default
#: action (the handler already restored after draining), the second-SIGTERM exit.
SIGNALLED = (None, 0, -signal.SIGKILL, -signal.SIGTERM, 128 + signal.SIGTERM)


def run_config(
    rig: ChaosRig, root: Path, namespace: str, *, seed: int, max_staleness: int, admission: str = "served",
    trainer_ranks: int = 1,
) -> str:
    """The run's TOML: a tiny policy, groups of 4, one group per step, a checkpoint every step, the trainer
    on ``trainer_ranks`` ranks."""
    return f"""
[bus]
{rig.bus_toml()}
[state]
url = "{rig.redis.url}"
[store]
dir = "{root / 'blobs'}"
[task]
env = "arith"
env_config = {{digits = 1}}
group_size = 4
seed = {seed}
[model]
d_model = 32
n_layer = 2
n_head = 2
d_ff = 32
max_seq = 64
[trainer]
lr = 1e-3
groups_per_step = 1
admission = "{admission}"
checkpoint_dir = "{root / 'checkpoints'}"
checkpoint_every = 1
join_timeout_s = 60
warm_steps = 0
world_size = {trainer_ranks}
keyframe_every = 5
retain_versions = 1000
[trainer.grpo]
max_staleness = {max_staleness}
[rollout]
prompts_in_flight = 2
max_batch = 32
episode_threads = 16
[reward]
concurrency = 4
[run]
run_dir = "{root / 'run'}"
namespace = "{namespace}"
"""


class Workers:
    """The role processes of one run: start, signal, wait, and read what they left behind."""

    def __init__(
        self, rig: ChaosRig, root: Path, name: str, *, seed: int, prompts: int, max_staleness: int,
        budget_s: float = 900.0, admission: str = "served", partitions: int = PARTITIONS, trainer_ranks: int = 1,
    ) -> None:
        """``trainer_ranks`` > 1 starts the trainer under torchrun as `rlbus up` does (one process per rank)."""
        self.rig = rig
        #: Partitions of the run's topics: at least as many as rollout workers, or some get no prompts.
        self.partitions = partitions
        self.trainer_ranks = trainer_ranks
        #: Every wait ends by then, so a stuck scenario fails with its report (which wait, what the ledger
        #: counted) inside its test's timeout, instead of being killed by the timeout with nothing said.
        self.deadline = time.monotonic() + budget_s
        self.notes: list[str] = []
        self.root = root
        self.namespace = f"chaos-{name}-{uuid.uuid4().hex[:6]}"
        self.prompts = prompts
        root.mkdir(parents=True, exist_ok=True)
        (root / "logs").mkdir(exist_ok=True)
        self.config = root / "run.toml"
        self.config.write_text(run_config(rig, root, self.namespace, seed=seed, max_staleness=max_staleness,
                                          admission=admission, trainer_ranks=trainer_ranks))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        #: An exit status outside SIGNALLED that the scenario's own signal explains, per process (torchrun
        #: reports a SIGTERM it passed on to ranks that drained and exited 0 with 1: `_effect`).
        self.explained: dict[str, int] = {}
        self.state = RedisStateStore.from_url(rig.redis.url, key_prefix=f"rlbus:{self.namespace}:", reconnect=True)
        self.join = JoinBuffer(state=self.state, policy=RewardPolicy())
        self.bus = namespaced(rig.bus(client_id=f"chaos-{name}"), f"{self.namespace}.")
        self.progress = Progress()
        self._tails: dict[str, TopicTail] = {}

    async def __aenter__(self) -> Workers:
        await self.bus.start()
        specs = topic_specs(replication=self.rig.replication, partitions=self.partitions)
        await self.bus.create_topics(specs)
        inner = self.bus.inner if isinstance(self.bus, NamespacedBus) else self.bus
        assert isinstance(inner, KafkaBus)
        await self.rig.wait_metadata(inner, [f"{self.namespace}.{s.name}" for s in specs], present=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop_all)
        for tail in self._tails.values():
            await tail.close()
        await self.bus.close()
        await self.state.close()

    async def records(self, topic: str) -> list[Any]:
        """Every record of ``topic`` so far (a :class:`TopicTail`: cheap to poll, also over TLS)."""
        if topic not in self._tails:
            self._tails[topic] = TopicTail(self.bus, topic)
        return await self._tails[topic].read()

    # --- processes -------------------------------------------------------------------------------
    def start(
        self, name: str, env: dict[str, str] | None = None, *, region: str | None = None
    ) -> subprocess.Popen[bytes]:
        """Start role process ``name`` (its role is the name's first word) in ``region``; ``env`` is set on top
        of the rig's (a worker's own blob store URL, its region's proxies)."""
        from rlbus.launch.processes import rlbus_command, torchrun_command

        role = name.split("-")[0]
        base = [*torchrun_command(self.trainer_ranks)] if role == "trainer" and self.trainer_ranks > 1 else [
            *rlbus_command(), "worker"]
        log = (self.root / "logs" / f"{name}.log").open("ab")
        extra, env = env or {}, {**os.environ, "PYTHONUNBUFFERED": "1"}
        for key in ("RLBUS_KAFKA_BOOTSTRAP", "RLBUS_REDIS_URL", "RLBUS_BLOB_URL"):
            env.pop(key, None)  # the run config names the rig's services; a developer's env must not win
        env.update(extra)
        proc = subprocess.Popen(
            [*base, role, "--config", str(self.config), "--worker-id", name, *(["--region", region] if region else [])],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def signal(self, name: str, sig: signal.Signals) -> None:
        os.kill(self.procs[name].pid, sig)

    async def wait(self, name: str, timeout_s: float) -> int | None:
        try:
            return await asyncio.to_thread(self.procs[name].wait, timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def stop_all(self, grace_s: float = 20.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def log_tail(self, name: str, lines: int = 12) -> str:
        path = self.root / "logs" / f"{name}.log"
        text = path.read_text(errors="replace") if path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    # --- what the run says -------------------------------------------------------------------------
    async def outcomes(self) -> int:
        counts = await self.join.counts()
        return sum(v for k, v in counts.items() if k != Outcome.DUPLICATE.value)

    async def admitted(self) -> int:
        return await self.state.get_counter(PROMPT_SEQ)

    def recorded_steps(self) -> list[dict[str, Any]]:
        """The trainer's ``inputs`` run-log lines (one per recorded step)."""
        path = self.root / "run" / "inputs.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def checkpoint_state(self) -> TrainerState | None:
        from rlbus.training.checkpoint import load_checkpoint

        return load_checkpoint(self.root / "checkpoints") if (self.root / "checkpoints").is_dir() else None

    def checkpoint_step(self) -> int | None:
        saved = self.checkpoint_state()
        return None if saved is None else saved.step

    async def sample(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.progress.samples.append((time.monotonic(), await self.outcomes()))
            except Exception:  # the sampler must outlive a state-store hiccup
                pass
            await asyncio.sleep(0.2)

    async def wait_until(self, what: str, condition: Callable[[], Any], timeout_s: float) -> None:
        def alive() -> None:
            dead = [n for n, p in self.procs.items() if p.poll() not in SIGNALLED]
            if dead:
                raise RuntimeError(f"{dead[0]} exited with {self.procs[dead[0]].returncode} while waiting for "
                                   f"{what}:\n{self.log_tail(dead[0])}")

        left = self.deadline - time.monotonic()
        if left < timeout_s:
            what = f"{what} (cut to the scenario's remaining budget)"
        await until(condition, what, timeout_s=max(1.0, min(timeout_s, left)), every_s=0.2, check=alive)

    async def start_run(self, roles: tuple[str, ...] = ROLES) -> None:
        """Trainer first (it publishes v1), then reward, rollout workers and the producer; the producer
        is stopped (SIGTERM) once the run has admitted its prompts."""
        for name in roles:
            self.start(name)

    async def stop_producer_at_quota(self) -> None:
        await self.wait_until("prompts admitted", lambda: self._at_quota(), timeout_s=240)
        self.signal("prompts", signal.SIGTERM)
        await self.wait("prompts", 60)

    async def _at_quota(self) -> bool:
        return await self.admitted() >= self.prompts

    async def expected(self) -> int:
        prompts = await read_topic(self.bus, PROMPTS.name)
        return sum(p.group_size for p in prompts if hasattr(p, "group_size"))

    async def drain(self, timeout_s: float) -> bool:
        total = await self.expected()
        try:
            await self.wait_until("every rollout has an outcome", lambda: self._reached(total), timeout_s)
        except TimeoutError as exc:
            ids = sorted({r.rollout_id for r in await _rollouts(self)})
            open_ids = [i for i in ids if not await self.state.seen(FINAL, i)]
            self.notes.append(f"{exc}: the outcome counters sum to {await self.outcomes()} of {total}; "
                              f"{len(ids) - len(open_ids)} of the {len(ids)} rollout ids on the log have an "
                              f"outcome in the ledger; without one: {open_ids[:5]}")
            return False
        return True

    async def _reached(self, total: int) -> bool:
        return await self.outcomes() >= total

    async def finish(self, report: ScenarioReport) -> ScenarioReport:
        found = await audit(bus=self.bus, state=self.state, join=self.join, run_id=None)
        fill(report, found)
        report.notes += self.notes
        failed = [n for n, p in self.procs.items()
                  if p.returncode not in SIGNALLED and p.returncode != self.explained.get(n)]
        for name in failed:
            report.notes.append(f"{name} exited {self.procs[name].returncode}: {self.log_tail(name, 4)}")
        report.check("no worker failed on its own", not failed)
        return report


async def _scenario(
    rig: ChaosRig,
    name: str,
    *,
    seed: int,
    prompts: int,
    body: Callable[[Workers, ScenarioReport], Any],
    max_staleness: int = 1000,
    roles: tuple[str, ...] = ROLES,
    budget_s: float = 900.0,
    admission: str = "served",
    trainer_ranks: int = 1,
) -> ScenarioReport:
    report = ScenarioReport(scenario=name)
    began = time.monotonic()
    stop = asyncio.Event()
    root = rig.home / "runs" / name
    async with Workers(rig, root, name, seed=seed, prompts=prompts, max_staleness=max_staleness,
                       budget_s=budget_s, admission=admission, trainer_ranks=trainer_ranks) as workers:
        sampler = asyncio.create_task(workers.sample(stop))
        try:
            await workers.start_run(roles)
            producer = asyncio.create_task(workers.stop_producer_at_quota())
            try:
                await body(workers, report)
                await producer
            finally:
                producer.cancel()
            report.check("every rollout reached an outcome in time", await workers.drain(timeout_s=240))
        except Exception as exc:  # a scenario that breaks is a failed row, not a crashed suite
            report.check("the scenario ran to its end", False)
            report.notes.append(f"{type(exc).__name__}: {str(exc)[:600]}")
        finally:
            stop.set()
            await sampler
        await workers.finish(report)
    report.wall_s = round(time.monotonic() - began, 2)
    return report.finish()


async def rollout_kill(rig: ChaosRig, *, seed: int = 0, quick: bool = False) -> ScenarioReport:
    async def body(w: Workers, report: ScenarioReport) -> None:
        await w.wait_until("rollout-a at work", lambda: _produced_by(w, "rollout-a", at_least=8), timeout_s=240)
        killed_at, killed_wall = time.monotonic(), time.time()
        w.signal("rollout-a", signal.SIGKILL)
        report.check("rollout-a died of the SIGKILL", await w.wait("rollout-a", 10) == -signal.SIGKILL)
        orphans = await _unplayed(w)  # rollout-a held every partition: all of these were its
        report.faults.append(f"SIGKILL rollout-a, the only rollout worker, with {len(orphans)} prompt(s) unplayed")
        report.check("the killed worker left prompts behind", bool(orphans))
        w.start("rollout-b")
        report.faults.append("start rollout-b")
        unplayed = orphans
        ids = [f"{pid}/{i}" for pid, size in unplayed.items() for i in range(size)]
        await w.wait_until("the prompts unplayed at the kill resolved", lambda: _resolved(w, ids), 240)
        report.recovery_s = round(time.monotonic() - killed_at, 2)
        report.notes.append("recovery = kill → every prompt unplayed at the kill has all its rollouts resolved "
                            "(includes the group's session timeout)")
        after = {r.prompt_id for r in await _rollouts(w) if r.worker_id == "rollout-b" and r.created_at > killed_wall}
        report.check("rollout-b played every prompt rollout-a left behind", set(orphans) <= after)
        report.extra.update(unplayed_at_kill=len(unplayed), left_by_killed_worker=len(orphans))

    return await _scenario(rig, "rollout_kill", seed=seed, prompts=16 if quick else 32, body=body,
                           roles=("trainer", "reward", "rollout-a", "prompts"), budget_s=_budget(quick))


async def trainer_kill(rig: ChaosRig, *, seed: int = 0, quick: bool = False) -> ScenarioReport:
    rng = random.Random(seed)

    async def body(w: Workers, report: ScenarioReport) -> None:
        await w.wait_until("three trainer steps", lambda: len(w.recorded_steps()) >= 3, timeout_s=240)
        step_at = len(w.recorded_steps())
        await w.wait_until("the next step under way", lambda: len(w.recorded_steps()) > step_at, timeout_s=120)
        await asyncio.sleep(rng.uniform(0.0, 0.3))  # somewhere inside the following step
        killed_at = time.monotonic()
        w.signal("trainer", signal.SIGKILL)
        report.check("the trainer died of the SIGKILL", await w.wait("trainer", 10) == -signal.SIGKILL)
        recorded = [s["step"] for s in w.recorded_steps()]
        checkpoint = await asyncio.to_thread(w.checkpoint_step)
        report.faults.append(f"SIGKILL trainer after recorded step {max(recorded)} (checkpoint at step {checkpoint})")
        w.start("trainer")
        report.faults.append("restart the trainer")
        await w.wait_until("a step after the restart", lambda: _stepped(w, max(recorded)), timeout_s=180)
        report.recovery_s = round(time.monotonic() - killed_at, 2)
        report.notes.append("recovery = kill → the restarted trainer's first recorded step (includes its start-up)")
        report.extra.update(checkpoint_step_at_kill=checkpoint, recorded_step_at_kill=max(recorded))
        await _effect(report, w)

    # 400 s when quick: the test allows 480 (the restarted trainer's graceful stop and the audit come after)
    return await _scenario(rig, "trainer_kill", seed=seed, prompts=16 if quick else 32, body=body,
                           budget_s=400.0 if quick else 900.0)


def rank_pids(w: Workers, name: str = "trainer") -> dict[int, int]:
    """The pid of each rank under the torchrun process ``name``: its direct children running rlbus, by the
    RANK torchrun gives each."""
    import psutil

    pids = {}
    for child in psutil.Process(w.procs[name].pid).children():
        try:
            rank, command = child.environ().get("RANK"), child.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None and "rlbus" in command:
            pids[int(rank)] = child.pid
    return pids


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_at_publish(w: Workers, pid: int, timeout_s: float) -> tuple[int, bool] | None:
    """SIGKILL ``pid`` the moment the trainer starts publishing a new version — its directory appears in
    the blob store, before its chunks, manifests and announcement are all written — polling every 2 ms.
    Returns (that version, whether its delta manifest was written by then), or None if none started.
    Blocking: run it in a thread."""
    root = w.root / "blobs" / "policy"

    def newest() -> int:
        return max((int(p.name) for p in root.iterdir() if p.name.isdigit()), default=0) if root.is_dir() else 0

    before, deadline = newest(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (version := newest()) > before:
            os.kill(pid, signal.SIGKILL)
            return version, (root / f"{version:010d}" / "manifest.delta").is_file()
        time.sleep(0.002)
    return None


async def trainer_rank_kill(rig: ChaosRig, *, seed: int = 0, quick: bool = False, ranks: int = 2,
                            kill_rank: int = 1, at_publish: bool = False) -> ScenarioReport:
    """The trainer on ``ranks`` ranks under torchrun (as `rlbus up` starts it for ``[trainer] world_size``):
    rank ``kill_rank`` SIGKILLed inside a step, after the producer has admitted all its prompts. torchrun
    must stop the whole trainer — the other ranks too, since a step cannot finish without every rank — and
    the trainer started again (torchrun, the same ranks) restores its newest checkpoint (DCP shards) and
    trains on. The ledger audit and the model-versus-ledger count then show nothing trained twice and
    nothing lost, exactly as for a one-process trainer (`trainer_kill`). ``at_publish``: the kill lands the
    moment a new version's publish begins (`_kill_at_publish`) instead of at a seeded moment of a step; the
    restarted trainer then publishes above the newest version announced, so no worker ever sees a version
    number twice or a half-written one. Not in `rlbus_tools.chaos.scenarios`
    (the bench's fixed list): tests/integration/test_trainer_rank_kill.py runs it on the suite's Kafka."""
    rng = random.Random(seed)

    async def body(w: Workers, report: ScenarioReport) -> None:
        await w.wait_until("the producer done admitting", lambda: not w.alive("prompts"), timeout_s=240)
        await w.wait_until("two trainer steps", lambda: len(w.recorded_steps()) >= 2, timeout_s=240)
        step_at = len(w.recorded_steps())
        await w.wait_until("the next step under way", lambda: len(w.recorded_steps()) > step_at, timeout_s=120)
        await asyncio.sleep(rng.uniform(0.0, 0.3))  # somewhere inside the following step
        pids = rank_pids(w)
        report.check(f"torchrun runs {ranks} ranks", sorted(pids) == list(range(ranks)))
        killed_at = time.monotonic()
        if at_publish:
            hit = await asyncio.to_thread(_kill_at_publish, w, pids[kill_rank], 60.0)
            report.check("the kill landed inside a publish", hit is not None)
            if hit is None:
                return
            report.extra.update(killed_publishing_version=hit[0], its_delta_manifest_written=hit[1])
        else:
            os.kill(pids[kill_rank], signal.SIGKILL)
        rc = await w.wait("trainer", 90)
        report.extra["torchrun_exit_after_kill"] = rc
        report.extra["trainer_down_s"] = round(time.monotonic() - killed_at, 2)
        report.check(f"torchrun stopped the trainer after rank {kill_rank} died (non-zero exit)", rc not in (None, 0))
        report.check("no rank of the trainer is left running", all(_gone(pid) for pid in pids.values()))
        if at_publish and hit is not None:  # did the dead trainer announce the version it was publishing?
            before = {WEIGHTS.decode(r.raw).version for r in await w.records(WEIGHTS.name)}
            report.extra["killed_version_announced"] = hit[0] in before
        recorded = [s["step"] for s in w.recorded_steps()]
        checkpoint = await asyncio.to_thread(w.checkpoint_step)
        report.faults.append(f"SIGKILL trainer rank {kill_rank} of {ranks}{' publishing' if at_publish else ''} after "
                             f"recorded step {max(recorded)} (checkpoint at step {checkpoint})")
        w.start("trainer")
        report.faults.append(f"restart the trainer on {ranks} ranks")
        await w.wait_until("a step after the restart (or all work trained)",
                           lambda: _stepped_or_done(w, max(recorded)), timeout_s=180)
        report.recovery_s = round(time.monotonic() - killed_at, 2)
        report.notes.append("recovery = kill → the restarted trainer's first recorded step (includes its start-up)")
        report.extra.update(checkpoint_step_at_kill=checkpoint, recorded_step_at_kill=max(recorded))
        await _effect(report, w, stop_exits=(0, 1))
        manifests = [WEIGHTS.decode(r.raw) for r in await w.records(WEIGHTS.name)]
        announced = [(m.version, m.kind) for m in manifests]  # a keyframe version is announced as both kinds
        report.extra["versions_announced"] = [v for v, _ in announced]
        report.check("versions announced, none twice, none going backwards",
                     bool(announced) and len(set(announced)) == len(announced)
                     and [v for v, _ in announced] == sorted(v for v, _ in announced))

    name = f"trainer_rank{kill_rank}_kill{'_publishing' if at_publish else ''}"
    return await _scenario(rig, name, seed=seed, prompts=12 if quick else 32, body=body,
                           budget_s=_budget(quick), trainer_ranks=ranks)


async def worker_lag(rig: ChaosRig, *, seed: int = 0, quick: bool = False) -> ScenarioReport:
    """One rollout worker's weight sync frozen for longer than ``max_staleness`` versions while it keeps
    generating, then thawed: its rollouts arrive too stale and are dropped, their groups free their
    admission slots, and training goes on (the run admits and trains every prompt). Admission counts from
    the published version here, as the embedded demo's does: counting from the served one, the lagging
    worker would hold admission back instead (rlbus/producers/prompts.py) and nothing would go stale."""
    from rlbus.blobs.http import BlobServer, serve

    staleness = 1

    async def body(w: Workers, report: ScenarioReport) -> None:
        secret = uuid.uuid4().hex
        store = StallingStore(w.root / "blobs")
        port = free_port()
        runner = await serve(BlobServer(store, secret=secret), "127.0.0.1", port)
        try:
            w.start("rollout-b", env={"RLBUS_BLOB_URL": f"http://127.0.0.1:{port}", "RLBUS_BLOB_SECRET": secret})
            await w.wait_until("rollout-b at work", lambda: _produced_by(w, "rollout-b", at_least=4), timeout_s=240)
            store.open.clear()
            frozen_at, v0 = time.monotonic(), await w.state.get_counter(VERSION_COUNTER)
            report.faults.append(f"rollout-b's blob store stalls at trainer v{v0}")
            await w.wait_until(f"the trainer more than {staleness} versions past v{v0}",
                               lambda: _version_past(w, v0 + staleness + 1), timeout_s=240)
            await w.wait_until("rollout-b's stale rollouts dropped", lambda: _dropped_stale(w), timeout_s=240)
            v1 = await w.state.get_counter(VERSION_COUNTER)
            store.open.set()
            report.faults.append(f"rollout-b's blob store back after {time.monotonic() - frozen_at:.1f} s, "
                                 f"trainer at v{v1}")
            # The run may already be over when the thaw comes (rollout-a trained what rollout-b dropped):
            # then every prompt has its outcome and there is no next version to wait for.
            await w.wait_until("training goes on after the thaw, or every rollout has an outcome",
                               lambda: _moved_on(w, v1 + 1), timeout_s=240)
            report.recovery_s = round(time.monotonic() - frozen_at, 2)
            freed = await w.state.get_counter(GROUPS_FREED_COUNTER)
            stale = (await w.join.counts()).get(Outcome.STALE.value, 0)
            report.check("the trainer moved on past rollout-b's staleness bound", v1 > v0 + staleness)
            report.check("rollout-b's stale rollouts were dropped and freed their slots", stale > 0 and freed > 0)
            report.extra.update(frozen_at_version=v0, thawed_at_version=v1, dropped_stale=stale,
                                groups_freed=freed, stalled_reads=store.stalled_reads)
        finally:
            store.open.set()
            await runner.cleanup()

    # 32 prompts even when quick: rollout-b starts late (a second model load on a busy machine), and the
    # freeze, the staleness bound and the drops all have to happen while prompts are still left to play.
    return await _scenario(rig, "worker_lag", seed=seed, prompts=32 if quick else 48, body=body,
                           max_staleness=staleness, admission="published",
                           roles=("trainer", "reward", "rollout-a", "prompts"), budget_s=_budget(quick))


async def _version_past(w: Workers, version: int) -> bool:
    return await w.state.get_counter(VERSION_COUNTER) >= version


async def _moved_on(w: Workers, version: int) -> bool:
    """The trainer reached ``version``, or the run has nothing left to train: every prompt admitted and
    each of their rollouts given an outcome."""
    if await _version_past(w, version):
        return True
    return await w.admitted() >= w.prompts and await w.outcomes() >= await w.expected()


async def _dropped_stale(w: Workers) -> bool:
    return (await w.join.counts()).get(Outcome.STALE.value, 0) > 0


async def _effect(report: ScenarioReport, w: Workers, stop_exits: tuple[int, ...] = (0,)) -> None:
    """Compare what the model holds with what the ledger says, once every rollout has an outcome: the
    trainer stops gracefully (a checkpoint, and its held rollouts settled), and the checkpoint's count of
    rollouts in the model's updates must equal the ledger's "trained" count — more means an update applied
    twice, fewer an update the ledger counts but the model lost. ``stop_exits``: the trainer's exit statuses
    after that SIGTERM (torchrun may report the signal with 1 once its ranks have drained and exited 0)."""
    if not report.check("every rollout reached an outcome before the final check", await w.drain(timeout_s=240)):
        return
    w.signal("trainer", signal.SIGTERM)
    stopped = await w.wait("trainer", 60)
    report.extra["trainer_exit_after_sigterm"] = stopped
    if report.check("the restarted trainer stopped cleanly", stopped in stop_exits) and stopped:
        w.explained["trainer"] = stopped
    saved = await asyncio.to_thread(w.checkpoint_state)
    in_model = 0 if saved is None else saved.rollouts_trained
    in_ledger = (await w.join.counts())[Outcome.TRAINED.value]
    rolled_back = await w.state.get_counter(ROLLED_BACK)
    report.extra.update(rollouts_in_model=in_model, rollouts_trained_in_ledger=in_ledger,
                        rolled_back_after_kill=rolled_back)
    if in_model > in_ledger:
        report.duplicates_trained += in_model - in_ledger
        report.notes.append(f"the model holds {in_model - in_ledger} rollout update(s) more than the ledger")
    if in_model < in_ledger:
        report.lost += in_ledger - in_model
        report.notes.append(f"{in_ledger - in_model} rollouts the ledger calls trained are not in the model")
    if rolled_back:
        report.notes.append(f"{rolled_back} rollouts trained after the last checkpoint were trained again")
    report.check("the model holds exactly the rollouts the ledger calls trained", in_model == in_ledger)


async def graceful_stop(rig: ChaosRig, *, seed: int = 0, quick: bool = False) -> ScenarioReport:
    async def body(w: Workers, report: ScenarioReport) -> None:
        for attempt in range(3):  # an idle worker may finish draining before the second signal lands
            w.start("rollout-c")
            await w.wait_until("rollout-c at work", lambda: _produced_by(w, "rollout-c"), timeout_s=240)
            await w.wait_until("prompts waiting to be played", lambda: _unplayed(w), timeout_s=120)
            w.signal("rollout-c", signal.SIGTERM)
            # 5 ms: on a fast machine a worker with little in play drained and exited within 50 ms, three
            # attempts in a row, before the second signal came (the signal watcher acts on it at once).
            await asyncio.sleep(0.005)
            second = time.monotonic()
            w.signal("rollout-c", signal.SIGTERM)
            rc = await w.wait("rollout-c", 10)
            report.faults.append(f"SIGTERM rollout-c twice, 5 ms apart (exit {rc})")
            if rc not in (0, -signal.SIGTERM):
                break
            report.notes.append(f"attempt {attempt + 1}: rollout-c had drained before the second SIGTERM")
        report.check("two SIGTERMs: rollout-c exited at once with 143", rc == 128 + signal.SIGTERM)
        report.extra["second_sigterm_exit_s"] = round(time.monotonic() - second, 2)

        await w.wait_until("a third of the work", lambda: _fraction(w, 0.33), timeout_s=240)
        await w.wait_until("prompts waiting to be played", lambda: _unplayed(w), timeout_s=120)
        began, signalled_wall = time.monotonic(), time.time()
        w.signal("rollout-a", signal.SIGTERM)
        report.faults.append("SIGTERM rollout-a (once)")
        rc = await w.wait("rollout-a", 60)
        drain_s, exited_wall = time.monotonic() - began, time.time()
        report.check("one SIGTERM: rollout-a drained and exited 0", rc == 0)
        report.extra["rollout_drain_s"] = round(drain_s, 2)
        report.recovery_s = round(drain_s, 2)
        report.notes.append("recovery = first SIGTERM → rollout-a exited after draining")

        # The trainer is stopped right away, while work is left: waiting for one more step first let a fast
        # machine (rollouts ~1.5x faster since continuous batching) train all the work before the SIGTERM, and
        # the restarted trainer then had no step left to take.
        await w.wait_until("a trainer step", lambda: bool(w.recorded_steps()), timeout_s=120)
        w.signal("trainer", signal.SIGTERM)
        report.faults.append("SIGTERM trainer (once), then restart it")
        report.check("one SIGTERM: the trainer checkpointed and exited 0", await w.wait("trainer", 60) == 0)
        steps = [s["step"] for s in w.recorded_steps()]
        checkpoint = await asyncio.to_thread(w.checkpoint_step)
        report.check("the trainer's checkpoint is its last recorded step", checkpoint == max(steps))
        report.extra.update(checkpoint_step=checkpoint, recorded_step=max(steps))
        w.start("trainer")
        # A slow machine can still have had every rollout trained before the SIGTERM landed (the trainer
        # checkpoints it all on the way out): then no step can follow, and the audit below is what checks it.
        await w.wait_until("a step after the restart (or all work trained)",
                           lambda: _stepped_or_done(w, max(steps)), timeout_s=180)
        if not _stepped(w, max(steps)):
            report.notes.append("every rollout was trained before the trainer's SIGTERM: no step left after it")
        rollouts = await _rollouts(w)
        from_a = {r.rollout_id for r in rollouts if r.worker_id == "rollout-a"}
        again = [r.rollout_id for r in rollouts if r.rollout_id in from_a and r.created_at > exited_wall]
        report.check("nothing rollout-a finished was played again after it left", not again)
        report.extra["rollouts_a_finished_after_sigterm"] = sum(
            1 for r in rollouts if r.worker_id == "rollout-a" and r.created_at > signalled_wall
        )

    # 32 prompts even when quick: with 24, the faster rollouts of the continuous-batching engine could finish
    # the work before the trainer's SIGTERM, leaving the restarted trainer no step to take
    report = await _scenario(rig, "graceful_stop", seed=seed, prompts=32 if quick else 40, body=body, max_staleness=3,
                             budget_s=_budget(quick))
    report.notes.append("copies on the log (extra.log_copies) are prompts redelivered after rollout-c's hard "
                        "exit and after rebalances; the join keeps one copy of each")
    return report


def _budget(quick: bool) -> float:
    """A scenario's time for its waits: inside the suite's default 300 s test timeout when quick (its runs
    take 30-70 s on two cores), with room for the audit and the workers' stop."""
    return 240.0 if quick else 900.0


async def _fraction(w: Workers, fraction: float) -> bool:
    total = await w.expected()
    return total > 0 and await w.outcomes() >= fraction * max(total, w.prompts * 4)


def _stepped(w: Workers, after: int) -> bool:
    return any(s["step"] > after for s in w.recorded_steps())


async def _stepped_or_done(w: Workers, after: int) -> bool:
    return _stepped(w, after) or await _fraction(w, 1.0)


async def _rollouts(w: Workers) -> list[Rollout]:
    return [r for r in await w.records(ROLLOUTS.name) if isinstance(r, Rollout)]


async def _produced_by(w: Workers, worker: str, at_least: int = 1) -> bool:
    return sum(r.worker_id == worker for r in await _rollouts(w)) >= at_least


async def _unplayed(w: Workers) -> dict[str, int]:
    """Prompts admitted whose group is not yet complete on the rollouts topic (prompt id → group size)."""
    prompts = {p.prompt_id: p.group_size for p in await w.records(PROMPTS.name) if hasattr(p, "group_size")}
    have: dict[str, set[int]] = {}
    for r in await _rollouts(w):
        have.setdefault(r.prompt_id, set()).add(r.group_index)
    return {pid: size for pid, size in prompts.items() if len(have.get(pid, ())) < size}


async def _resolved(w: Workers, rollout_ids: list[str]) -> bool:
    for rollout_id in rollout_ids:
        if not await w.join.outcome_of(rollout_id):
            return False
    return True
