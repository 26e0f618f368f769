"""``rlbus bench compose`` (``make compose-test``): the whole loop in containers, built from nothing, timed
and checked. CI runs it; it fails (exit 1) when a check does not hold.

1. **Images** (`infra/images/build.sh`): every image from Debian's packages, PyPI and Maven Central, then the
   rlbus image again from a copy of its context with one line of code changed: what a code change costs
   when only the last layers rebuild.
2. **The loop** on one broker (docker-compose.yml, a project of its own, Kafka and Redis published on free
   loopback ports): time from ``docker compose up`` to the trainer's first step (its run log in the ``runs``
   volume); ``--scale rollout=3`` while it trains, and the time until the new workers hold the version the
   trainer had published when they were asked for; the producer stopped, the rest drained and stopped (the
   trainer checkpoints), and the ledger audit from the host (`rlbus_tools.chaos.ledger.audit`): every rollout the
   prompts asked for has exactly one outcome or is still held in the join's store (a group short of a whole
   batch when the trainer stopped, which a trainer started within the join's expiry trains), none is lost,
   none trained twice; ``docker compose run --rm topics rlbus replay`` of the prompts topic from the compose
   broker (as many records as the audit read); held-out accuracy (``rlbus eval``, in a
   container) where RL started and at the trainer's last checkpoint.
3. **The cluster** (docker-compose.cluster.yml over it: three brokers, RF 3, min ISR 2): one broker
   ``docker compose kill``-ed while the loop trains, training goes on, the broker is started again, then
   the same drain and audit.
4. **Least privilege** (docker-compose.secure.yml over it: TLS, a SCRAM user, Redis user and blob key per role,
   ACLs): time to the first step with security on; ``rlbus secrets probe`` in the rollout, reward, prompts and
   trainer containers (each tries, with its own credentials, what its role may not: `rlbus.security.probe`) and
   from the host against the published ports (PLAINTEXT Kafka, plain Redis); every attempt must be refused.
   Then the same drain and audit, from the host as the operator (its credentials read out of its volume).

Every project is removed with its volumes at the end (``down -v``), also when a phase fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.errors import RlbusError
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, require, write_json

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = ROOT / "docker-compose.yml"
CLUSTER_FILE = ROOT / "docker-compose.cluster.yml"
SECURE_FILE = ROOT / "docker-compose.secure.yml"
BUILD = ROOT / "infra/images/build.sh"
RUN_CONFIG = ROOT / "infra/rlbus/run.toml"
#: Seconds between polls of the run log and the registry.
POLL_S = 3.0


@dataclass(frozen=True)
class Plan:
    #: Trainer steps the one-broker loop runs before the producer is stopped.
    steps: int
    #: Steps the cluster trains after one broker is killed (and before it is started again).
    steps_after_kill: int
    #: Bound on each wait (first step, scaling, the target step, the drain).
    deadline_s: float
    #: Steps the secure loop trains before the probes.
    secure_steps: int = 3


QUICK = Plan(steps=25, steps_after_kill=3, deadline_s=600.0)
FULL = Plan(steps=60, steps_after_kill=10, deadline_s=1500.0, secure_steps=10)
#: The services whose containers probe their own credentials (the gateway is a profile the bench leaves off).
PROBED = ("rollout", "reward", "prompts", "trainer")


def _run_paths() -> tuple[str, str]:
    """The run log and checkpoint directories inside the containers (from the mounted run config)."""
    with RUN_CONFIG.open("rb") as f:
        tables = tomllib.load(f)
    return tables["run"]["run_dir"], tables["trainer"]["checkpoint_dir"]


def compose_command() -> list[str]:
    """``docker compose`` where the client has the plugin, else Debian's ``docker-compose``."""
    if shutil.which("docker") is None:
        raise RlbusError("no docker client: infra/install-deps.sh infra/images/system-packages.txt")
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RlbusError("the docker client has no compose: install the compose plugin or Debian's docker-compose")


def _free_port() -> int:
    from rlbus_tools.services import free_port

    return free_port()


@dataclass
class Project:
    """One compose project (its own containers, network and volumes) on free loopback ports."""

    name: str
    files: Sequence[Path]
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.command = compose_command()
        self.kafka_port = _free_port()
        self.redis_port = _free_port()
        self.env = {**os.environ, "RLBUS_COMPOSE_KAFKA_PORT": str(self.kafka_port),
                    "RLBUS_COMPOSE_REDIS_PORT": str(self.redis_port),
                    "RLBUS_COMPOSE_KAFKA_PORT_2": str(_free_port()), "RLBUS_COMPOSE_KAFKA_PORT_3": str(_free_port()),
                    **self.env}
        self.env.pop("COMPOSE_PROFILES", None)

    def __call__(self, *args: str, timeout_s: float = 600.0, check: bool = True) -> str:
        argv = [*self.command, "-p", self.name, *(a for f in self.files for a in ("-f", str(f))), *args]
        done = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout_s, check=False,
                              cwd=ROOT)
        if check and done.returncode != 0:
            raise RlbusError(f"{' '.join(argv[len(self.command):])} failed ({done.returncode}):\n"
                             f"{(done.stdout + done.stderr)[-3000:]}")
        return done.stdout

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service).split()

    def read(self, service: str, path: str) -> str:
        """A file inside the service's (first) container; "" when it or the container is missing."""
        ids = self.containers(service)
        if not ids:
            return ""
        done = subprocess.run(["docker", "exec", ids[0], "cat", path], capture_output=True, text=True, check=False)
        return done.stdout if done.returncode == 0 else ""

    def logs(self, *services: str, tail: int = 40) -> str:
        return self("logs", "--no-color", f"--tail={tail}", *services, check=False)

    def down(self) -> None:
        self("down", "-v", "--remove-orphans", "-t", "30", check=False)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"


# --- phase 1: images ------------------------------------------------------------------------------------------
def build_images(log: Callable[[str], None]) -> dict[str, Any]:
    """Build every image; then the rlbus image from a copy of its context with one line changed."""
    had = subprocess.run(["docker", "image", "inspect", "rlbus/rlbus:dev"], capture_output=True,
                         check=False).returncode == 0
    started = time.monotonic()
    _build([], log)
    build_s = time.monotonic() - started
    with tempfile.TemporaryDirectory(prefix="rlbus-context-") as tmp:
        context = Path(tmp)
        for name in ("pyproject.toml", "README.md", ".dockerignore", "Dockerfile"):
            shutil.copy2(ROOT / name, context / name)
        shutil.copytree(ROOT / "rlbus", context / "rlbus", ignore=shutil.ignore_patterns("__pycache__"))
        with (context / "rlbus/__init__.py").open("a") as f:
            f.write(f"# a one-line change: rlbus bench compose, {time.time():.0f}\n")
        started = time.monotonic()
        _build(["rlbus", "--context", str(context), "--tag", "rlbus/rlbus:probe"], log)
        rebuild_s = time.monotonic() - started
    subprocess.run(["docker", "image", "rm", "rlbus/rlbus:probe"], capture_output=True, check=False)
    return {"cold": not had, "build_s": build_s, "rebuild_after_code_change_s": rebuild_s}


def _build(args: list[str], log: Callable[[str], None]) -> None:
    done = subprocess.run([str(BUILD), *args], capture_output=True, text=True, check=False, cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("image "):
            log(line)
    if done.returncode != 0:
        raise RlbusError(f"infra/images/build.sh {' '.join(args)} failed:\n{(done.stdout + done.stderr)[-3000:]}")


# --- what the run shows -------------------------------------------------------------------------------------
def steps_of(project: Project, run_dir: str) -> list[dict[str, Any]]:
    lines = project.read("trainer", f"{run_dir}/steps.jsonl").splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line
    return out


async def until(what: str, condition: Callable[[], Awaitable[Any]], deadline_s: float,
                project: Project, services: Sequence[str] = ("trainer",)) -> Any:
    """Poll ``condition`` until it returns something truthy; a timeout names ``what`` and shows the logs."""
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        found = await condition()
        if found:
            return found
        await asyncio.sleep(POLL_S)
    raise RlbusError(f"timed out after {deadline_s:.0f} s waiting for {what}; logs:\n{project.logs(*services)[-4000:]}")


class Observer:
    """The compose run's Kafka and Redis, from the host (the published loopback ports)."""

    def __init__(self, project: Project, operator: Path | None = None) -> None:
        """``operator``: a directory with the operator's credentials (`operator_credentials`), for a secure
        project; the published ports then speak SASL_SSL and rediss."""
        from rlbus.bus.kafka import KafkaBus, KafkaSettings
        from rlbus.state.redis import RedisStateStore
        from rlbus.training.join import JoinBuffer, RewardPolicy

        security: dict[str, Any] = {}
        redis_url = project.redis_url
        if operator is not None:
            bus = tomllib.loads((operator / "bus.toml").read_text())["bus"]
            security = {"security_protocol": "SASL_SSL", "sasl_mechanism": bus["sasl_mechanism"],
                        "sasl_username": bus["sasl_username"], "ssl_cafile": str(operator / "ca.pem"),
                        "sasl_password": (operator / "kafka.password").read_text().strip()}
            url = (operator / "redis.url").read_text().strip()
            redis_url = (url.replace("@redis:6379/", f"@127.0.0.1:{project.redis_port}/")
                         .replace("/run/secrets/rlbus/ca.pem", str(operator / "ca.pem")))
        self.bus = KafkaBus(KafkaSettings(bootstrap=project.bootstrap, client_id="rlbus-bench-compose",
                                          request_timeout_ms=15_000, **security))
        self.state = RedisStateStore.from_url(redis_url, reconnect=True)
        self.join = JoinBuffer(state=self.state, policy=RewardPolicy())

    async def __aenter__(self) -> Observer:
        await self.bus.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.bus.close()
        await self.state.close()

    async def published(self) -> int:
        from rlbus.state.progress import VERSION_COUNTER

        return await self.state.get_counter(VERSION_COUNTER)

    async def rollout_workers(self) -> dict[str, int]:
        """Live rollout workers and the policy version each holds."""
        return {w["worker_id"]: int(w["info"].get("version") or 0) for w in await self.state.workers("rollout")}

    async def expected(self) -> set[str]:
        """Every rollout id the prompts on the log ask for (``<prompt_id>/<i>``)."""
        from rlbus.bus.topics import PROMPTS
        from rlbus_tools.chaos.ledger import read_topic

        prompts = [p for p in await read_topic(self.bus, PROMPTS.name) if hasattr(p, "group_size")]
        return {f"{p.prompt_id}/{i}" for p in prompts for i in range(p.group_size)}

    async def produced(self) -> set[str]:
        from rlbus.bus.topics import ROLLOUTS
        from rlbus_tools.chaos.ledger import read_topic

        return {r.rollout_id for r in await read_topic(self.bus, ROLLOUTS.name) if hasattr(r, "rollout_id")}

    async def held(self, rollout_id: str) -> bool:
        """Whether the join still holds ``rollout_id`` in the store: its group complete but short of a whole
        batch when the trainer stopped (the ordered join keeps a released group until each rollout has an
        outcome), or still waiting for a reward. A trainer started within the join's expiry (four join
        timeouts) takes it up."""
        prompt_id = rollout_id.rsplit("/", 1)[0]
        names = await self.state.field_names(self.join._group_key(prompt_id))
        return any(rollout_id in name for name in names)

    async def audit(self) -> dict[str, Any]:
        """The ledger audit (`rlbus_tools.chaos.ledger.audit`) after the workers stopped, with the rollouts that
        have no outcome split into ``held`` (still in the join's store, see :meth:`held`) and ``lost``."""
        from rlbus_tools.chaos.ledger import audit

        found = await audit(bus=self.bus, state=self.state, join=self.join, run_id=None)
        held = [rid for rid in found.lost if await self.held(rid)]
        lost = [rid for rid in found.lost if rid not in set(held)]
        return {
            "prompts": len({rid.rsplit("/", 1)[0] for rid in await self.expected()}),
            "rollouts_expected": found.expected, "rollouts_produced": found.produced, "outcomes": found.outcomes,
            "rollouts_trained": found.outcomes.get("trained", 0), "held": len(held), "lost": len(lost),
            "lost_ids": lost[:5], "multiple_outcomes": len(found.multiple_outcomes),
            "duplicates_trained": found.trained_again, "log_copies": found.log_copies,
        }


async def drain(project: Project, observer: Observer, run_dir: str, deadline_s: float,
                log: Callable[[str], None]) -> float:
    """Stop the producer (SIGTERM: it drains), then wait until the loop is quiet: every rollout its prompts
    asked for is on the log and the trainer has taken no step for four polls in a row. What the trainer
    could not take then (groups short of a whole batch) stays in the join's store. Returns the seconds."""
    started = time.monotonic()
    project("stop", "-t", "60", "prompts")
    expected = await observer.expected()
    log(f"producer stopped: {len(expected)} rollouts asked for; draining")
    last: tuple[int, int] | None = None
    quiet = 0

    async def settled() -> bool:
        nonlocal last, quiet
        steps = steps_of(project, run_dir)
        now = (len(expected & await observer.produced()), steps[-1]["step"] if steps else 0)
        quiet = quiet + 1 if now == last and now[0] == len(expected) else 0
        last = now
        return quiet >= 4

    await until(f"all {len(expected)} rollouts on the log and the trainer idle", settled, deadline_s, project,
                ("trainer", "reward", "rollout"))
    return time.monotonic() - started


def evaluate(project: Project, *args: str) -> dict[str, Any]:
    """``rlbus eval`` in a one-off trainer container (its run config, the ``runs`` volume)."""
    out = project("run", "--rm", "--no-deps", "-T", "trainer", "rlbus", "eval", "--json", *args, timeout_s=900)
    return json.loads(out.strip().splitlines()[-1])


# --- phase 2: the loop on one broker ----------------------------------------------------------------------------
@contextlib.contextmanager
def running(project: Project, log: Callable[[str], None]) -> Iterator[float]:
    """``docker compose up -d`` (yields the time it started); on the way out the project goes with its volumes,
    and a failure first prints the end of every service's log, where an operator looks first."""
    started = time.time()
    try:
        project("up", "-d")
        yield started
    except BaseException:
        log(f"failed; the end of the services' logs:\n{project.logs(tail=30)[-8000:]}")
        raise
    finally:
        project.down()


async def wind_down(project: Project, observer: Observer, run_dir: str, plan: Plan,
                    log: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Drain (see `drain`), read the trainer's steps while its container runs, stop the workers (the trainer
    checkpoints and settles), then audit: (steps, figures)."""
    drain_s = await drain(project, observer, run_dir, plan.deadline_s, log)
    steps = steps_of(project, run_dir)
    project("stop", "-t", "90", "trainer", "rollout", "rollout-us", "reward")
    return steps, {"drain_s": drain_s, **await observer.audit()}


async def run_loop(plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    run_dir, checkpoints = _run_paths()
    project = Project(f"rlbus-bench-{os.getpid()}", [COMPOSE_FILE])
    figures: dict[str, Any] = {"project": project.name}
    with running(project, log) as started:
        log(f"docker compose up -d: {project.name}, Kafka at {project.bootstrap}, Redis at {project.redis_url}")

        async def first_step() -> list[dict[str, Any]]:
            return steps_of(project, run_dir)

        steps = await until("the trainer's first step", first_step, plan.deadline_s, project)
        figures["first_step_s"] = steps[0]["t"] - started
        log(f"first trained step {figures['first_step_s']:.0f} s after docker compose up")

        async with Observer(project) as observer:
            figures |= await scale(project, observer, plan, log)

            async def target() -> bool:
                found = steps_of(project, run_dir)
                return bool(found) and found[-1]["step"] >= plan.steps

            await until(f"trainer step {plan.steps}", target, plan.deadline_s, project)
            steps, audited = await wind_down(project, observer, run_dir, plan, log)
        figures |= audited
        figures["relay_fetches"] = relay_fetches(project)
        log(f"regional relays fetched from the origin: {figures['relay_fetches']}")
        figures["replayed"] = replay_count(project)
        figures["steps"] = steps[-1]["step"] if steps else 0
        figures["train_s"] = (steps[-1]["t"] - steps[0]["t"]) if steps else 0.0
        before = evaluate(project)
        after = evaluate(project, "--checkpoint", checkpoints)
        figures |= {"accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
                    "checkpoint_step": after["step"], "eval_prompts": after["prompts"]}
        log(f"held-out accuracy {before['accuracy']:.0%} where RL started, {after['accuracy']:.0%} at step "
            f"{after['step']}")
    return figures


async def scale(project: Project, observer: Observer, plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    """``--scale rollout=3``: the time until both new workers hold the version published when they were asked
    for (what a region's new capacity waits for before it serves the current policy)."""

    async def registered() -> dict[str, int]:
        return await observer.rollout_workers()

    before = await until("the rollout workers in the registry", registered, plan.deadline_s, project)
    version = await observer.published()
    started = time.monotonic()
    project("up", "-d", "--no-deps", "--no-recreate", "--scale", "rollout=3", "rollout")
    log(f"scaled eu-west to 3 rollout workers at v{version}")

    async def serving() -> dict[str, int]:
        new = {w: v for w, v in (await observer.rollout_workers()).items() if w not in before}
        return new if len(new) >= 2 and min(new.values()) >= version else {}

    new = await until(f"two new rollout workers holding v{version}", serving, plan.deadline_s, project, ("rollout",))
    serving_s = time.monotonic() - started
    log(f"the new workers hold v{version} or later {serving_s:.0f} s after --scale")
    return {"scale_new_workers": len(new), "scale_version": version, "scale_serving_s": serving_s,
            "rollout_containers": len(project.containers("rollout"))}


RELAYS = ("relay-eu", "relay-us")
HEALTH = ("import urllib.request; "
          "print(urllib.request.urlopen('http://127.0.0.1:8470/healthz', timeout=5).read().decode())")


def relay_fetches(project: Project) -> dict[str, int]:
    """Blobs each region's relay fetched from the origin (its /healthz, from inside its container)."""
    fetched = {}
    for relay in RELAYS:
        out = project("exec", "-T", relay, "python3", "-c", HEALTH, check=False)
        try:
            fetched[relay] = int(json.loads(out)["upstream"]["blobs"])
        except (ValueError, KeyError, TypeError):
            fetched[relay] = 0
    return fetched


def replay_count(project: Project) -> int:
    """``rlbus replay`` of the prompts topic, in a one-off container against the compose broker."""
    from rlbus.bus.topics import PROMPTS

    script = (f"rlbus replay --topic {PROMPTS.name} --bootstrap kafka:19092 --out /tmp/prompts.jsonl >/dev/null"
              " && wc -l < /tmp/prompts.jsonl")
    out = project("run", "--rm", "--no-deps", "-T", "topics", "sh", "-c", script, timeout_s=300)
    return int(out.strip().splitlines()[-1])


# --- phase 3: the cluster, one broker killed ---------------------------------------------------------------------
async def run_cluster(plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    run_dir, _ = _run_paths()
    project = Project(f"rlbus-bench-cluster-{os.getpid()}", [COMPOSE_FILE, CLUSTER_FILE])
    figures: dict[str, Any] = {"project": project.name}
    with running(project, log) as started:
        log(f"docker compose up -d (three brokers): {project.name}")

        def steps_past(n: int) -> Callable[[], Awaitable[list[dict[str, Any]]]]:
            async def check() -> list[dict[str, Any]]:
                found = steps_of(project, run_dir)
                return found if found and found[-1]["step"] >= n else []

            return check

        steps = await until("the trainer's second step", steps_past(2), plan.deadline_s, project)
        figures["first_step_s"] = steps[0]["t"] - started
        killed_at, step_at_kill = time.time(), steps[-1]["step"]
        project("kill", "kafka-2")
        log(f"killed broker kafka-2 at trainer step {step_at_kill}")
        steps = await until(f"{plan.steps_after_kill} more steps with kafka-2 down",
                            steps_past(step_at_kill + plan.steps_after_kill), plan.deadline_s, project)
        after = [s for s in steps if s["t"] > killed_at]
        figures |= {"step_at_kill": step_at_kill, "steps_while_down": len(after),
                    "first_step_after_kill_s": after[0]["t"] - killed_at if after else None}
        project("start", "kafka-2")
        log(f"{len(after)} steps with kafka-2 down; started it again")
        async with Observer(project) as observer:
            steps, audited = await wind_down(project, observer, run_dir, plan, log)
        figures |= audited
        figures["steps"] = steps[-1]["step"] if steps else 0
    return figures


# --- phase 4: least privilege ----------------------------------------------------------------------------------
def operator_credentials(project: Project, into: Path) -> Path:
    """The operator's credentials, read out of its volume by a one-off container (as the uid they belong to)."""
    into.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in ("bus.toml", "kafka.password", "redis.url", "ca.pem"):
        done = subprocess.run(["docker", "run", "--rm", "-v", f"{project.name}_secrets-operator:/s:ro",
                               "--entrypoint", "cat", "rlbus/rlbus:dev", f"/s/{name}"],
                              capture_output=True, text=True, check=True, timeout=120)
        path = into / name
        path.touch(mode=0o600)
        path.write_text(done.stdout)
    return into


def probe_containers(project: Project, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """``rlbus secrets probe --json`` in each of :data:`PROBED`: what its own credentials may not do."""
    rows: list[dict[str, Any]] = []
    for service in PROBED:
        out = project("exec", "-T", service, "rlbus", "secrets", "probe", "--json", check=False, timeout_s=600)
        found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if not found:
            raise RlbusError(f"rlbus secrets probe in {service} printed no attempt:\n{out[-2000:]}")
        rows += [{**row, "where": service} for row in found]
        log(f"{service}: {sum(r['refused'] for r in found)}/{len(found)} attempts refused")
    return rows


async def probe_host(project: Project) -> list[dict[str, Any]]:
    """From the host, on the published loopback ports: a PLAINTEXT Kafka client and a plain Redis client."""
    from redis.asyncio import Redis

    from rlbus.bus.kafka import KafkaBus, KafkaSettings

    async def kafka_plaintext() -> None:
        async with KafkaBus(KafkaSettings(bootstrap=project.bootstrap, client_id="rlbus-bench-plaintext",
                                          request_timeout_ms=10_000)) as bus:
            await bus.list_topics()

    async def redis_plaintext() -> None:
        client = Redis.from_url(project.redis_url, socket_connect_timeout=5, socket_timeout=10)
        try:
            await client.ping()
        finally:
            await client.aclose()

    rows = []
    for what, attempt in (("PLAINTEXT Kafka client on the published port", kafka_plaintext),
                          ("plain Redis client on the published port", redis_plaintext)):
        try:
            async with asyncio.timeout(90):
                await attempt()
            refused, error = False, "allowed"
        except Exception as exc:  # any failure to get through is the refusal; the type is recorded
            refused, error = True, f"{type(exc).__name__}: {exc}"[:200]
        rows.append({"who": "the host", "what": what, "refused": refused, "error": error, "where": "host"})
    return rows


async def run_secure(plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    run_dir, _ = _run_paths()
    project = Project(f"rlbus-bench-secure-{os.getpid()}", [COMPOSE_FILE, SECURE_FILE])
    figures: dict[str, Any] = {"project": project.name}
    with running(project, log) as started, tempfile.TemporaryDirectory(prefix="rlbus-operator-") as tmp:
        log(f"docker compose up -d (secure): {project.name}")

        async def steps_done() -> list[dict[str, Any]]:
            found = steps_of(project, run_dir)
            return found if found and found[-1]["step"] >= plan.secure_steps else []

        steps = await until(f"trainer step {plan.secure_steps} with security on", steps_done, plan.deadline_s,
                            project, ("trainer", "acls", "topics", "secrets"))
        figures["first_step_s"] = steps[0]["t"] - started
        log(f"first trained step {figures['first_step_s']:.0f} s after docker compose up (TLS, SCRAM, ACLs)")
        attempts = probe_containers(project, log) + await probe_host(project)
        figures |= {"attempts": attempts, "attempts_tried": len(attempts),
                    "attempts_refused": sum(bool(a["refused"]) for a in attempts)}
        for row in attempts:
            if not row["refused"]:
                log(f"ALLOWED in {row['where']}: {row['who']} could {row['what']}")
        async with Observer(project, operator_credentials(project, Path(tmp))) as observer:
            steps, audited = await wind_down(project, observer, run_dir, plan, log)
        figures |= audited
        figures["steps"] = steps[-1]["step"] if steps else 0
    return figures


# --- the benchmark ------------------------------------------------------------------------------------------
def checks(images: dict[str, Any], loop: dict[str, Any], cluster: dict[str, Any],
           secure: dict[str, Any]) -> dict[str, bool]:
    return {
        "a code change rebuilds in under a third of the build": (
            images["rebuild_after_code_change_s"] < max(60.0, images["build_s"] / 3) if images["cold"]
            else images["rebuild_after_code_change_s"] < 120.0),
        "the loop trained": loop["steps"] >= 1 and loop["rollouts_trained"] > 0,
        "nothing lost (one broker)": loop["lost"] == 0 and loop["multiple_outcomes"] == 0,
        "nothing trained twice (one broker)": loop["duplicates_trained"] == 0,
        "held-out accuracy rose": loop["accuracy_after"] > loop["accuracy_before"],
        "two new workers joined and serve the current version": loop["scale_new_workers"] >= 2,
        "replay read every prompt": loop["replayed"] == loop["prompts"],
        "each region's workers read the weights through its relay": (
            min(loop["relay_fetches"].values(), default=0) >= 1),
        "training went on with a broker down": cluster["steps_while_down"] >= 1,
        "nothing lost (three brokers, one killed)": cluster["lost"] == 0 and cluster["multiple_outcomes"] == 0,
        "nothing trained twice (three brokers)": cluster["duplicates_trained"] == 0,
        "the loop trained with TLS, SCRAM and ACLs": secure["steps"] >= 1 and secure["rollouts_trained"] > 0,
        "every attempt the roles' credentials may not make was refused": (
            secure["attempts_tried"] >= 20 and secure["attempts_refused"] == secure["attempts_tried"]),
        "nothing lost or trained twice (secure)": (
            secure["lost"] == 0 and secure["multiple_outcomes"] == 0 and secure["duplicates_trained"] == 0),
    }


def run(*, quick: bool = False, json_path: Path | None = None) -> dict[str, Any]:
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        raise RlbusError("no Docker engine answers: start one (as root: infra/images/dockerd.sh start)")
    plan = QUICK if quick else FULL

    def log(line: str) -> None:
        print(f"[compose] {line}", flush=True)

    images = build_images(log)
    loop = asyncio.run(run_loop(plan, log))
    cluster = asyncio.run(run_cluster(plan, log))
    secure = asyncio.run(run_secure(plan, log))
    held = checks(images, loop, cluster, secure)
    summary = {
        "build_s": images["build_s"], "build_cold": images["cold"],
        "rebuild_after_code_change_s": images["rebuild_after_code_change_s"],
        "first_step_s": loop["first_step_s"], "accuracy_before": loop["accuracy_before"],
        "accuracy_after": loop["accuracy_after"], "steps": loop["steps"], "rollouts_trained": loop["rollouts_trained"],
        "held": loop["held"], "lost": loop["lost"], "duplicates_trained": loop["duplicates_trained"],
        "scale_serving_s": loop["scale_serving_s"], "replayed": loop["replayed"],
        "cluster_steps_while_down": cluster["steps_while_down"], "cluster_held": cluster["held"],
        "cluster_lost": cluster["lost"],
        "cluster_rollouts_trained": cluster["rollouts_trained"],
        "secure_first_step_s": secure["first_step_s"], "secure_rollouts_trained": secure["rollouts_trained"],
        "secure_lost": secure["lost"], "attempts_tried": secure["attempts_tried"],
        "attempts_refused": secure["attempts_refused"],
        "passed": all(held.values()),
    }
    result = {"meta": meta(), "quick": quick, "plan": plan.__dict__, "summary": summary, "checks": held,
              "images": images, "loop": loop, "cluster": cluster, "secure": secure}
    print_table("rlbus bench compose", ["figure", "value"], [
        ["images built (s)" + (" cold" if images["cold"] else ""), images["build_s"]],
        ["rebuild after a one-line code change (s)", images["rebuild_after_code_change_s"]],
        ["docker compose up → first trained step (s)", loop["first_step_s"]],
        ["trainer steps (one broker)", loop["steps"]],
        ["held-out accuracy: where RL started → last checkpoint",
         f"{loop['accuracy_before']:.0%} → {loop['accuracy_after']:.0%} (step {loop['checkpoint_step']})"],
        ["rollouts trained / held for the next trainer / lost / trained twice",
         f"{loop['rollouts_trained']} / {loop['held']} / {loop['lost']} / {loop['duplicates_trained']}"],
        ["--scale rollout=3: new workers serve the current version (s)", loop["scale_serving_s"]],
        ["rlbus replay in a container: prompts read / on the log", f"{loop['replayed']} / {loop['prompts']}"],
        ["blobs each region's relay fetched from the origin",
         ", ".join(f"{k} {v}" for k, v in loop["relay_fetches"].items())],
        ["three brokers, one killed: steps while down", cluster["steps_while_down"]],
        ["three brokers: rollouts trained / held / lost / trained twice",
         f"{cluster['rollouts_trained']} / {cluster['held']} / {cluster['lost']} / {cluster['duplicates_trained']}"],
        ["secure: docker compose up → first trained step (s)", secure["first_step_s"]],
        ["secure: attempts refused / tried", f"{secure['attempts_refused']} / {secure['attempts_tried']}"],
        ["secure: rollouts trained / held / lost / trained twice",
         f"{secure['rollouts_trained']} / {secure['held']} / {secure['lost']} / {secure['duplicates_trained']}"],
    ])
    for name, ok in held.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    write_json(json_path, result)
    return result


def main(json_path: JsonPath = None, quick: Quick = False) -> None:
    """The whole loop in containers: images built without a registry, run, scaled, a broker killed, checked."""
    result = run(quick=quick, json_path=json_path)
    require(result["summary"]["passed"], "a compose check failed (see the list above)")
