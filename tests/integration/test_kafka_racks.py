"""Rack-aware Kafka: brokers in two regions, replicas spread over them, a region's consumer served by its own.

Starts its own three-broker cluster (racks eu-west, eu-west, us-east: with two brokers in one region, only a
rack-aware placement puts every partition's two replicas in both regions) in a temporary home on free ports with
``RLBUS_KAFKA_REQUEST_LOG=debug``, so every broker writes each request it serves to its ``requests.log``. The
proof of follower fetching (KIP-392) comes from the brokers' side: the leader, in eu-west, answers a us-east
consumer's first fetch with no records and ``preferredReadReplica`` = the us-east broker, and that broker serves
every record afterwards. The consumer is rlbus's own (``KafkaBusConfig.region`` → ``client.rack``, aiokafka).
About 30-60 s on two cores; fails, never skips, when Kafka cannot start.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from rlbus.config import KafkaBusConfig, build_bus, parse
from rlbus.errors import RlbusError
from rlbus_tools.services import free_port_run, kafka

RACKS = ("eu-west", "eu-west", "us-east")
RECORDS = 50
VALUE = b"x" * 1000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kafka.KafkaCluster]:
    home = tmp_path_factory.mktemp("rack-kafka")
    before = os.environ.get("RLBUS_KAFKA_REQUEST_LOG")
    os.environ["RLBUS_KAFKA_REQUEST_LOG"] = "debug"  # read by each broker's log4j2 configuration at start
    try:
        try:
            started = kafka.start(brokers=3, port=free_port_run(6), home=home, timeout_s=150, racks=RACKS)
        except RlbusError as exc:
            pytest.fail(f"the three-broker Kafka cluster could not start: {exc}", pytrace=False)
        yield started
    finally:
        if before is None:
            os.environ.pop("RLBUS_KAFKA_REQUEST_LOG", None)
        else:
            os.environ["RLBUS_KAFKA_REQUEST_LOG"] = before
        kafka.stop(home, grace_s=10)


async def _create(bootstrap: str, *topics: NewTopic) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics(list(topics))
        assert all(error == 0 for _, error, *_ in response.topic_errors), response
    finally:
        await admin.close()


async def _placement(
    bootstrap: str, topic: str, partitions: int
) -> tuple[dict[int, str], dict[int, tuple[int, ...]]]:
    """Each broker's rack, and each partition's replicas (leader first), once the metadata has them all."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        cluster = await admin.describe_cluster()
        async with asyncio.timeout(30):
            while True:
                (described,) = await admin.describe_topics([topic])
                if len(described["partitions"]) == partitions:
                    break
                await asyncio.sleep(0.2)
    finally:
        await admin.close()
    racks = {broker["node_id"]: broker["rack"] for broker in cluster["brokers"]}
    replicas = {p["partition"]: (p["leader"], *(r for r in p["replicas"] if r != p["leader"]))
                for p in described["partitions"]}
    return racks, replicas


def test_brokers_carry_their_racks_and_replicas_spread_over_them(cluster: kafka.KafkaCluster) -> None:
    assert cluster.racks == RACKS
    for node in cluster.nodes:
        assert f"broker.rack={node.rack}" in node.config.read_text()
    topic = f"test.racks.spread.{uuid.uuid4().hex[:8]}"
    asyncio.run(_create(cluster.bootstrap, NewTopic(topic, num_partitions=12, replication_factor=2)))
    racks, replicas = asyncio.run(_placement(cluster.bootstrap, topic, partitions=12))
    assert racks == {1: "eu-west", 2: "eu-west", 3: "us-east"}
    for partition, nodes in replicas.items():
        assert {racks[node] for node in nodes} == {"eu-west", "us-east"}, (partition, nodes)
    # The leaders rotate over the racks too.
    assert {racks[nodes[0]] for nodes in replicas.values()} == {"eu-west", "us-east"}


def _fetches(node: kafka.KafkaNode, client_id: str) -> list[dict[str, Any]]:
    """The consumer fetches (replicaId -1) that ``node`` served to ``client_id``: request and response."""
    served = []
    for line in node.request_log.read_text().splitlines():
        _, _, body = line.partition("Completed request:")
        if f'"clientId":"{client_id}"' not in body or '"requestApiKeyName":"FETCH"' not in body:
            continue
        entry = json.loads(body)
        if entry["request"].get("replicaId", -1) == -1:
            served.append(entry)
    return served


def _partition_data(fetch: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for topic in fetch["response"]["responses"] for p in topic["partitions"]]


async def _produce_then_consume(bootstrap: str, topic: str, region: str) -> tuple[str, int]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for _ in range(RECORDS):
            await producer.send_and_wait(topic, VALUE)
    finally:
        await producer.stop()
    config: KafkaBusConfig = parse(KafkaBusConfig, {"bootstrap": bootstrap, "region": region}, prefix="bus")
    got = 0
    async with build_bus(config) as bus, bus.consumer([topic], group=None, from_beginning=True) as consumer:
        async with asyncio.timeout(60):
            while got < RECORDS:
                got += len(await consumer.getmany(timeout_s=1.0))
    return f"{config.client_id}-{region}", got


@pytest.mark.timeout(240)
def test_a_regions_consumer_is_served_by_the_replica_in_its_region(cluster: kafka.KafkaCluster) -> None:
    leader, other, follower = cluster.nodes
    topic = f"test.racks.follower.{uuid.uuid4().hex[:8]}"
    # One partition led by node 1 (eu-west), replicated to node 2 (eu-west) and node 3 (us-east).
    asyncio.run(_create(cluster.bootstrap, NewTopic(topic, -1, -1, replica_assignments={0: [1, 2, 3]})))
    client_id, got = asyncio.run(_produce_then_consume(cluster.bootstrap, topic, region="us-east"))
    assert got == RECORDS

    from_leader = _fetches(leader, client_id)
    from_follower = _fetches(follower, client_id)
    assert from_leader, "the consumer's first fetch goes to the partition's leader"
    assert all(fetch["request"]["rackId"] == "us-east" for fetch in from_leader + from_follower)
    # The leader redirects instead of serving: no records, and the us-east broker as preferred read replica.
    assert [p["preferredReadReplica"] for f in from_leader for p in _partition_data(f)] == [follower.node_id]
    assert sum(p["recordsSizeInBytes"] for f in from_leader for p in _partition_data(f)) == 0
    # The us-east follower serves every record.
    served = sum(p["recordsSizeInBytes"] for f in from_follower for p in _partition_data(f))
    assert served >= RECORDS * len(VALUE), (served, len(from_follower))
    assert not _fetches(other, client_id)
