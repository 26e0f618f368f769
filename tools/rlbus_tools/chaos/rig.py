"""The infrastructure chaos scenarios run on and break: a three-broker Kafka cluster and a Redis server.

Both are private to the run — their own home directory and free ports — so killing a broker never
touches a developer's Kafka on 9092 and no other test's messages reach the scenario's consumer groups
(whose names are fixed: ``rollout``, ``reward-verifier``, ``trainer``). Topics are deleted and created
again before each scenario (Kafka drops a deleted topic's committed offsets with it), and each scenario
keeps its state under its own Redis key prefix, so scenarios never see each other's work.

Kafka: RF 3 and ``min.insync.replicas`` 2 on every rlbus topic; producers are idempotent with
``acks=all`` (:mod:`rlbus.bus.kafka`), so one broker may die without losing an acknowledged write.
Redis: an append-only file fsynced on every write (``persist=True``), so a SIGKILLed server restarted
on the same directory holds every write it acknowledged.

``secure=True`` (the suite with ``RLBUS_CHAOS_SECURE=1``) runs the same faults on a secure cluster
(:mod:`rlbus_tools.services.kafka_secure`: TLS between every broker and controller, SASL_SSL + SCRAM for every
client, the StandardAuthorizer on): every bus and worker process authenticates as one SCRAM user allowed
all operations by ACL, so broker deaths, restarts and rebalances are ridden out over TLS with
re-authentication. (Per-role least privilege is what ``tests/integration/test_kafka_security.py`` and
``rlbus up --secure`` show; here the scenarios' faults are the point.)
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from rlbus.bus.kafka import KafkaBus, KafkaSettings
from rlbus.bus.topics import topic_specs
from rlbus.errors import ServiceError
from rlbus.state.redis import RedisStateStore
from rlbus_tools.services import free_port_run, kafka
from rlbus_tools.services.redis import RedisServer, start_redis

PARTITIONS = 4
CHAOS_USER = "chaos"


def _chaos_user(cluster: kafka.KafkaCluster) -> dict[str, str]:
    """A SCRAM user allowed every operation by ACL (topics, groups, the cluster: the scenarios delete and
    create topics), its password in ``<home>/chaos.password``; returns its KafkaSettings fields."""
    from rlbus_tools.services.kafka_admin import AclBinding, create_acls, upsert_scram_users
    from rlbus_tools.services.kafka_secure import ca_file

    password = secrets.token_urlsafe(24)
    password_file = cluster.home / f"{CHAOS_USER}.password"
    password_file.touch(mode=0o600)
    password_file.write_text(password + "\n")
    admin = kafka.admin_client_properties(cluster)
    upsert_scram_users(admin, {CHAOS_USER: password})
    user = f"User:{CHAOS_USER}"
    create_acls(admin, [
        AclBinding(user, "TOPIC", "*", "ALL"), AclBinding(user, "GROUP", "*", "ALL"),
        AclBinding(user, "CLUSTER", "kafka-cluster", "ALL"), AclBinding(user, "TRANSACTIONAL_ID", "*", "ALL"),
    ])
    return {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": CHAOS_USER,
        "sasl_password": password, "ssl_cafile": str(ca_file(cluster)),
    }


@dataclass
class ChaosRig:
    """A private Kafka cluster and Redis server under ``home``."""

    home: Path
    cluster: kafka.KafkaCluster
    redis: RedisServer
    #: On a secure cluster: the chaos user's ``[bus]`` settings (SASL_SSL, SCRAM, the CA), else empty.
    security: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(
        cls, home: Path, *, brokers: int = 3, timeout_s: float = 180.0, secure: bool = False,
        racks: Sequence[str] | None = None, region_ports: Mapping[str, Sequence[int]] | None = None,
    ) -> ChaosRig:
        """Start both (blocking: call it in a thread from async code). ``racks`` and ``region_ports`` as for
        :func:`rlbus_tools.services.kafka.start`: brokers in regions, and a listener per region (``rlbus bench
        regions``, :mod:`rlbus_tools.services.wan`)."""
        home.mkdir(parents=True, exist_ok=True)
        cluster = kafka.start(
            brokers=brokers, port=free_port_run(2 * brokers), home=home, timeout_s=timeout_s, fresh=True,
            secure=secure, internal_port=free_port_run(brokers) if secure else None, racks=racks,
            region_ports=region_ports,
        )
        try:
            security = _chaos_user(cluster) if secure else {}
            redis = start_redis(dir=home / "redis", persist=True)
        except ServiceError:
            kafka.stop(home, grace_s=10)
            raise
        return cls(home=home, cluster=cluster, redis=redis, security=security)

    def stop(self) -> None:
        self.redis.stop()
        kafka.stop(self.home, grace_s=15)

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap

    @property
    def replication(self) -> int:
        return self.cluster.replication_factor

    def bus(self, client_id: str = "rlbus-chaos") -> KafkaBus:
        s = self.security
        return KafkaBus(KafkaSettings(
            bootstrap=self.bootstrap, client_id=client_id, request_timeout_ms=15_000,
            security_protocol=s.get("security_protocol", "PLAINTEXT"), sasl_mechanism=s.get("sasl_mechanism"),
            sasl_username=s.get("sasl_username"), sasl_password=s.get("sasl_password"), ssl_cafile=s.get("ssl_cafile"),
        ))

    def bus_toml(self) -> str:
        """The ``[bus]`` lines a worker process's run config needs to reach this cluster."""
        lines = [f'bootstrap = "{self.bootstrap}"']
        if self.security:
            lines += [
                f'security_protocol = "{self.security["security_protocol"]}"',
                f'sasl_mechanism = "{self.security["sasl_mechanism"]}"',
                f'sasl_username = "{self.security["sasl_username"]}"',
                f'sasl_password_file = "{self.home / CHAOS_USER}.password"',
                f'ssl_cafile = "{self.security["ssl_cafile"]}"',
            ]
        return "\n".join(lines)

    def state(self, prefix: str) -> RedisStateStore:
        return RedisStateStore.from_url(self.redis.url, key_prefix=prefix, reconnect=True)

    async def fresh_topics(self, bus: KafkaBus) -> None:
        """Delete every rlbus topic (and with it the groups' offsets) and create them again.

        Each step waits until *every* broker's metadata agrees: a broker that still lists a deleted topic
        would make ``create_topics`` skip it, and one that does not know a new topic yet would answer a
        worker with TopicNotFound (auto-create is off) and stop it.
        """
        specs = topic_specs(replication=self.replication, partitions=PARTITIONS)
        names = sorted(s.name for s in specs)
        doomed = [t for t in await bus.list_topics() if t in names]
        if doomed:
            await bus.admin.delete_topics(doomed)
        await self.wait_metadata(bus, names, present=False)
        for attempt in range(50):
            try:
                await bus.create_topics(specs)
                break
            except Exception:  # the controller may still be finishing the deletion
                if attempt == 49:
                    raise
                await asyncio.sleep(0.2)
        await self.wait_metadata(bus, names, present=True)

    async def wait_metadata(self, bus: KafkaBus, names: list[str], *, present: bool, timeout_s: float = 30.0) -> None:
        """Until every broker's metadata shows ``names`` created (with leaders) or deleted."""
        from aiokafka.protocol.metadata import MetadataRequest

        client = bus.admin._client
        deadline = time.monotonic() + timeout_s
        for node in self.cluster.nodes:
            while True:
                topics = (await client.send(node.node_id, MetadataRequest(names))).to_object()["topics"]
                if present:
                    done = len(topics) == len(names) and all(
                        t["error_code"] == 0 and t["partitions"] and all(p["leader"] >= 0 for p in t["partitions"])
                        for t in topics
                    )
                else:
                    done = all(t["error_code"] == 3 for t in topics)  # UNKNOWN_TOPIC_OR_PARTITION
                if done:
                    break
                if time.monotonic() > deadline:
                    state = "created" if present else "deleted"
                    raise ServiceError(f"Kafka node {node.node_id}: topics not {state} after {timeout_s:.0f} s")
                await asyncio.sleep(0.1)

    # --- faults --------------------------------------------------------------------------------
    def kill_broker(self, node_id: int) -> int:
        """SIGKILL one broker (no clean shutdown: no leadership hand-off, no log flush). Returns its pid."""
        node = self.cluster.nodes[node_id - 1]
        pid = kafka.node_pid(node)
        if pid is None:
            raise ServiceError(f"Kafka node {node_id} is not running")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while kafka.node_pid(node) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        return pid

    def restart_brokers(self, timeout_s: float = 120.0) -> None:
        """Start every stopped node again on its data directory and wait until all brokers serve."""
        kafka.start(
            brokers=len(self.cluster.nodes), port=self.cluster.nodes[0].port, home=self.home, timeout_s=timeout_s,
            secure=self.cluster.secure,
        )

    def kill_redis(self) -> None:
        """SIGKILL the Redis server: whatever it acknowledged must be in its append-only file."""
        self.redis.process.kill()
        self.redis.process.wait()

    def restart_redis(self) -> None:
        """Start Redis again on the same port and directory; it reloads the append-only file."""
        self.redis = start_redis(self.redis.port, dir=self.redis.dir, persist=True)


@dataclass(frozen=True)
class _RedisAt:
    """A Redis someone else runs: only its URL (nothing of ours to kill or restart)."""

    url: str


@dataclass
class SharedServices(ChaosRig):
    """A Kafka and a Redis someone else runs — the test suite's broker on 127.0.0.1:9092 and its Redis —
    for scenarios that break rlbus processes only, never the services: their run namespace keeps their
    topics, consumer groups and Redis keys apart from everyone else's, and no broker of a private cluster
    has to start first (20-60 s on two cores). The service faults (`kill_broker`, `kill_redis` …) are not
    for this rig, and `stop` stops nothing."""

    address: str = ""

    @classmethod
    def at(cls, home: Path, bootstrap: str, redis_url: str) -> SharedServices:
        home.mkdir(parents=True, exist_ok=True)
        return cls(home=home, cluster=cast(kafka.KafkaCluster, None), redis=cast(RedisServer, _RedisAt(redis_url)),
                   address=bootstrap)

    @property
    def bootstrap(self) -> str:
        return self.address

    @property
    def replication(self) -> int:
        return 1

    def stop(self) -> None:
        """Nothing: the services are not ours."""

    async def wait_metadata(self, bus: KafkaBus, names: list[str], *, present: bool, timeout_s: float = 30.0) -> None:
        """Until the broker lists ``names`` (or none of them)."""
        deadline = time.monotonic() + timeout_s
        while True:
            listed = set(await bus.list_topics())
            if (set(names) <= listed) if present else not (set(names) & listed):
                return
            if time.monotonic() > deadline:
                raise ServiceError(f"Kafka at {self.address}: topics not {'created' if present else 'deleted'} "
                                   f"after {timeout_s:.0f} s")
            await asyncio.sleep(0.1)
