"""Run a local Apache Kafka cluster (KRaft) from its Maven Central jars, without Docker.

The local cluster must be the real broker the workers meet in production, yet many developer and CI
machines have Java but no Docker engine. So Maven resolves the broker pinned in
``infra/kafka/pom.xml`` once into a cache, and every node runs as a detached JVM whose state lives
under ``<home>/kafka/``. Data survives ``stop``/``start`` (topics and offsets persist) until
``fresh=True`` wipes it. Every node is both broker and controller and votes in a static quorum.

Ports, for ``brokers = n`` and ``port = p``: node ``i`` (1..n) serves clients on ``p + 2(i-1)`` and
its controller on ``p + 2(i-1) + 1``; one broker takes p and p+1, three take p..p+5. Replication
follows the size: factor ``min(n, 3)``, min in-sync replicas one less (at least 1).

Racks: on more than one node, node ``i`` gets ``broker.rack`` = ``racks[i-1]`` (a region name; default
``eu-west``, ``us-east``, ``ap-south`` in turn) and the RackAwareReplicaSelector, so topic creation spreads
each partition's replicas over the racks and a consumer with ``client.rack`` reads from a replica in its own
region (KIP-392 follower fetching). ``RLBUS_KAFKA_REQUEST_LOG=debug`` in the environment of ``start`` makes
every node log each request it serves to ``requests.log`` (which broker served which client's fetch).

Region listeners (``region_ports = {region: (l, a)}``, for an emulated WAN, :mod:`rlbus_tools.services.wan`): node
``i`` also listens on ``l + (i-1)`` (PLAINTEXT, listener ``WAN_<REGION>``) and advertises ``a + (i-1)`` there,
the port of that region's proxy in front of it, so a client that bootstraps from its region's proxies keeps
talking to every broker through them.

Authentication (optional, ``sasl_port = s``): node ``i`` also listens on ``s + (i-1)`` with
SASL_PLAINTEXT and the SCRAM-SHA-256/512 mechanisms; users are created through the admin API
with Kafka's Admin client (:mod:`rlbus_tools.services.kafka_admin`), so no password is ever a command-line
argument. The PLAINTEXT listener stays for inter-broker traffic and local administration: this
authenticates clients for development, it is not a hardened deployment.

Security (``secure = True``, :mod:`rlbus_tools.services.kafka_secure`): no PLAINTEXT anywhere. Clients speak
SASL_SSL (SCRAM) on the client port, brokers and controllers talk mutual TLS, the administrator holds a
client certificate for the nodes' internal listener (``internal_port + (i-1)``), and the
StandardAuthorizer refuses whatever no ACL allows (:mod:`rlbus.security.kafka_acl` grants each role its
own).

Files::

    <cache>/kafka-<version>/jars/       runtime classpath; .resolved holds the pom's sha256
    <home>/kafka/cluster.json           cluster id and layout, written once storage is formatted
    <home>/kafka/node-<i>/              server.properties, log4j2.properties, data/,
                                        kafka.pid, kafka.out (JVM stdout/stderr), server.log (WARN+),
                                        security.log (denied requests, failed authentications),
                                        requests.log (with RLBUS_KAFKA_REQUEST_LOG=debug)

``<cache>`` and ``<home>`` default to ``$RLBUS_HOME`` or ``~/.cache/rlbus``. The pom is found next
to the package (``<repo>/infra/kafka/pom.xml``) or at ``$RLBUS_KAFKA_POM``; the node templates
(``server.properties``, ``log4j2.properties``) are read from the pom's directory.

Command line: ``python -m rlbus_tools.services.kafka {resolve,start,stop,status}``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from rlbus.errors import ConfigError, RlbusError, ServiceError
from rlbus.security import kafka_broker
from rlbus_tools.services import kafka_secure
from rlbus_tools.services.kafka_jars import default_home, pom_path, require_program, resolve_jars, tail

HOST = "127.0.0.1"
JVM_OPTS = ("-Xms256m", "-Xmx512m", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")
STOP_GRACE_S = 30.0
#: The racks (regions) of a multi-node cluster's nodes when none are given, in turn.
DEFAULT_RACKS = ("eu-west", "us-east", "ap-south")
#: Lets a follower in the consumer's ``client.rack`` serve its fetches (KIP-392).
RACK_AWARE_SELECTOR = "org.apache.kafka.common.replica.RackAwareReplicaSelector"

# Nodes launched by this process. Holding the Popen lets poll() reap a node that exited, so a
# zombie never passes for a live broker, and keeps garbage collection from warning about it.
_children: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class RegionListener:
    """A node's listener for the clients of one region: it binds ``port`` and advertises ``advertised_port``."""

    region: str
    port: int
    advertised_port: int

    @property
    def name(self) -> str:
        """The Kafka listener name, ``WAN_US_EAST`` for ``us-east``."""
        return "WAN_" + "".join(c if c.isalnum() else "_" for c in self.region.upper())


@dataclass(frozen=True)
class KafkaNode:
    """One combined broker + controller process and the directory that holds its state."""

    node_id: int
    port: int
    controller_port: int
    dir: Path
    #: SASL_PLAINTEXT (SCRAM) client listener, when authentication is on.
    sasl_port: int | None = None
    #: A secure cluster's mutual-TLS listener for inter-broker traffic and the administrator.
    internal_port: int | None = None
    #: ``broker.rack``: the region this node stands for (None on a single node).
    rack: str | None = None
    #: Listeners for an emulated WAN's regions (see :mod:`rlbus_tools.services.wan`).
    region_listeners: tuple[RegionListener, ...] = ()

    def region_listener(self, region: str) -> RegionListener:
        for listener in self.region_listeners:
            if listener.region == region:
                return listener
        raise ConfigError("region_ports", f"node {self.node_id} has no listener for region {region!r}")

    @property
    def config(self) -> Path:
        return self.dir / "server.properties"

    @property
    def log4j_config(self) -> Path:
        return self.dir / "log4j2.properties"

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def pid_file(self) -> Path:
        return self.dir / "kafka.pid"

    @property
    def out_file(self) -> Path:
        return self.dir / "kafka.out"

    @property
    def log_file(self) -> Path:
        return self.dir / "server.log"

    @property
    def security_log(self) -> Path:
        """Denied requests and failed authentications (see infra/kafka/log4j2.properties)."""
        return self.dir / "security.log"

    @property
    def request_log(self) -> Path:
        """Every request the node served, when started with ``RLBUS_KAFKA_REQUEST_LOG=debug``."""
        return self.dir / "requests.log"


@dataclass(frozen=True)
class KafkaCluster:
    """A formatted local cluster: where it lives, its id and its nodes."""

    home: Path
    cluster_id: str
    nodes: tuple[KafkaNode, ...]
    #: TLS everywhere, SCRAM on the client listener, ACLs enforced (see :mod:`rlbus_tools.services.kafka_secure`).
    secure: bool = False
    #: Clients must also present a certificate signed by the cluster's CA (secure clusters only).
    mtls: bool = False

    @property
    def bootstrap(self) -> str:
        """The client listeners (SASL_SSL on a secure cluster, PLAINTEXT otherwise)."""
        return ",".join(f"{HOST}:{node.port}" for node in self.nodes)

    @property
    def internal_bootstrap(self) -> str | None:
        """A secure cluster's mutual-TLS listeners (brokers and the administrator), else None."""
        if not self.secure:
            return None
        return ",".join(f"{HOST}:{node.internal_port}" for node in self.nodes)

    @property
    def sasl_bootstrap(self) -> str | None:
        """The SASL_PLAINTEXT listeners, or None when the cluster has no SASL listener."""
        if self.nodes[0].sasl_port is None:
            return None
        return ",".join(f"{HOST}:{node.sasl_port}" for node in self.nodes)

    @property
    def racks(self) -> tuple[str, ...] | None:
        """Each node's ``broker.rack``, or None when the nodes have none."""
        if self.nodes[0].rack is None:
            return None
        return tuple(node.rack or "" for node in self.nodes)

    @property
    def region_ports(self) -> dict[str, tuple[int, int]]:
        """Per region, the first node's (listener port, advertised port); empty without region listeners."""
        return {r.region: (r.port, r.advertised_port) for r in self.nodes[0].region_listeners}

    def region_bootstrap(self, region: str) -> str:
        """The advertised addresses of ``region``'s listeners (its proxies, in an emulated WAN)."""
        return ",".join(f"{HOST}:{node.region_listener(region).advertised_port}" for node in self.nodes)

    @property
    def replication_factor(self) -> int:
        return min(len(self.nodes), 3)

    @property
    def min_insync_replicas(self) -> int:
        return max(1, self.replication_factor - 1)


# --- cluster layout --------------------------------------------------------------------------


def layout(
    home: Path, brokers: int, port: int, cluster_id: str, sasl_port: int | None = None, *,
    secure: bool = False, internal_port: int | None = None, mtls: bool = False,
    racks: Sequence[str] | None = None, region_ports: Mapping[str, Sequence[int]] | None = None,
) -> KafkaCluster:
    """The nodes of a ``brokers``-node cluster whose first client port is ``port`` (and first SASL
    listener ``sasl_port``, when given). A ``secure`` cluster's client listeners speak SASL_SSL and its
    nodes also listen with mutual TLS from ``internal_port`` (default: right after the controllers).
    ``racks`` names each node's ``broker.rack`` (default: :data:`DEFAULT_RACKS` in turn on more than one
    node, none on a single node; an empty sequence: none)."""
    if brokers < 1:
        raise ConfigError("brokers", f"must be at least 1, got {brokers}")
    if not 1 <= port <= 65535 - 2 * brokers:
        raise ConfigError("port", f"{port} leaves no room for {brokers} nodes' ports")
    if sasl_port is not None and not 1 <= sasl_port <= 65535 - brokers:
        raise ConfigError("sasl_port", f"{sasl_port} leaves no room for {brokers} SASL listeners")
    if secure and sasl_port is not None:
        raise ConfigError("sasl_port", "a secure cluster's client listeners are SASL_SSL already: drop sasl_port")
    if mtls and not secure:
        raise ConfigError("mtls", "mutual TLS needs a secure cluster (secure=True)")
    if secure and internal_port is None:
        internal_port = port + 2 * brokers
    if internal_port is not None and not 1 <= internal_port <= 65535 - brokers:
        raise ConfigError("internal_port", f"{internal_port} leaves no room for {brokers} internal listeners")
    node_racks = _racks(brokers, racks)
    if region_ports and secure:
        raise ConfigError("region_ports", "region listeners are PLAINTEXT (an emulated WAN): not on a secure cluster")
    for region, (first, advertised) in (region_ports or {}).items():
        if not 1 <= min(first, advertised) <= max(first, advertised) <= 65535 - brokers:
            raise ConfigError("region_ports", f"{region}: {first}, {advertised} leave no room for {brokers} nodes")
    nodes = tuple(
        _node(
            home, i, port + 2 * (i - 1), None if sasl_port is None else sasl_port + i - 1,
            None if internal_port is None else internal_port + i - 1, node_racks[i - 1],
            tuple(
                RegionListener(region, first + i - 1, advertised + i - 1)
                for region, (first, advertised) in (region_ports or {}).items()
            ),
        )
        for i in range(1, brokers + 1)
    )
    return KafkaCluster(home=home, cluster_id=cluster_id, nodes=nodes, secure=secure, mtls=mtls)


def _racks(brokers: int, racks: Sequence[str] | None) -> list[str | None]:
    if racks is None:
        return [None] if brokers == 1 else [DEFAULT_RACKS[i % len(DEFAULT_RACKS)] for i in range(brokers)]
    if not racks:
        return [None] * brokers
    if len(racks) != brokers:
        raise ConfigError("racks", f"{len(racks)} racks for {brokers} brokers: give one per broker")
    for rack in racks:
        if not rack or not all(c.isalnum() or c in "-_." for c in rack):
            raise ConfigError("racks", f"{rack!r} is not a rack name (letters, digits, '-', '_', '.')")
    return list(racks)


def _node(
    home: Path, node_id: int, port: int, sasl_port: int | None = None, internal_port: int | None = None,
    rack: str | None = None, region_listeners: tuple[RegionListener, ...] = (),
) -> KafkaNode:
    return KafkaNode(
        node_id=node_id, port=port, controller_port=port + 1, dir=home / "kafka" / f"node-{node_id}",
        sasl_port=sasl_port, internal_port=internal_port, rack=rack, region_listeners=region_listeners,
    )


def _cluster_file(home: Path) -> Path:
    return home / "kafka" / "cluster.json"


def load_cluster(home: Path) -> KafkaCluster | None:
    """The cluster formatted under ``home``, or None when there is none."""
    path = _cluster_file(home)
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return layout(
        home, saved["brokers"], saved["port"], saved["cluster_id"], saved.get("sasl_port"),
        secure=saved.get("secure", False), internal_port=saved.get("internal_port"), mtls=saved.get("mtls", False),
        racks=saved.get("racks") or (), region_ports=saved.get("region_ports"),
    )


def _new_cluster_id() -> str:
    # Kafka's Uuid.randomUuid().toString(): URL-safe base64 of 16 random bytes, unpadded, never
    # starting with "-" (it would read as a command-line flag). Saves a JVM start over StorageTool.
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def node_config(cluster: KafkaCluster, node: KafkaNode) -> str:
    """The node's server.properties: the template next to the pom, filled in for this node."""
    template = (pom_path().parent / "server.properties").read_text()
    voters = ",".join(f"{n.node_id}@{HOST}:{n.controller_port}" for n in cluster.nodes)
    text = string.Template(template).substitute(
        node_id=node.node_id,
        quorum_voters=voters,
        broker_port=node.port,
        controller_port=node.controller_port,
        data_dir=node.data_dir,
        replication_factor=cluster.replication_factor,
        min_insync_replicas=cluster.min_insync_replicas,
    )
    if cluster.secure:
        settings = kafka_secure.secure_settings(cluster, node, HOST)
        text = with_settings(text, settings, "TLS, SCRAM and ACLs (rlbus kafka start --secure)")
    elif node.sasl_port is not None:
        text = _with_sasl_listener(text, node)
    if node.region_listeners:
        text = _with_region_listeners(text, node)
    if node.rack is None:
        return text
    racks = {"broker.rack": node.rack, "replica.selector.class": RACK_AWARE_SELECTOR}
    return with_settings(text, racks, "This node's region; consumers read from a replica in theirs (KIP-392)")


def _with_sasl_listener(config: str, node: KafkaNode) -> str:
    """Add a SASL_PLAINTEXT listener with the SCRAM mechanisms to a rendered server.properties."""
    sasl = f"SASL_PLAINTEXT://{HOST}:{node.sasl_port}"
    settings = {
        "listeners": f"PLAINTEXT://{HOST}:{node.port},CONTROLLER://{HOST}:{node.controller_port},{sasl}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{node.port},{sasl}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
        "sasl.enabled.mechanisms": "SCRAM-SHA-256,SCRAM-SHA-512",
        "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config": kafka_broker.SCRAM_LOGIN,
        "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config": kafka_broker.SCRAM_LOGIN,
    }
    return with_settings(config, settings, "SASL_PLAINTEXT listener for clients (rlbus kafka start --sasl-port)")


def _with_region_listeners(config: str, node: KafkaNode) -> str:
    """Add one PLAINTEXT listener per region, advertising that region's proxy (see :mod:`rlbus_tools.services.wan`)."""
    current = dict(line.split("=", 1) for line in config.splitlines() if "=" in line and not line.startswith("#"))
    wan = node.region_listeners
    settings = {
        "listeners": ",".join([current["listeners"], *(f"{r.name}://{HOST}:{r.port}" for r in wan)]),
        "advertised.listeners": ",".join(
            [current["advertised.listeners"], *(f"{r.name}://{HOST}:{r.advertised_port}" for r in wan)]
        ),
        "listener.security.protocol.map": ",".join(
            [current["listener.security.protocol.map"], *(f"{r.name}:PLAINTEXT" for r in wan)]
        ),
    }
    return with_settings(config, settings, "One listener per region, advertised as its proxy (services.wan)")


def with_settings(config: str, settings: Mapping[str, str], comment: str) -> str:
    """A rendered server.properties with ``settings`` replacing the template's keys in place and the new
    ones appended under ``# comment``."""
    settings = dict(settings)
    lines = []
    for line in config.splitlines():
        key = line.split("=", 1)[0].strip()
        lines.append(f"{key}={settings.pop(key)}" if key in settings else line)
    if settings:
        lines += ["", f"# {comment}"]
        lines += [f"{key}={value}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def _write_node_files(cluster: KafkaCluster, node: KafkaNode) -> None:
    node.dir.mkdir(parents=True, exist_ok=True)
    node.config.touch(mode=0o600)  # a secure node's file holds its keystore password
    node.config.write_text(node_config(cluster, node))
    shutil.copyfile(pom_path().parent / "log4j2.properties", node.log4j_config)


# --- processes -------------------------------------------------------------------------------


def _java_command(node: KafkaNode, jars: Path, heap: Sequence[str], *args: str) -> list[str]:
    return [
        require_program("java", "openjdk-17-jre-headless"),
        *heap,
        f"-Dlog4j2.configurationFile={node.log4j_config}",
        f"-Drlbus.kafka.log={node.log_file}",
        f"-Drlbus.kafka.dir={node.dir}",
        "-cp",
        f"{jars}/*",
        *args,
    ]


def _format(cluster: KafkaCluster, jars: Path) -> None:
    # A fresh home only: a half-formatted one (no cluster.json) is discarded rather than patched.
    shutil.rmtree(cluster.home / "kafka", ignore_errors=True)
    if cluster.secure:
        kafka_secure.issue_certificates(cluster)
        kafka_secure.admin_bus_file(cluster)
    for node in cluster.nodes:
        _write_node_files(cluster, node)
        tool = ("kafka.tools.StorageTool", "format", "-t", cluster.cluster_id, "-c", str(node.config))
        done = subprocess.run(
            _java_command(node, jars, ("-Xmx256m",), *tool), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise ServiceError(f"formatting Kafka node {node.node_id} failed:\n{tail(done.stdout + done.stderr)}")
    saved = {
        "cluster_id": cluster.cluster_id,
        "brokers": len(cluster.nodes),
        "port": cluster.nodes[0].port,
        "sasl_port": cluster.nodes[0].sasl_port,
        "secure": cluster.secure,
        "internal_port": cluster.nodes[0].internal_port,
        "mtls": cluster.mtls,
        "racks": cluster.racks,
        "region_ports": cluster.region_ports or None,
    }
    _cluster_file(cluster.home).write_text(json.dumps(saved, indent=2) + "\n")


def _check_ports_free(nodes: Iterable[KafkaNode]) -> None:
    for node in nodes:
        ports = (node.port, node.controller_port, node.sasl_port, node.internal_port)
        for port in (*ports, *(r.port for r in node.region_listeners)):
            if port is not None and _listening(port):
                raise ServiceError(f"port {port} for Kafka node {node.node_id} is in use by another process")


def _launch(cluster: KafkaCluster, node: KafkaNode, jars: Path) -> None:
    _write_node_files(cluster, node)
    command = _java_command(node, jars, JVM_OPTS, "kafka.Kafka", str(node.config))
    with node.out_file.open("ab") as out:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=node.dir,
            start_new_session=True,
        )
    _children[proc.pid] = proc
    node.pid_file.write_text(f"{proc.pid}\n")


def _is_node_process(pid: int, node: KafkaNode) -> bool:
    child = _children.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    # Guards against a recycled pid; a zombie's cmdline is empty, so it counts as gone.
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not Path("/proc/self").exists():
        return True
    try:
        return str(node.config).encode() in cmdline.read_bytes()
    except OSError:
        return False


def node_pid(node: KafkaNode) -> int | None:
    """The pid of the node's running JVM, or None (a stale pid file is removed)."""
    try:
        pid = int(node.pid_file.read_text())
    except (FileNotFoundError, ValueError):
        return None
    if _is_node_process(pid, node):
        return pid
    node.pid_file.unlink(missing_ok=True)
    _children.pop(pid, None)
    return None


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((HOST, port)) == 0




def logtail(node: KafkaNode) -> str:
    """The last lines of the node's JVM output and of its WARN+ server log."""
    parts = []
    for path in (node.out_file, node.log_file):
        if path.is_file():
            parts.append(f"--- {path}\n{tail(path.read_text(errors='replace'))}")
    return "\n".join(parts) or f"(no logs under {node.dir})"


# --- readiness -------------------------------------------------------------------------------


async def _registered_brokers(cluster: KafkaCluster) -> int:
    admin = AIOKafkaAdminClient(**admin_kwargs(cluster), request_timeout_ms=5000)
    try:
        async with asyncio.timeout(10):
            await admin.start()
        async with asyncio.timeout(10):
            described = await admin.describe_cluster()
        return len(described["brokers"])
    except (KafkaError, OSError, TimeoutError):
        return 0
    finally:
        await admin.close()


def _wait_ready(cluster: KafkaCluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for node in cluster.nodes:
            if node_pid(node) is None:
                raise ServiceError(f"Kafka node {node.node_id} exited during start-up:\n{logtail(node)}")
        if all(_listening(n.port) for n in cluster.nodes):
            if asyncio.run(_registered_brokers(cluster)) == len(cluster.nodes):
                return
        if time.monotonic() > deadline:
            tails = "\n".join(logtail(n) for n in cluster.nodes)
            raise ServiceError(f"Kafka at {cluster.bootstrap} not ready after {timeout_s:.0f} s:\n{tails}")
        time.sleep(0.5)


def admin_kwargs(cluster: KafkaCluster) -> dict[str, Any]:
    """aiokafka connection settings with the administrator's rights: PLAINTEXT on a plain cluster, the
    administrator's certificate on a secure cluster's mutual-TLS listener."""
    if not cluster.secure:
        return {"bootstrap_servers": cluster.bootstrap}
    return {
        "bootstrap_servers": cluster.internal_bootstrap,
        "security_protocol": "SSL",
        "ssl_context": kafka_secure.admin_ssl_context(cluster),
    }


def admin_client_properties(cluster: KafkaCluster) -> dict[str, str]:
    """The same, as Java client properties (for Kafka's Admin client, :mod:`rlbus_tools.services.kafka_admin`)."""
    if not cluster.secure:
        return {"bootstrap.servers": cluster.bootstrap}
    return kafka_secure.admin_java_properties(cluster)


# --- public operations -----------------------------------------------------------------------


def start(
    brokers: int = 1,
    port: int = 9092,
    fresh: bool = False,
    home: Path | None = None,
    timeout_s: float = 120.0,
    cache_dir: Path | None = None,
    *,
    sasl_port: int | None = None,
    scram_users: Mapping[str, str] | None = None,
    scram_mechanism: str = "SCRAM-SHA-512",
    secure: bool = False,
    internal_port: int | None = None,
    mtls: bool = False,
    racks: Sequence[str] | None = None,
    region_ports: Mapping[str, Sequence[int]] | None = None,
) -> KafkaCluster:
    """Start (or find running) the local cluster under ``home`` and wait until all brokers serve.

    Storage is formatted on first use and kept afterwards; ``fresh=True`` stops the cluster and
    wipes it first. Nodes already running are left alone. Blocking: from async code, call it in a
    thread. Raises ServiceError (with the broker log's tail) when a node fails or times out, and
    ConfigError when ``home`` holds a cluster of another size or port.

    ``sasl_port`` adds a SASL_PLAINTEXT (SCRAM) client listener to every node (kept with the
    layout; None keeps whatever the cluster has); ``scram_users`` (name → password) are created or
    updated once the brokers serve, with ``scram_mechanism``.

    ``secure`` formats a cluster with TLS on every listener, SCRAM on the client listeners, the
    StandardAuthorizer with nothing allowed without an ACL, and a local CA under ``<home>/kafka/tls``
    (:mod:`rlbus_tools.services.kafka_secure`); ``mtls`` also requires client certificates there. Both are
    kept with the layout.

    ``racks`` names each node's ``broker.rack`` on a new cluster (see :func:`layout`); given for an existing
    cluster, they must be its racks. ``region_ports`` (``{region: (first listener port, first advertised
    port)}``) adds a listener per region (see the module docstring); kept with the layout likewise.
    """
    home = (home or default_home()).expanduser().resolve()
    if fresh:
        stop(home)
        shutil.rmtree(home / "kafka", ignore_errors=True)
    jars = resolve_jars(cache_dir)
    existing = load_cluster(home)
    cluster = existing or layout(
        home, brokers, port, _new_cluster_id(), sasl_port, secure=secure, internal_port=internal_port, mtls=mtls,
        racks=racks, region_ports=region_ports,
    )
    _check_layout(cluster, brokers, port)
    if (secure or mtls) and (cluster.secure, cluster.mtls) != (secure, mtls):
        raise ConfigError(
            "secure",
            f"{cluster.home} holds a cluster with secure={cluster.secure}, mtls={cluster.mtls}; "
            "stop it and start with fresh=True to replace it",
        )
    if sasl_port is not None and cluster.nodes[0].sasl_port != sasl_port:
        raise ConfigError(
            "sasl_port",
            f"{cluster.home} holds a cluster with SASL port {cluster.nodes[0].sasl_port}, not {sasl_port}; "
            "stop it and start with fresh=True to replace it",
        )
    if racks is not None and cluster.racks != (tuple(racks) or None):
        raise ConfigError(
            "racks",
            f"{cluster.home} holds a cluster with racks {cluster.racks}, not {tuple(racks)}; "
            "stop it and start with fresh=True to replace it",
        )
    if region_ports is not None and cluster.region_ports != {r: tuple(p) for r, p in region_ports.items()}:
        raise ConfigError(
            "region_ports",
            f"{cluster.home} holds a cluster with region listeners {cluster.region_ports}, not {dict(region_ports)}; "
            "stop it and start with fresh=True to replace it",
        )
    stopped = [node for node in cluster.nodes if node_pid(node) is None]
    _check_ports_free(stopped)
    if existing is None:
        _format(cluster, jars)
    for node in stopped:
        _launch(cluster, node, jars)
    _wait_ready(cluster, timeout_s)
    if scram_users:
        if cluster.sasl_bootstrap is None and not cluster.secure:
            raise ConfigError("sasl_port", "SCRAM users need a SASL listener: give a sasl_port or secure=True")
        from rlbus_tools.services.kafka_admin import upsert_scram_users

        upsert_scram_users(admin_client_properties(cluster), scram_users, mechanism=scram_mechanism, jars=jars)
    return cluster


def _check_layout(cluster: KafkaCluster, brokers: int, port: int) -> None:
    have = (len(cluster.nodes), cluster.nodes[0].port)
    if have == (brokers, port):
        return
    field = "brokers" if have[0] != brokers else "port"
    raise ConfigError(
        field,
        f"{cluster.home} holds a {have[0]}-broker cluster on port {have[1]}, not {brokers} on {port}; "
        "stop it and start with fresh=True to replace it",
    )


def stop(home: Path | None = None, grace_s: float = STOP_GRACE_S) -> None:
    """Stop every node under ``home``: SIGTERM, then SIGKILL after ``grace_s``. Data is kept."""
    cluster = load_cluster((home or default_home()).expanduser().resolve())
    if cluster is None:
        return
    running = {node: pid for node in cluster.nodes if (pid := node_pid(node)) is not None}
    # All at once: stopped one by one, the last nodes lose their controller quorum and hang.
    _signal_all(running.values(), signal.SIGTERM)
    left = _wait_exit(running, grace_s)
    _signal_all(left.values(), signal.SIGKILL)
    _wait_exit(left, 10.0)
    for node in cluster.nodes:
        node.pid_file.unlink(missing_ok=True)


def _signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_exit(running: dict[KafkaNode, int], timeout_s: float) -> dict[KafkaNode, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        running = {node: pid for node, pid in running.items() if _is_node_process(pid, node)}
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def status(home: Path | None = None) -> dict[str, Any]:
    """Per node: pid, alive, ports, listening; plus the bootstrap string and whether all serve."""
    home = (home or default_home()).expanduser().resolve()
    cluster = load_cluster(home)
    if cluster is None:
        return {"home": str(home), "formatted": False, "running": False, "bootstrap": None, "nodes": []}
    nodes = [_node_status(node) for node in cluster.nodes]
    return {
        "home": str(home),
        "formatted": True,
        "running": all(n["alive"] and n["listening"] for n in nodes),
        "cluster_id": cluster.cluster_id,
        "bootstrap": cluster.bootstrap,
        "secure": cluster.secure,
        "mtls": cluster.mtls,
        "racks": cluster.racks,
        "nodes": nodes,
    }


def _node_status(node: KafkaNode) -> dict[str, Any]:
    pid = node_pid(node)
    return {
        "node_id": node.node_id,
        "pid": pid,
        "alive": pid is not None,
        "port": node.port,
        "controller_port": node.controller_port,
        "sasl_port": node.sasl_port,
        "internal_port": node.internal_port,
        "rack": node.rack,
        "listening": pid is not None and _listening(node.port),
        "dir": str(node.dir),
    }


# --- command line ----------------------------------------------------------------------------


def scram_users_from(user: str | None, password_file: Path | None) -> dict[str, str] | None:
    """``{user: password}`` with the password read from ``password_file`` or ``$RLBUS_SASL_PASSWORD``
    (never from the command line, where other local users could read it); None without a user."""
    if user is None:
        return None
    from rlbus.config import secret_from

    password = secret_from(None, password_file, "RLBUS_SASL_PASSWORD", field="scram_password")
    if password is None:
        raise ConfigError("scram_password", "set RLBUS_SASL_PASSWORD or give --scram-password-file")
    return {user: password}



def parse_racks(text: str) -> tuple[str, ...]:
    """``"eu-west,us-east,ap-south"`` → one rack per broker; ``""`` → none."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rlbus_tools.services.kafka", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    resolve = commands.add_parser("resolve", help="resolve the broker jars with Maven")
    resolve.add_argument("--cache-dir", type=Path)
    run = commands.add_parser("start", help="start the local cluster and wait until it serves")
    run.add_argument("--brokers", type=int, default=1)
    run.add_argument("--port", type=int, default=9092)
    run.add_argument("--fresh", action="store_true", help="wipe existing data first")
    run.add_argument("--timeout", type=float, default=120.0)
    run.add_argument("--cache-dir", type=Path)
    run.add_argument("--sasl-port", type=int, help="add a SASL_PLAINTEXT (SCRAM) listener from this port")
    run.add_argument(
        "--scram-user",
        help="create this SCRAM-SHA-512 user; its password comes from $RLBUS_SASL_PASSWORD or --scram-password-file",
    )
    run.add_argument("--scram-password-file", type=Path, help="file holding the SCRAM user's password")
    run.add_argument("--secure", action="store_true", help="TLS on every listener, SCRAM for clients, ACLs enforced")
    run.add_argument("--mtls", action="store_true", help="with --secure: clients must also present a certificate")
    run.add_argument("--internal-port", type=int, help="with --secure: first mutual-TLS (inter-broker, admin) port")
    run.add_argument("--racks", type=parse_racks, help="each broker's rack (region), comma-separated")
    for name in ("start", "stop", "status"):
        sub = run if name == "start" else commands.add_parser(name, help=f"{name} the local cluster")
        sub.add_argument("--home", type=Path)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "resolve":
            print(resolve_jars(args.cache_dir))
        elif args.command == "start":
            began = time.monotonic()
            users = scram_users_from(args.scram_user, args.scram_password_file)
            cluster = start(
                args.brokers, args.port, args.fresh, args.home, args.timeout, args.cache_dir,
                sasl_port=args.sasl_port, scram_users=users, secure=args.secure, mtls=args.mtls,
                internal_port=args.internal_port, racks=args.racks,
            )
            print(f"kafka ready at {cluster.bootstrap} in {time.monotonic() - began:.1f} s ({cluster.home})")
            if cluster.racks:
                print(f"racks (broker.rack, node 1..n): {','.join(cluster.racks)}")
            if cluster.sasl_bootstrap:
                print(f"SASL_PLAINTEXT (SCRAM) listeners at {cluster.sasl_bootstrap}")
            if cluster.secure:
                print(kafka_secure.describe_secure(cluster))
        elif args.command == "stop":
            stop(args.home)
        else:
            print(json.dumps(status(args.home), indent=2))
    except RlbusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
