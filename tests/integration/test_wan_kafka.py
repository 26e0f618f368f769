"""Kafka across an emulated WAN: three brokers in three regions, each region reaching every broker through
its own Toxiproxy proxies (eu-west <-> us-east 40 ms one way, eu-west <-> ap-south 90 ms).

A region's client bootstraps from its proxies and the brokers advertise them back on the region's listener, so
all of its traffic takes its links; a us-east consumer reads a topic led in eu-west from the us-east replica.
Starts its own cluster and toxiproxy-server on free loopback ports (about 30-60 s on two cores); fails, never
skips, when Kafka or toxiproxy-server cannot start.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
import uuid
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from rlbus.config import KafkaBusConfig, build_bus, parse
from rlbus.errors import RlbusError
from rlbus_tools.services import free_port_run, kafka, toxiproxy, wan

REGIONS = ("eu-west", "us-east", "ap-south")
TOPOLOGY = wan.Topology(
    home="eu-west",
    regions=REGIONS,
    links={
        ("eu-west", "us-east"): toxiproxy.Link(latency_ms=40),
        ("eu-west", "ap-south"): toxiproxy.Link(latency_ms=90, bandwidth_mbit=200),
    },
)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[kafka.KafkaCluster, wan.Wan]]:
    home = tmp_path_factory.mktemp("wan-kafka")
    try:
        with toxiproxy.running() as proxies:
            cluster = kafka.start(
                brokers=3, port=free_port_run(6), home=home, timeout_s=150,
                region_ports=wan.kafka_region_ports(REGIONS, brokers=3),
            )
            yield cluster, wan.connect(proxies, TOPOLOGY, kafka=cluster)
    except RlbusError as exc:
        pytest.fail(f"Kafka behind an emulated WAN could not start: {exc}", pytrace=False)
    finally:
        kafka.stop(home, grace_s=10)


def _api_versions_round_trip(port: int) -> float:
    """Seconds for one ApiVersions (v0) request and its answer, on a connection already open."""
    client = b"rlbus-wan-test"
    request = struct.pack(">hhih", 18, 0, 7, len(client)) + client
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        took = []
        for _ in range(3):
            began = time.perf_counter()
            sock.sendall(struct.pack(">i", len(request)) + request)
            (size,) = struct.unpack(">i", sock.recv(4, socket.MSG_WAITALL))
            answer = sock.recv(size, socket.MSG_WAITALL)
            assert struct.unpack(">i", answer[:4]) == (7,)
            took.append(time.perf_counter() - began)
    return min(took)


def test_a_region_is_advertised_its_own_proxies(emulated: tuple[kafka.KafkaCluster, wan.Wan]) -> None:
    cluster, made = emulated

    async def brokers(bootstrap: str) -> dict[int, tuple[int, str]]:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            described = await admin.describe_cluster()
        finally:
            await admin.close()
        return {b["node_id"]: (b["port"], b["rack"]) for b in described["brokers"]}

    us_east = made.regions["us-east"]
    seen = asyncio.run(brokers(us_east.bootstrap))
    assert seen == {
        node.node_id: (node.region_listener("us-east").advertised_port, node.rack) for node in cluster.nodes
    }
    assert {port for port, _ in seen.values()} == {made.proxies["us-east", f"kafka-{i}"].port for i in (1, 2, 3)}


def test_each_broker_is_as_far_as_its_region(emulated: tuple[kafka.KafkaCluster, wan.Wan]) -> None:
    _, made = emulated
    near = _api_versions_round_trip(made.proxies["us-east", "kafka-2"].port)  # us-east's own broker
    far = _api_versions_round_trip(made.proxies["us-east", "kafka-1"].port)  # eu-west, 40 ms each way
    farther = _api_versions_round_trip(made.proxies["ap-south", "kafka-1"].port)  # 90 ms each way
    assert near < 0.04, near  # each the fastest of three: a loaded machine adds delay, never removes it
    assert 0.08 <= far < 0.2, far
    assert farther >= 0.18, farther


def test_a_cut_isolates_the_region(emulated: tuple[kafka.KafkaCluster, wan.Wan]) -> None:
    _, made = emulated
    made.cut("us-east", "eu-west")
    try:
        with pytest.raises(OSError):
            _api_versions_round_trip(made.proxies["us-east", "kafka-1"].port)
        assert _api_versions_round_trip(made.proxies["us-east", "kafka-2"].port) < 0.04
        assert _api_versions_round_trip(made.proxies["ap-south", "kafka-1"].port) >= 0.18
    finally:
        made.restore("us-east", "eu-west")
    assert _api_versions_round_trip(made.proxies["us-east", "kafka-1"].port) >= 0.08


@pytest.mark.timeout(180)
def test_a_region_produces_and_consumes_through_its_proxies(emulated: tuple[kafka.KafkaCluster, wan.Wan]) -> None:
    _, made = emulated
    topic = f"test.wan.{uuid.uuid4().hex[:8]}"
    count = 20

    async def produce_then_consume() -> int:
        admin = AIOKafkaAdminClient(bootstrap_servers=made.regions["eu-west"].bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, -1, -1, replica_assignments={0: [1, 2, 3]})])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=made.regions["eu-west"].bootstrap, acks="all")
        await producer.start()
        try:
            for i in range(count):
                await producer.send_and_wait(topic, str(i).encode())
        finally:
            await producer.stop()
        us_east = made.regions["us-east"]
        config: KafkaBusConfig = parse(KafkaBusConfig, {"bootstrap": us_east.bootstrap, "region": "us-east"},
                                       prefix="bus")
        got = 0
        async with build_bus(config) as bus, bus.consumer([topic], group=None, from_beginning=True) as consumer:
            async with asyncio.timeout(60):
                while got < count:
                    got += len(await consumer.getmany(timeout_s=1.0))
        return got

    assert asyncio.run(produce_then_consume()) == count
