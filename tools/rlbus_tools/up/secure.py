"""``rlbus up --secure``: every process of a local run holds only its own role's credentials.

What it sets up, on top of what ``rlbus up`` does:

* **Kafka**: a secure local cluster (:mod:`rlbus_tools.services.kafka_secure`: TLS on every listener, SCRAM,
  nothing allowed without an ACL) under ``<RLBUS_HOME>/secure-kafka``, started when it is not running and
  kept afterwards like the plain one. The administrator (a client certificate) creates the run's topics;
  each role gets a SCRAM user with only its ACLs (:mod:`rlbus.security.kafka_acl`), written to
  ``<run_dir>/credentials/kafka/<role>.bus.toml`` (+ ``.password``, mode 0600). A child finds its file
  through ``RLBUS_BUS_CONFIG``, whose ``[bus]`` table overlays the run config's.
* **Redis**: one ACL user per role (:mod:`rlbus.security.redis_acl`), passwords in
  ``<run_dir>/credentials/redis/<role>``; a child gets ``RLBUS_REDIS_URL`` with its own user. A Redis that
  ``rlbus up`` starts itself speaks TLS only, with a certificate from the cluster's CA (``rediss://``). The
  ``default`` user stays on for ``rlbus up`` itself (it created the users); a production Redis turns it off
  (``rlbus redis users --disable-default``).
* **Blobs**: the blob server keeps the master secret, which only the trainer holds (it writes versions and
  collects old ones); rollout workers and the gateway get keys that read everywhere and write only
  ``claims/``, the reward worker and the prompt producer read-only keys (:mod:`rlbus.blobs.keys`), each
  expiring after a day.

A child's environment holds its secrets (readable by the same user through ``/proc``, as any local
process's is); nothing goes on a command line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlbus.errors import ServiceError
from rlbus.launch.config import ENV_BLOB_SECRET, ENV_BOOTSTRAP, ENV_BUS_CONFIG, ENV_REDIS, RunConfig

if TYPE_CHECKING:
    from rlbus.bus.kafka import KafkaBus
    from rlbus.security.tls import Issued
    from rlbus_tools.services.kafka import KafkaCluster

#: A child's name prefix → its role for Kafka, Redis and the blob store.
KAFKA_ROLE = {"trainer": "trainer", "reward": "reward", "rollout": "rollout", "serve": "gateway",
              "prompts": "producer"}
REDIS_ROLE = {"trainer": "trainer", "reward": "reward", "rollout": "rollout", "serve": "serve",
              "prompts": "prompts"}
BLOB_KEY_TTL = "1d"


@dataclass
class SecureRun:
    """The credentials a secure local run hands its children."""

    bootstrap: str
    bus_files: dict[str, Path] = field(default_factory=dict)  # Kafka role → its [bus] file
    redis_urls: dict[str, str] = field(default_factory=dict)  # Redis role → URL with its user
    blob_keys: dict[str, str] = field(default_factory=dict)  # child role → blob secret (master or scoped)

    def env_for(self, child: str) -> dict[str, str]:
        """The environment entries of the child named ``child`` (``rollout-1`` is a rollout worker)."""
        kind = child.split("-", 1)[0]
        if kind not in KAFKA_ROLE:
            return {}
        env = {ENV_BOOTSTRAP: self.bootstrap, ENV_BUS_CONFIG: str(self.bus_files[KAFKA_ROLE[kind]])}
        if REDIS_ROLE[kind] in self.redis_urls:
            env[ENV_REDIS] = self.redis_urls[REDIS_ROLE[kind]]
        if kind in self.blob_keys:
            env[ENV_BLOB_SECRET] = self.blob_keys[kind]
        return env


def secure_cluster(say: Callable[[str], None]) -> KafkaCluster:
    """The local secure cluster (started, or found running), under ``<RLBUS_HOME>/secure-kafka``."""
    from rlbus_tools.services import free_port_run, kafka

    home = kafka.default_home().expanduser().resolve() / "secure-kafka"
    existing = kafka.load_cluster(home)
    if existing is not None and existing.secure:
        cluster = kafka.start(brokers=len(existing.nodes), port=existing.nodes[0].port, home=home, secure=True)
    else:
        say("starting a secure local Kafka (TLS, SCRAM, ACLs; a first start makes its CA) …")
        cluster = kafka.start(brokers=1, port=free_port_run(2), home=home, fresh=True, secure=True,
                              internal_port=free_port_run(1))
    say(f"secure Kafka at {cluster.bootstrap} (SASL_SSL); administrator at {cluster.internal_bootstrap}")
    return cluster


def redis_tls(cluster: KafkaCluster) -> tuple[Issued, Path]:
    """A server certificate for the run's Redis from the cluster's CA, and the CA file clients verify it with."""
    from rlbus_tools.services import kafka_secure

    return kafka_secure.ca(cluster).issue("redis", server=True, client=False), kafka_secure.ca_file(cluster)


async def prepare(
    config: RunConfig, namespace: str, run_dir: Path, *, cluster: KafkaCluster, partitions: int,
    redis_admin_url: str | None, blob_master: str | None, say: Callable[[str], None],
) -> SecureRun:
    """Create the run's topics on the secure ``cluster`` as its administrator, and make every role's Kafka
    user and ACLs, Redis user and blob key."""
    from rlbus.blobs.keys import fleet_keys
    from rlbus.bus.namespace import namespaced
    from rlbus.bus.topics import topic_specs
    from rlbus_tools.services.kafka_grant import grant

    admin_bus = _admin_bus(cluster)
    async with namespaced(admin_bus, f"{namespace}.") as admin:
        specs = topic_specs(partitions=partitions, replication=cluster.replication_factor)
        created = await admin.create_topics(specs)
    credentials = run_dir / "credentials"
    granted = await asyncio.to_thread(grant, cluster, namespace, credentials / "kafka")
    run = SecureRun(bootstrap=cluster.bootstrap, bus_files={c.role: c.bus_file for c in granted})
    say(f"run {namespace}: {len(created)} topics created; Kafka users {', '.join(c.user for c in granted)}")
    if redis_admin_url is not None and redis_admin_url != "memory://":
        run.redis_urls = await _redis_users(redis_admin_url, namespace, config.state_prefix, credentials / "redis")
        say(f"Redis users for {', '.join(sorted(run.redis_urls))}")
    if blob_master is not None:
        run.blob_keys = fleet_keys(blob_master, ttl=BLOB_KEY_TTL)
        say("blob keys: trainer holds the master; rollout and serve write claims/ only; reward, prompts read")
    return run


def _admin_bus(cluster: KafkaCluster) -> KafkaBus:
    from rlbus.bus.kafka import KafkaBus, KafkaSettings
    from rlbus_tools.services import kafka_secure

    admin = kafka_secure.admin_certificate(cluster)
    return KafkaBus(KafkaSettings(
        bootstrap=cluster.internal_bootstrap or cluster.bootstrap, client_id="rlbus-up-admin", security_protocol="SSL",
        ssl_cafile=str(kafka_secure.ca_file(cluster)), ssl_certfile=str(admin.cert), ssl_keyfile=str(admin.key),
    ))


async def _redis_users(admin_url: str, namespace: str, key_prefix: str, directory: Path) -> dict[str, str]:
    from rlbus.security.redis_acl import apply_users, read_passwords, role_url

    roles = sorted(set(REDIS_ROLE.values()) | {"observer", "operator"})
    try:
        passwords, _ = await asyncio.to_thread(read_passwords, roles, directory=directory, environ={})
        names = await apply_users(admin_url, passwords, namespace=namespace, key_prefix=key_prefix)
    except ValueError as exc:
        raise ServiceError(f"creating the run's Redis users failed: {exc}") from None
    return {role: role_url(admin_url, names[role], passwords[role]) for role in roles}
