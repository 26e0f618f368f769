"""Attempts to get in: a fleet's credentials used for what their role must not do, and forged ones.

A least-privilege setup is only as good as the attempts it was shown to refuse. :data:`ATTEMPTS` is the
refusal matrix (docs/guarantees.md); the integration tests run each attempt against a real secure
3-broker Kafka, a real Redis and a real blob server and require a typed refusal, nothing written and the
attempt logged; ``rlbus bench bus --security tls-scram`` runs the whole matrix against the cluster it
measured and counts the refusals.

Each attempt is one coroutine taking the :class:`Rig` (the cluster, two namespaces' role credentials, a
blob server with scoped keys, Redis users) and returning an :class:`AttemptOutcome`: refused or not, the error it
got (type and message), whether anything was written, and whether the refusing side logged it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import tempfile
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.bus.kafka import KafkaBus, KafkaSettings
from rlbus.bus.topics import PROMPTS, WEIGHTS, topic_specs
from rlbus.bus.types import TopicSpec
from rlbus.config import KafkaBusConfig, build_bus, parse
from rlbus.errors import BlobAuthError, BusAuthError, RlbusError
from rlbus.security import kafka_broker
from rlbus.security.probe import AttemptOutcome, consume_briefly, produce_one, refusal
from rlbus.security.tls import LocalCA
from rlbus_tools.services import kafka, kafka_secure
from rlbus_tools.services.kafka_grant import grant

log = logging.getLogger("rlbus_tools.chaos.intrusion")

NAMESPACES = ("intr-a", "intr-b")


@dataclass
class Rig:
    """What the attempts aim at: a secure cluster with two namespaces' roles, and their credential files."""

    cluster: kafka.KafkaCluster
    credentials: dict[str, Path]  # namespace → directory of <role>.bus.toml / <role>.password
    work: Path
    blob_url: str | None = None
    blob_master: str | None = None
    redis_admin_url: str | None = None
    redis_passwords: dict[str, dict[str, str]] = field(default_factory=dict)  # namespace → role → password

    def bus_config(self, namespace: str, role: str, **override: Any) -> KafkaBusConfig:
        data = tomllib.loads((self.credentials[namespace] / f"{role}.bus.toml").read_text())["bus"]
        data.pop("kind", None)
        data.update(override)
        config: KafkaBusConfig = parse(KafkaBusConfig, data, prefix="bus")
        return config

    def admin_bus(self) -> KafkaBus:
        admin = kafka_secure.admin_certificate(self.cluster)
        return KafkaBus(KafkaSettings(
            bootstrap=self.cluster.internal_bootstrap or self.cluster.bootstrap, client_id="rlbus-intrusion-admin",
            security_protocol="SSL", ssl_cafile=str(kafka_secure.ca_file(self.cluster)),
            ssl_certfile=str(admin.cert), ssl_keyfile=str(admin.key),
        ))

    def rogue_ca(self) -> LocalCA:
        """Another CA, unknown to the cluster: what a forger signs with."""
        return LocalCA(self.work / "rogue-ca", common_name="not the rlbus CA").ensure()

    def security_log(self) -> dict[Path, int]:
        """Where each node's security log ends now (what :func:`_logged` reads from)."""
        logs = (n.security_log for n in self.cluster.nodes)
        return {path: path.stat().st_size if path.is_file() else 0 for path in logs}


async def prepare(cluster: kafka.KafkaCluster, work: Path) -> Rig:
    """Create both namespaces' topics (as the administrator) and their roles' users and ACLs."""
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    async with Rig(cluster, {}, work).admin_bus() as admin:
        for namespace in NAMESPACES:
            specs = topic_specs(replication=cluster.replication_factor)
            await admin.create_topics([dataclasses.replace(s, name=f"{namespace}.{s.name}") for s in specs])
    credentials = {ns: work / "credentials" / ns for ns in NAMESPACES}
    for namespace, directory in credentials.items():
        await asyncio.to_thread(grant, cluster, namespace, directory)
    return Rig(cluster, credentials, work)


# --- helpers -------------------------------------------------------------------------------------------


async def _end_total(rig: Rig, topic: str) -> int:
    async with rig.admin_bus() as admin:
        return sum((await admin.end_offsets(topic)).values())


def _logged(before: dict[Path, int], *needles: str) -> bool:
    """Whether one line written to a node's security log since ``before`` holds every needle."""
    for path, offset in before.items():
        if not path.is_file():
            continue
        with path.open("rb") as log_file:
            log_file.seek(offset)
            lines = log_file.read().decode(errors="replace").splitlines()
        if any(all(needle in line for needle in needles) for line in lines):
            return True
    return False


async def _wait_logged(rig: Rig, before: dict[Path, int], *needles: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _logged(before, *needles):
            return True
        await asyncio.sleep(0.2)
    return False


# --- Kafka: authorisation ------------------------------------------------------------------------------


async def rollout_publishes_weights(rig: Rig) -> AttemptOutcome:
    ns = NAMESPACES[0]
    topic = f"{ns}.{WEIGHTS.name}"
    before_log, before = rig.security_log(), await _end_total(rig, topic)
    refused, error = await refusal(produce_one(rig.bus_config(ns, "rollout"), topic), BusAuthError)
    written = await _end_total(rig, topic) != before
    logged = await _wait_logged(rig, before_log, f"User:{ns}.rollout", "Denied", "WRITE", topic)
    return AttemptOutcome(f"{ns}.rollout", f"produce to {topic}", refused, error, written, logged)


async def rollout_joins_trainer_group(rig: Rig) -> AttemptOutcome:
    ns = NAMESPACES[0]
    topic, group = f"{ns}.{PROMPTS.name}", f"{ns}.trainer"
    before_log = rig.security_log()
    refused, error = await refusal(consume_briefly(rig.bus_config(ns, "rollout"), topic, group), BusAuthError)
    logged = await _wait_logged(rig, before_log, f"User:{ns}.rollout", "Denied", group)
    return AttemptOutcome(f"{ns}.rollout", f"join consumer group {group}", refused, error, None, logged)


async def rollout_reads_other_namespace(rig: Rig) -> AttemptOutcome:
    ns, other = NAMESPACES
    topic = f"{other}.{PROMPTS.name}"
    before_log = rig.security_log()
    refused, error = await refusal(consume_briefly(rig.bus_config(ns, "rollout"), topic, None), BusAuthError)
    logged = await _wait_logged(rig, before_log, f"User:{ns}.rollout", "Denied", topic)
    return AttemptOutcome(f"{ns}.rollout", f"read {topic} (another namespace)", refused, error, None, logged)


async def trainer_writes_other_namespace(rig: Rig) -> AttemptOutcome:
    ns, other = NAMESPACES
    topic = f"{other}.{WEIGHTS.name}"
    before_log, before = rig.security_log(), await _end_total(rig, topic)
    refused, error = await refusal(produce_one(rig.bus_config(ns, "trainer"), topic), BusAuthError)
    written = await _end_total(rig, topic) != before
    logged = await _wait_logged(rig, before_log, f"User:{ns}.trainer", "Denied", topic)
    return AttemptOutcome(f"{ns}.trainer", f"produce to {topic} (another namespace)", refused, error, written, logged)


async def producer_creates_topic(rig: Rig) -> AttemptOutcome:
    ns = NAMESPACES[0]
    topic = f"{ns}.rogue.{uuid.uuid4().hex[:6]}"
    before_log = rig.security_log()

    async def create() -> None:
        async with build_bus(rig.bus_config(ns, "producer")) as bus:
            await bus.create_topics([TopicSpec(topic, partitions=1, replication=rig.cluster.replication_factor)])

    refused, error = await refusal(create(), BusAuthError)
    async with rig.admin_bus() as admin:
        written = topic in await admin.list_topics()
    logged = await _wait_logged(rig, before_log, f"User:{ns}.producer", "Denied", "CREATE")
    return AttemptOutcome(f"{ns}.producer", f"create topic {topic}", refused, error, written, logged)


# --- Kafka: authentication -----------------------------------------------------------------------------


async def wrong_password(rig: Rig) -> AttemptOutcome:
    ns = NAMESPACES[0]
    secret = rig.work / "wrong.password"
    secret.write_text("not-the-password\n")
    before_log = rig.security_log()
    config = rig.bus_config(ns, "rollout", sasl_password_file=str(secret))
    refused, error = await refusal(produce_one(config, f"{ns}.{PROMPTS.name}"), BusAuthError)
    logged = await _wait_logged(rig, before_log, "Failed authentication", "invalid credentials")
    return AttemptOutcome(f"{ns}.rollout", "log in with a wrong password", refused, error, None, logged)


async def plaintext_to_tls(rig: Rig) -> AttemptOutcome:
    ns = NAMESPACES[0]
    before_log = rig.security_log()
    config = rig.bus_config(ns, "rollout", security_protocol="SASL_PLAINTEXT")
    refused, error = await refusal(produce_one(config, f"{ns}.{PROMPTS.name}"), BusAuthError)
    logged = await _wait_logged(rig, before_log, "Failed authentication")
    return AttemptOutcome(f"{ns}.rollout", "speak SASL_PLAINTEXT to the TLS listener", refused, error, None, logged)


async def trust_another_ca(rig: Rig) -> AttemptOutcome:
    """A client pointed at a broker its CA did not sign (what a man in the middle looks like)."""
    ns = NAMESPACES[0]
    config = rig.bus_config(ns, "rollout", ssl_cafile=str(rig.rogue_ca().cert))
    refused, error = await refusal(produce_one(config, f"{ns}.{PROMPTS.name}"), BusAuthError)
    what = "connect trusting another CA (man in the middle)"
    return AttemptOutcome(f"{ns}.rollout", what, refused, error, None, None)


async def _admin_with(rig: Rig, cert: Path, key: Path) -> None:
    settings = KafkaSettings(
        bootstrap=rig.cluster.internal_bootstrap or "", client_id="rlbus-intrusion-forger", security_protocol="SSL",
        ssl_cafile=str(kafka_secure.ca_file(rig.cluster)), ssl_certfile=str(cert), ssl_keyfile=str(key),
    )
    async with KafkaBus(settings) as bus:
        await bus.create_topics([TopicSpec(f"forged.{uuid.uuid4().hex[:6]}", 1, rig.cluster.replication_factor)])


async def forged_admin_certificate(rig: Rig) -> AttemptOutcome:
    forged = rig.rogue_ca().issue(kafka_broker.ADMIN, client=True)
    before_log = rig.security_log()
    refused, error = await refusal(_admin_with(rig, forged.cert, forged.key), BusAuthError)
    logged = await _wait_logged(rig, before_log, "Failed authentication")
    return AttemptOutcome("forger", "administrator certificate signed by another CA", refused, error, None, logged)


async def expired_admin_certificate(rig: Rig) -> AttemptOutcome:
    expired = kafka_secure.ca(rig.cluster).issue("rlbus-admin-expired", client=True, expired=True)
    before_log = rig.security_log()
    refused, error = await refusal(_admin_with(rig, expired.cert, expired.key), BusAuthError)
    logged = await _wait_logged(rig, before_log, "Failed authentication")
    return AttemptOutcome("ex-administrator", "expired certificate from the cluster's CA", refused, error, None, logged)


async def client_certificate_from_another_ca(rig: Rig) -> AttemptOutcome:
    """Right SCRAM password, but the client certificate (required on an mTLS cluster) is a forgery."""
    ns = NAMESPACES[0]
    if not rig.cluster.mtls:
        what = "SCRAM + a client certificate from another CA"
        return AttemptOutcome(f"{ns}.rollout", what, False, "cluster not mTLS")
    forged = rig.rogue_ca().issue(f"{ns}.rollout", client=True)
    before_log = rig.security_log()
    config = rig.bus_config(ns, "rollout", ssl_certfile=str(forged.cert), ssl_keyfile=str(forged.key))
    refused, error = await refusal(produce_one(config, f"{ns}.{PROMPTS.name}"), BusAuthError)
    logged = await _wait_logged(rig, before_log, "Failed authentication")
    return AttemptOutcome(f"{ns}.rollout", "SCRAM + a client certificate from another CA", refused, error, None, logged)


# --- blob store --------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def blob_server(rig: Rig) -> AsyncIterator[None]:
    """A blob server with a master secret, for the blob attempts (the rig's blob_url while open)."""
    import secrets

    from rlbus.blobs.http import BlobServer, serve
    from rlbus.blobs.local import LocalStore
    from rlbus_tools.services import free_port

    master, port = secrets.token_urlsafe(32), free_port()
    runner = await serve(BlobServer(LocalStore(rig.work / "blobs"), secret=master), "127.0.0.1", port)
    rig.blob_url, rig.blob_master = f"http://127.0.0.1:{port}", master
    try:
        yield
    finally:
        await runner.cleanup()
        rig.blob_url = rig.blob_master = None


async def _blob_attempt(rig: Rig, who: str, what: str, key: str, secret: str, method: str) -> AttemptOutcome:
    from rlbus.blobs.http import HttpStore

    assert rig.blob_url and rig.blob_master
    async with HttpStore(rig.blob_url, secret=rig.blob_master) as owner:
        existed = await _blob_exists(owner, key)
    records: list[logging.LogRecord] = []
    handler = _Capture(records)
    blob_log = logging.getLogger("rlbus.blobs")
    blob_log.addHandler(handler)
    try:
        async with HttpStore(rig.blob_url, secret=secret) as store:
            action = store.put(key, b"forged manifest") if method == "PUT" else store.get(key)
            refused, error = await refusal(action, BlobAuthError)
    finally:
        blob_log.removeHandler(handler)
    async with HttpStore(rig.blob_url, secret=rig.blob_master) as owner:
        written = method == "PUT" and await _blob_exists(owner, key) != existed
    logged = any(r.levelno >= logging.WARNING and key in r.getMessage() for r in records)
    return AttemptOutcome(who, what, refused, error, written, logged)


async def _blob_exists(store: Any, key: str) -> bool:
    try:
        await store.size(key)
        return True
    except RlbusError:
        return False


class _Capture(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def worker_key_uploads_manifest(rig: Rig) -> AttemptOutcome:
    from rlbus.blobs.keys import mint_for_role

    assert rig.blob_master
    key = mint_for_role(rig.blob_master, "worker", prefix="intr-a/")
    return await _blob_attempt(rig, "worker blob key", "upload a weights manifest", "intr-a/manifests/v9.json",
                               key, "PUT")


async def worker_key_reads_other_namespace(rig: Rig) -> AttemptOutcome:
    from rlbus.blobs.keys import mint_for_role

    assert rig.blob_master
    async with _owner(rig) as owner:
        await owner.put("intr-b/chunks/0", b"other run's weights")
    key = mint_for_role(rig.blob_master, "worker", prefix="intr-a/")
    return await _blob_attempt(rig, "worker blob key", "read another namespace's chunk", "intr-b/chunks/0", key, "GET")


async def expired_blob_key(rig: Rig) -> AttemptOutcome:
    from rlbus.blobs.keys import mint_for_role

    assert rig.blob_master
    async with _owner(rig) as owner:
        await owner.put("intr-a/chunks/0", b"weights")
    key = mint_for_role(rig.blob_master, "worker", prefix="intr-a/", ttl=60, now=time.time() - 3600)
    return await _blob_attempt(rig, "expired worker blob key", "read a chunk", "intr-a/chunks/0", key, "GET")


@contextlib.asynccontextmanager
async def _owner(rig: Rig) -> AsyncIterator[Any]:
    from rlbus.blobs.http import HttpStore

    assert rig.blob_url and rig.blob_master
    async with HttpStore(rig.blob_url, secret=rig.blob_master) as store:
        yield store


# --- Redis -------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def redis_users(rig: Rig, admin_url: str) -> AsyncIterator[None]:
    """Both namespaces' Redis users (removed afterwards), for the Redis attempts."""
    import secrets

    from rlbus.security.redis_acl import ROLES, apply_users, delete_users

    rig.redis_admin_url = admin_url
    for namespace in NAMESPACES:
        rig.redis_passwords[namespace] = {role: secrets.token_urlsafe(18) for role in ROLES}
        await apply_users(admin_url, rig.redis_passwords[namespace], namespace=namespace)
    try:
        yield
    finally:
        for namespace in NAMESPACES:
            await delete_users(admin_url, namespace=namespace)
        rig.redis_admin_url = None


async def _redis_attempt(rig: Rig, namespace: str, role: str, key: str, what: str) -> AttemptOutcome:
    from redis.asyncio import Redis
    from redis.exceptions import NoPermissionError

    from rlbus.security.redis_acl import key_prefix_for, role_url, username

    assert rig.redis_admin_url
    full_key = key_prefix_for(key.split("/", 1)[0]) + key.split("/", 1)[1]
    admin = Redis.from_url(rig.redis_admin_url)
    user = username(role, namespace)
    url = role_url(rig.redis_admin_url, user, rig.redis_passwords[namespace][role])
    client = Redis.from_url(url)
    try:
        await admin.set(full_key, b"ledger entry")
        await admin.acl_log_reset()
        refused, error = await refusal(client.set(full_key, b"forged"), NoPermissionError)
        written = await admin.get(full_key) != b"ledger entry"
        entries = await admin.acl_log()
        logged = any(str(e.get("username")) == user for e in entries)
    finally:
        await admin.delete(full_key)
        await client.aclose()
        await admin.aclose()
    return AttemptOutcome(f"redis {user}", what, refused, error, written, logged)


async def rollout_writes_ledger(rig: Rig) -> AttemptOutcome:
    ns = NAMESPACES[0]
    return await _redis_attempt(rig, ns, "rollout", f"{ns}/once:trainer:r1", "write the trainer's ledger")


async def trainer_writes_other_namespace_ledger(rig: Rig) -> AttemptOutcome:
    ns, other = NAMESPACES
    return await _redis_attempt(rig, ns, "trainer", f"{other}/once:trainer:r1", "write another namespace's ledger")


# --- HTTP endpoints ----------------------------------------------------------------------------------------


async def unauthenticated_dashboard(rig: Rig) -> AttemptOutcome:
    """A request without the dashboard's token (the page shows the run's counters, workers and rewards)."""
    import secrets

    import aiohttp

    from rlbus.observe.dashboard import serving

    records: list[logging.LogRecord] = []
    handler = _Capture(records)
    exposure_log = logging.getLogger("rlbus.exposure")
    exposure_log.addHandler(handler)
    try:
        async with serving(lambda: {"now": time.time(), "counts": {"trained": 1}}, "127.0.0.1", 0,
                           token=secrets.token_urlsafe(24)) as url:
            async with aiohttp.ClientSession() as http, http.get(url + "api/snapshot") as response:
                status, body = response.status, await response.text()
    finally:
        exposure_log.removeHandler(handler)
    refused = status == 401 and "trained" not in body
    logged = any("refused" in r.getMessage() for r in records)
    return AttemptOutcome("anyone on the network", "read the dashboard without its token", refused,
                   f"HTTP {status}" if refused else f"HTTP {status}: {body[:60]}", None, logged)


async def dashboard_open_off_host(rig: Rig) -> AttemptOutcome:
    """An operator starting the dashboard on every interface without a token: refused before binding."""
    from rlbus.errors import ConfigError
    from rlbus.observe.dashboard import serving

    async def start() -> None:
        async with serving(lambda: {}, "0.0.0.0", 0, environ={}):  # the attempt itself
            pass

    refused, error = await refusal(start(), ConfigError)
    return AttemptOutcome("operator", "serve the dashboard on 0.0.0.0 without a token", refused, error, None, None)


Attempt = Callable[[Rig], Awaitable[AttemptOutcome]]

KAFKA_ATTEMPTS: tuple[Attempt, ...] = (
    rollout_publishes_weights,
    rollout_joins_trainer_group,
    rollout_reads_other_namespace,
    trainer_writes_other_namespace,
    producer_creates_topic,
    wrong_password,
    plaintext_to_tls,
    trust_another_ca,
    forged_admin_certificate,
    expired_admin_certificate,
    client_certificate_from_another_ca,
)
BLOB_ATTEMPTS: tuple[Attempt, ...] = (worker_key_uploads_manifest, worker_key_reads_other_namespace, expired_blob_key)
REDIS_ATTEMPTS: tuple[Attempt, ...] = (rollout_writes_ledger, trainer_writes_other_namespace_ledger)
ENDPOINT_ATTEMPTS: tuple[Attempt, ...] = (unauthenticated_dashboard, dashboard_open_off_host)
ATTEMPTS = KAFKA_ATTEMPTS + BLOB_ATTEMPTS + REDIS_ATTEMPTS + ENDPOINT_ATTEMPTS


async def run_matrix(rig: Rig, redis_admin_url: str | None = None) -> list[AttemptOutcome]:
    """Every attempt, one after another (Redis ones only with ``redis_admin_url``). The gateway's tenant
    isolation (one tenant's token reading another's session) needs a model behind the gateway and is
    tested in tests/integration/test_endpoint_auth.py."""
    outcomes = []
    for attempt in KAFKA_ATTEMPTS:
        outcomes.append(await _timed(attempt, rig))
    async with blob_server(rig):
        for attempt in BLOB_ATTEMPTS:
            outcomes.append(await _timed(attempt, rig))
    if redis_admin_url:
        async with redis_users(rig, redis_admin_url):
            for attempt in REDIS_ATTEMPTS:
                outcomes.append(await _timed(attempt, rig))
    for attempt in ENDPOINT_ATTEMPTS:
        outcomes.append(await _timed(attempt, rig))
    return outcomes


async def _timed(attempt: Attempt, rig: Rig) -> AttemptOutcome:
    began = time.monotonic()
    outcome = await attempt(rig)
    outcome.seconds = time.monotonic() - began
    level = logging.INFO if outcome.refused else logging.ERROR
    log.log(level, "%s: %s → %s (%s)", outcome.who, outcome.what, "refused" if outcome.refused else "ALLOWED",
            outcome.error)
    return outcome


@contextlib.asynccontextmanager
async def secure_cluster(brokers: int = 3, *, mtls: bool = True, home: Path | None = None) -> AsyncIterator[Rig]:
    """Start a fresh secure cluster on free ports in a temporary home, prepare the rig, stop it afterwards."""
    from rlbus_tools.services import free_port_run

    with tempfile.TemporaryDirectory(prefix="rlbus-secure-") as tmp:
        root = home or Path(tmp)
        port = free_port_run(2 * brokers)
        internal = free_port_run(brokers)
        cluster = await asyncio.to_thread(
            kafka.start, brokers=brokers, port=port, fresh=True, home=root, timeout_s=180, secure=True, mtls=mtls,
            internal_port=internal,
        )
        try:
            yield await prepare(cluster, root / "work")
        finally:
            await asyncio.to_thread(kafka.stop, root, 15.0)
