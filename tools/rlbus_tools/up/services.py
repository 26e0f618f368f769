"""What a local run needs besides its roles, one context each: it starts the service when it is missing, hands
the role processes its address (in the run's environment, :class:`Local`), and on the way out stops what it
started — Kafka excepted, which stays up for the next run (``rlbus kafka stop``).

Entered in order on an ``AsyncExitStack``, the contexts unwind in reverse: the roles stop first, then the
relays and the blob server, then Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from rlbus.errors import ConfigError, ServiceError
from rlbus.launch.config import ENV_BLOB_SECRET, ENV_BLOB_URL, ENV_BOOTSTRAP, ENV_REDIS, RunConfig
from rlbus.launch.processes import rlbus_command
from rlbus_tools.up.roles import relay_child
from rlbus_tools.up.supervisor import Child, Supervisor

if TYPE_CHECKING:
    from rlbus_tools.services.kafka import KafkaCluster

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class Local:
    """A local run as its services come up: its config, name and directory, and the environment every role
    process gets (each service adds its address)."""

    config: RunConfig
    name: str
    run_dir: Path
    env: dict[str, str]
    supervisor: Supervisor
    say: Callable[[str], None]
    #: The secure local cluster (``--secure``), once it is up.
    cluster: KafkaCluster | None = None
    #: Children that are servers (the blob origin, the relays): stopped after the roles.
    servers: list[Child] = field(default_factory=list)


async def kafka(local: Local, *, secure: bool) -> None:
    """The run's Kafka: the secure local cluster (``--secure``), or a local broker started when the configured
    bootstrap is local and nobody answers there. Never stopped here."""
    if secure:
        from rlbus_tools.up.secure import secure_cluster

        local.cluster = await asyncio.to_thread(secure_cluster, local.say)
        return
    bootstrap = local.config.bus.bootstrap
    host, port = _first_broker(bootstrap)
    if not _reachable(host, port):
        if host not in LOCAL_HOSTS:
            raise ServiceError(f"Kafka at {bootstrap} does not answer (and is not local, so not started)")
        from rlbus_tools.services import kafka as local_kafka

        local.say(f"starting a local Kafka on port {port} …")
        cluster = await asyncio.to_thread(local_kafka.start, brokers=1, port=port)
        local.say(f"Kafka is up at {cluster.bootstrap}")
    local.env[ENV_BOOTSTRAP] = bootstrap


@contextlib.asynccontextmanager
async def redis(local: Local) -> AsyncIterator[None]:
    """The configured Redis when it answers; else a throwaway ``redis-server`` (TLS on a secure run), stopped on
    the way out. A remote Redis that does not answer is an error, not something to start."""
    url = local.config.state.url
    if url != "memory://" and _redis_answers(url):
        yield
        return
    from rlbus_tools.services.redis import start_redis

    if url != "memory://" and urlparse(url).hostname not in LOCAL_HOSTS:
        raise ServiceError(f"Redis at {url} does not answer")
    tls = None
    if local.cluster is not None:
        from rlbus_tools.up.secure import redis_tls

        tls = redis_tls(local.cluster)
    server = await asyncio.to_thread(start_redis, dir=local.run_dir / "redis", tls=tls)
    local.env[ENV_REDIS] = server.url
    local.say(f"started redis-server at {server.url}")
    try:
        yield
    finally:
        server.stop()


async def topics(local: Local, *, partitions: int) -> None:
    """The run's topics (its namespace's), created when missing; a secure run's administrator creates them."""
    from rlbus.bus.topics import topic_specs
    from rlbus.launch.arguments import bus_for

    async with bus_for(local.config) as bus:
        created = await bus.create_topics(topic_specs(partitions=partitions))
    local.say(f"run {local.name}: {len(created)} topics created")


@contextlib.asynccontextmanager
async def blob_origin(local: Local) -> AsyncIterator[None]:
    """``rlbus blobs serve`` on the run's blob directory with a fresh secret, unless ``[store] url`` names a
    server already."""
    if local.config.store.url is not None:
        yield
        return
    secret = os.environ.get(ENV_BLOB_SECRET) or secrets.token_urlsafe(32)
    port = free_port()
    root = local.config.store_dir()
    root.mkdir(parents=True, exist_ok=True)
    server = await local.supervisor.start(Child(
        "blobs", [*rlbus_command(), "blobs", "serve", "--root", str(root), "--port", str(port)],
        {ENV_BLOB_SECRET: secret},
    ))
    local.servers.append(server)
    local.env[ENV_BLOB_URL] = f"http://127.0.0.1:{port}"
    local.env[ENV_BLOB_SECRET] = secret
    try:
        await wait_http(local.env[ENV_BLOB_URL])
        yield
    finally:
        await local.supervisor.stop([server])


@contextlib.asynccontextmanager
async def relays(local: Local, regions: Sequence[str] | None) -> AsyncIterator[dict[str, str] | None]:
    """One pull-through relay per region in front of the blob origin (``--regions``); yields region → URL."""
    if not regions:
        yield None
        return
    from rlbus.launch.config import blob_secret

    origin = local.env.get(ENV_BLOB_URL) or local.config.store.url
    if origin is None:
        raise ConfigError("store.url", "--regions needs an HTTP blob origin for the relays to pull from")
    secret = local.env.get(ENV_BLOB_SECRET) or blob_secret(local.config.store)
    urls, children = {}, []
    try:
        for region in regions:
            port = free_port()
            root = local.run_dir / "relays" / region
            root.mkdir(parents=True, exist_ok=True)
            children.append(await local.supervisor.start(relay_child(region, origin, secret, root, port)))
            urls[region] = f"http://127.0.0.1:{port}"
        local.servers += children
        for url in urls.values():
            await wait_http(url)
        local.say(f"{len(urls)} regional relays of {origin}: " + ", ".join(f"{r} {u}" for r, u in urls.items()))
        yield urls
    finally:
        await local.supervisor.stop(children)


def gateway_token(local: Local) -> None:
    """A fresh token for the gateway (``--serve``) when none is configured, printed once."""
    if os.environ.get("RLBUS_SERVE_TOKENS") or os.environ.get("RLBUS_SERVE_TOKEN_FILE") or \
            local.config.serve.token_file:
        return
    local.env["RLBUS_SERVE_TOKENS"] = f"local:{secrets.token_urlsafe(24)}"
    serve = local.config.serve
    local.say(f"gateway on http://{serve.host}:{serve.port}/v1, tenant 'local', token "
              f"{local.env['RLBUS_SERVE_TOKENS'].split(':', 1)[1]}")


@contextlib.asynccontextmanager
async def roles(local: Local, children: Sequence[Child]) -> AsyncIterator[None]:
    """The role processes, started in order; on the way out stopped before any server they use."""
    try:
        for child in children:
            await local.supervisor.start(child)
        yield
    finally:
        await local.supervisor.stop([c for c in local.supervisor.children if c not in local.servers])


async def wait_http(url: str, timeout_s: float = 30.0) -> None:
    """Until ``url/healthz`` answers 200; ServiceError after ``timeout_s``."""
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


def free_port() -> int:
    from rlbus_tools.services import free_port as pick

    return pick()


def _reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _first_broker(bootstrap: str) -> tuple[str, int]:
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    return host.strip("[]"), int(port)


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
