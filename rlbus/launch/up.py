"""``rlbus up``: a whole distributed run on one machine, every role its own process.

It brings up what the run needs and is missing — Kafka (a local KRaft broker, :mod:`rlbus.services.kafka`,
when the bootstrap is local and nobody answers), Redis (a throwaway ``redis-server`` when the configured
one does not answer), the run's topics, and ``rlbus blobs serve`` on the run's blob directory — then
starts the trainer, a reward worker, N rollout workers in different regions and the prompt producer as
``rlbus worker …`` child processes, and prints their output line by line, prefixed with the worker's
name in its own colour. Without a namespace in the config, each ``rlbus up`` is a fresh run of its own
(``up-<date>-<time>``).

Children run in their own sessions, so a Ctrl-C in the terminal reaches only ``rlbus up``, which then
sends each child one SIGTERM (drain, commit, exit) and SIGKILLs whatever is still running after
``grace_s``; a second Ctrl-C kills them at once. ``--steps N`` stops the same way once the trainer's run
log shows step N. A child that exits on its own stops the rest. Kafka is left running (``rlbus kafka
stop``); Redis and the blob server started here are stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from rich.console import Console
from rich.text import Text

from rlbus.aio import wait_event
from rlbus.errors import ConfigError, ServiceError
from rlbus.launch.config import (
    ENV_BLOB_FALLBACK_URL,
    ENV_BLOB_SECRET,
    ENV_BLOB_URL,
    ENV_BOOTSTRAP,
    ENV_NAMESPACE,
    ENV_REDIS,
    ENV_RUN_DIR,
    RunConfig,
    load_config,
)
from rlbus.launch.signals import GracefulStop

REGIONS = ("eu-west", "us-east", "ap-south", "sa-east")
COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class Child:
    """One supervised process: its name (the log prefix), command line and environment."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    process: asyncio.subprocess.Process | None = None
    returncode: int | None = None


class Supervisor:
    """Starts children in their own sessions, relays their output prefixed, stops them in one go."""

    def __init__(self, *, console: Console | None = None, grace_s: float = 30.0) -> None:
        self.console = console or Console(highlight=False)
        self.grace_s = grace_s
        self.children: list[Child] = []
        self.exited = asyncio.Event()
        self._pumps: list[asyncio.Task[None]] = []
        self._width = 8

    async def start(self, child: Child) -> Child:
        env = {**os.environ, **child.env, "PYTHONUNBUFFERED": "1"}
        child.process = await asyncio.create_subprocess_exec(
            *child.argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
        self.children.append(child)
        self._width = max(self._width, len(child.name))
        colour = COLOURS[(len(self.children) - 1) % len(COLOURS)]
        self._pumps.append(asyncio.create_task(self._pump(child, colour)))
        return child

    async def _pump(self, child: Child, colour: str) -> None:
        assert child.process is not None and child.process.stdout is not None
        async for raw in child.process.stdout:
            self.say(child.name, raw.decode(errors="replace").rstrip(), colour)
        child.returncode = await child.process.wait()
        self.say(child.name, f"exited with status {child.returncode}", colour)
        self.exited.set()

    def say(self, name: str, line: str, colour: str = "white") -> None:
        self.console.print(Text.assemble((f"{name:>{self._width}} │ ", colour), line), soft_wrap=True)

    def running(self) -> list[Child]:
        return [c for c in self.children if c.process is not None and c.process.returncode is None]

    def signal_all(self, sig: signal.Signals, children: Sequence[Child] | None = None) -> None:
        for child in self.running() if children is None else children:
            assert child.process is not None
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(sig)

    async def stop(self, children: Sequence[Child] | None = None) -> None:
        """SIGTERM ``children`` (default: all), SIGKILL those still running after ``grace_s``, and wait
        until they have exited."""
        chosen = [c for c in (self.children if children is None else children) if c in self.running()]
        self.signal_all(signal.SIGTERM, chosen)
        waits = [asyncio.create_task(c.process.wait()) for c in chosen if c.process is not None]
        if waits:
            await asyncio.wait(waits, timeout=self.grace_s)
        left = [c for c in chosen if c in self.running()]
        if left:
            self.say("up", f"killing {', '.join(c.name for c in left)} after {self.grace_s:.0f} s")
            self.signal_all(signal.SIGKILL, left)
        await asyncio.gather(*waits, return_exceptions=True)
        if children is None:
            await asyncio.gather(*self._pumps, return_exceptions=True)

    def kill_now(self, status: int) -> None:
        """The second Ctrl-C: kill every child, then leave (used from a signal handler)."""
        for child in self.running():
            assert child.process is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.process.pid, signal.SIGKILL)
        os._exit(status)


def rlbus_command() -> list[str]:
    """How to run ``rlbus`` as a child: the script beside this interpreter, else the one on PATH."""
    script = Path(sys.executable).with_name("rlbus")
    if script.exists():
        return [str(script)]
    found = shutil.which("rlbus")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from rlbus.cli import app; sys.argv[0] = 'rlbus'; app()"]


def vllm_rlbus_command() -> list[str]:
    """How to run ``rlbus`` in the vLLM environment (``[rollout] engine = "vllm"``): its ``rlbus`` script,
    else its python (`rlbus.engines.vllm_engine.vllm_python`: ``RLBUS_VLLM_PYTHON`` or ``.venv-vllm``)."""
    from rlbus.engines.vllm_engine import vllm_python

    python = vllm_python()
    if not python.exists():
        raise ConfigError("rollout.engine", f"engine = \"vllm\" runs rollout workers with {python}, which does not "
                          "exist: run `make vllm-env` (or set RLBUS_VLLM_PYTHON)")
    script = python.with_name("rlbus")
    if script.exists():
        return [str(script)]
    return [str(python), "-c", "import sys; from rlbus.cli import app; sys.argv[0] = 'rlbus'; app()"]


def torchrun_command(ranks: int) -> list[str]:
    """``rlbus worker`` on ``ranks`` local processes under torchrun (a free rendezvous port of its own): on
    SIGTERM torchrun passes the signal to every rank and waits for them."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "-m", "rlbus.cli", "worker"]


def parse_regions(text: str) -> tuple[str, ...]:
    """``"eu-west,us-east"`` → the regions, checked: names as Kafka racks and Redis keys take them, no repeats."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise ConfigError("regions", "give at least one region, e.g. --regions eu-west,us-east")
    for name in names:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", name):
            raise ConfigError("regions", f"{name!r} is not a region name (lower-case letters, digits and '-')")
    if len(set(names)) != len(names):
        raise ConfigError("regions", f"{text!r} names a region twice")
    return names


def relay_child(region: str, origin: str, secret: str, root: Path, port: int) -> Child:
    """``rlbus blobs serve --upstream`` for ``region``: a pull-through cache of the origin in ``root``. It verifies
    the region's workers with the run's master secret and reads the origin with a read-only relay key."""
    from rlbus.blobs.keys import mint_for_role

    return Child(
        f"relay-{region}",
        [*rlbus_command(), "blobs", "serve", "--root", str(root), "--port", str(port), "--upstream", origin],
        {ENV_BLOB_SECRET: secret,
         "RLBUS_UPSTREAM_BLOB_SECRET": mint_for_role(secret, "relay", key_id=f"relay-{region}")},
    )


def relaunch_ranks(world_size: int, *, config: Path | None, region: str | None, worker_id: str | None) -> None:
    """A trainer with ``world_size`` > 1 that torchrun did not start replaces itself with ``torchrun_command``:
    ``rlbus worker trainer`` then runs N ranks wherever it is the command (compose, Kubernetes, a shell).
    Returns (doing nothing) for one rank or under torchrun (``WORLD_SIZE`` set), where `join_ranks` checks
    that the launch matches."""
    if world_size <= 1 or "WORLD_SIZE" in os.environ:
        return
    argv = [*torchrun_command(world_size), "trainer", *(["--config", str(config)] if config else []),
            *(["--region", region] if region else []), *(["--worker-id", worker_id] if worker_id else [])]
    print(f"trainer: [trainer] world_size = {world_size}: starting {world_size} ranks under torch.distributed.run",
          file=sys.stderr, flush=True)
    os.execv(argv[0], argv)


def worker_children(
    config_path: Path | None, rollout_workers: int, env: Mapping[str, str], regions: Sequence[str] = REGIONS,
    rollout_command: Sequence[str] | None = None, *, serve: bool = False, trainer_ranks: int = 1,
    relays: Mapping[str, str] | None = None,
) -> list[Child]:
    """The role processes of a run, in start order: trainer, reward, rollout workers, [the gateway,] prompts.
    ``rollout_command`` runs ``rlbus`` for the rollout workers (the vLLM environment's); default the same.
    The gateway (``serve``) runs the torch engine, in this environment. ``trainer_ranks`` > 1 (``[trainer]
    world_size``) starts the trainer under ``torch.distributed.run``, one process per rank. ``relays`` (region →
    relay URL): a region's rollout workers and gateway read blobs through its relay, the origin as fallback."""

    def regional(region: str) -> dict[str, str]:
        if relays is None or region not in relays:
            return dict(env)
        return {**env, ENV_BLOB_URL: relays[region], ENV_BLOB_FALLBACK_URL: env.get(ENV_BLOB_URL, "")}

    base = [*rlbus_command(), "worker"]
    rollout_base = [*rollout_command, "worker"] if rollout_command is not None else base
    tail = ["--config", str(config_path)] if config_path is not None else []
    trainer = [*(base if trainer_ranks == 1 else torchrun_command(trainer_ranks)), "trainer"]
    children = [Child("trainer", [*trainer, *tail, "--worker-id", "trainer"], dict(env)),
                Child("reward", [*base, "reward", *tail, "--worker-id", "reward-0"], dict(env))]
    for i in range(rollout_workers):
        region = regions[i % len(regions)]
        name = f"rollout-{i}"
        children.append(Child(name, [*rollout_base, "rollout", *tail, "--region", region, "--worker-id",
                                     f"{name}-{region}"], regional(region)))
    if serve:
        children.append(Child("serve", [*base, "serve", *tail, "--region", regions[0], "--worker-id", "serve"],
                              regional(regions[0])))
    children.append(Child("prompts", [*base, "prompts", *tail, "--worker-id", "prompts"], dict(env)))
    return children


def _reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _first_broker(bootstrap: str) -> tuple[str, int]:
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    return host.strip("[]"), int(port)


async def _ensure_kafka(config: RunConfig, say: Callable[[str], None]) -> None:
    host, port = _first_broker(config.bus.bootstrap)
    if _reachable(host, port):
        return
    if host not in LOCAL_HOSTS:
        raise ServiceError(f"Kafka at {config.bus.bootstrap} does not answer (and is not local, so not started)")
    from rlbus.services import kafka

    say(f"starting a local Kafka on port {port} …")
    cluster = await asyncio.to_thread(kafka.start, brokers=1, port=port)
    say(f"Kafka is up at {cluster.bootstrap}")


async def _ensure_topics(config: RunConfig, partitions: int) -> list[str]:
    from rlbus.bus.topics import topic_specs
    from rlbus.launch.arguments import bus_for

    async with bus_for(config) as bus:
        return await bus.create_topics(topic_specs(partitions=partitions))


def _redis_answers(url: str) -> bool:
    from redis import Redis
    from redis.exceptions import RedisError

    client = Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    except RedisError:
        return False
    finally:
        client.close()


async def _wait_http(url: str, timeout_s: float = 30.0) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"{url}/healthz") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise ServiceError(f"the blob server at {url} did not come up within {timeout_s:.0f} s")


def _free_port() -> int:
    from rlbus.services import free_port

    return free_port()


def _steps_logged(run_dir: Path) -> list[int]:
    """The step numbers in the trainer's run log, in order (the file may hold earlier runs' lines)."""
    from rlbus.observe.runlog import STEPS, read

    return [int(e.get("step", 0)) for e in read(run_dir, STEPS)]


async def up(
    config_path: Path | None,
    *,
    rollout_workers: int = 2,
    steps: int | None = None,
    namespace: str | None = None,
    grace_s: float = 30.0,
    console: Console | None = None,
    serve: bool = False,
    secure: bool = False,
    regions: Sequence[str] | None = None,
) -> int:
    """Run the local set until Ctrl-C, ``steps`` trainer steps, or a child's exit; returns the exit status.

    The run's namespace is ``namespace``, else the config's, else a fresh ``up-<date>-<time>``: a run of
    its own (topics, groups, Redis keys, run log under ``<run_dir>/<namespace>``), since the Redis this
    starts is empty while the topics of an earlier run would still hold its data. ``serve`` adds the
    OpenAI-compatible gateway (`rlbus serve`); without configured tokens it gets a fresh one, printed.
    ``secure`` runs it on the secure local Kafka with one credential per role for Kafka, Redis and the blob
    store (:mod:`rlbus.launch.secure`). ``regions``: the rollout workers alternate over these regions, and each
    region gets a pull-through relay of the blob origin (``rlbus blobs serve --upstream``) its workers read
    through, falling back to the origin when the relay fails (`rlbus.blobs.failover`).
    """
    if rollout_workers < 1:
        raise ValueError("rollout_workers must be ≥ 1")
    if regions is not None and secure:
        raise ConfigError("regions", "--regions and --secure together are not supported: the secure set issues "
                          "credentials per role, and a relay has none yet; run one of them")
    given = load_config(config_path)
    name = namespace or given.run.namespace or f"up-{time.strftime('%Y%m%d-%H%M%S')}"
    env: dict[str, str] = {"RLBUS_LOG_LEVEL": os.environ.get("RLBUS_LOG_LEVEL", "INFO"), ENV_NAMESPACE: name}
    if not given.run.namespace and given.run_dir is not None:
        env[ENV_RUN_DIR] = str(given.run_dir / name)
    config = load_config(config_path, {**os.environ, **env})
    if steps is not None and config.run_dir is None:
        raise ConfigError("run.run_dir", "--steps follows the trainer's run log: give the run a run_dir")
    from rlbus.launch.check import check_before_run

    check_before_run(config)  # the task, its prompts and their fit, before any process starts
    run_dir = config.run_dir or Path("runs") / name
    supervisor = Supervisor(console=console, grace_s=grace_s)

    def say(line: str) -> None:
        supervisor.say("up", line, "bold white")

    redis_server = None
    blob_server: Child | None = None
    status = 0
    with GracefulStop(exit=supervisor.kill_now) as stopping:
        try:
            cluster = None
            if secure:
                from rlbus.launch.secure import redis_tls, secure_cluster

                cluster = await asyncio.to_thread(secure_cluster, say)
            else:
                await _ensure_kafka(config, say)
                env[ENV_BOOTSTRAP] = config.bus.bootstrap
            if config.state.url == "memory://" or not _redis_answers(config.state.url):
                from rlbus.services.redis import start_redis

                if config.state.url != "memory://" and urlparse(config.state.url).hostname not in LOCAL_HOSTS:
                    raise ServiceError(f"Redis at {config.state.url} does not answer")
                tls = None if cluster is None else redis_tls(cluster)
                redis_server = await asyncio.to_thread(start_redis, dir=run_dir / "redis", tls=tls)
                env[ENV_REDIS] = redis_server.url
                say(f"started redis-server at {redis_server.url}")
            if not secure:
                created = await _ensure_topics(config, partitions=max(4, rollout_workers))
                say(f"run {name}: {len(created)} topics created")
            if config.store.url is None:
                secret = os.environ.get(ENV_BLOB_SECRET) or secrets.token_urlsafe(32)
                port = _free_port()
                root = config.store_dir()
                root.mkdir(parents=True, exist_ok=True)
                blob_server = await supervisor.start(Child(
                    "blobs", [*rlbus_command(), "blobs", "serve", "--root", str(root), "--port", str(port)],
                    {ENV_BLOB_SECRET: secret},
                ))
                env[ENV_BLOB_URL] = f"http://127.0.0.1:{port}"
                env[ENV_BLOB_SECRET] = secret
                await _wait_http(env[ENV_BLOB_URL])
            if serve and not (os.environ.get("RLBUS_SERVE_TOKENS") or os.environ.get("RLBUS_SERVE_TOKEN_FILE")
                              or config.serve.token_file):
                env["RLBUS_SERVE_TOKENS"] = f"local:{secrets.token_urlsafe(24)}"
                say(f"gateway on http://{config.serve.host}:{config.serve.port}/v1, tenant 'local', token "
                    f"{env['RLBUS_SERVE_TOKENS'].split(':', 1)[1]}")
            relays = await _start_relays(supervisor, config, env, run_dir, regions, say) if regions else None
            rollout_command = vllm_rlbus_command() if config.rollout.engine == "vllm" else None
            children = worker_children(config_path, rollout_workers, env, rollout_command=rollout_command, serve=serve,
                                       trainer_ranks=config.trainer.world_size, relays=relays,
                                       **({"regions": regions} if regions else {}))
            if cluster is not None:
                from rlbus.launch.secure import prepare

                credentials = await prepare(
                    config, name, run_dir, cluster=cluster, partitions=max(4, rollout_workers),
                    redis_admin_url=env.get(ENV_REDIS, config.state.url), blob_master=env.get(ENV_BLOB_SECRET),
                    say=say,
                )
                for child in children:
                    child.env.update(credentials.env_for(child.name))
            for child in children:
                await supervisor.start(child)
            say(f"{len(supervisor.children)} processes; run log in {run_dir}; Ctrl-C stops them")
            status = await _wait(supervisor, stopping, run_dir, steps, say)
        finally:
            servers = [c for c in supervisor.children if c is blob_server or c.name.startswith("relay-")]
            await supervisor.stop([c for c in supervisor.children if c not in servers])  # workers first
            await supervisor.stop()
            if redis_server is not None:
                redis_server.stop()
            where = " --home <RLBUS_HOME>/secure-kafka" if secure else ""
            say(f"stopped (Kafka keeps running: `rlbus kafka stop{where}`)")
    failed = [c for c in supervisor.children
              if c is not blob_server and not c.name.startswith("relay-") and c.returncode not in (0, None)]
    return status or (1 if failed else 0)


async def _start_relays(
    supervisor: Supervisor, config: RunConfig, env: Mapping[str, str], run_dir: Path, regions: Sequence[str],
    say: Callable[[str], None],
) -> dict[str, str]:
    """One relay per region in front of the run's blob origin; region → the relay's URL."""
    from rlbus.launch.config import blob_secret

    origin = env.get(ENV_BLOB_URL) or config.store.url
    if origin is None:
        raise ConfigError("store.url", "--regions needs an HTTP blob origin for the relays to pull from")
    secret = env.get(ENV_BLOB_SECRET) or blob_secret(config.store)
    relays = {}
    for region in regions:
        port = _free_port()
        root = run_dir / "relays" / region
        root.mkdir(parents=True, exist_ok=True)
        await supervisor.start(relay_child(region, origin, secret, root, port))
        relays[region] = f"http://127.0.0.1:{port}"
    for url in relays.values():
        await _wait_http(url)
    say(f"{len(relays)} regional relays of {origin}: " + ", ".join(f"{r} {u}" for r, u in relays.items()))
    return relays


async def _wait(
    supervisor: Supervisor, stopping: GracefulStop, run_dir: Path, steps: int | None, say: Callable[[str], None]
) -> int:
    earlier = len(_steps_logged(run_dir))
    while not stopping.stop.is_set():
        if await wait_event(supervisor.exited, 1.0):
            gone = [c.name for c in supervisor.children if c.returncode is not None]
            say(f"{', '.join(gone)} exited; stopping the rest")
            return 1
        if steps is not None and max(_steps_logged(run_dir)[earlier:], default=0) >= steps:
            say(f"the trainer reached step {steps}; stopping")
            return 0
    return 0
