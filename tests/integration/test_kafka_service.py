"""The local Kafka service: start a one-broker cluster, stop it, start it again, data intact.

Runs a real broker (Java and Maven must be installed; the jars come from the shared cache,
``$RLBUS_HOME`` or ``~/.cache/rlbus``) in a temporary home on free ports, so it never touches a
developer's broker. About 20-30 s on two cores; fails, never skips, when Kafka cannot start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from rlbus.errors import ConfigError
from rlbus_tools.services import free_port_pair, kafka

TOPIC = "rlbus.service-test.v1"


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    kafka.stop(tmp_path, grace_s=10)


async def _create_topic(bootstrap: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, num_partitions=2, replication_factor=1)])
    finally:
        await admin.close()


async def _topics(bootstrap: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return await admin.list_topics()
    finally:
        await admin.close()


@pytest.mark.timeout(180)
def test_cluster_restarts_with_its_data(home: Path) -> None:
    port = free_port_pair()
    cluster = kafka.start(brokers=1, port=port, home=home, timeout_s=90)
    assert cluster.bootstrap == f"127.0.0.1:{port}"

    state = kafka.status(home)
    assert state["running"] and state["bootstrap"] == cluster.bootstrap
    [node] = state["nodes"]
    assert node["alive"] and node["listening"] and node["controller_port"] == port + 1

    assert kafka.start(brokers=1, port=port, home=home).nodes == cluster.nodes
    assert kafka.status(home)["nodes"][0]["pid"] == node["pid"]

    asyncio.run(_create_topic(cluster.bootstrap))
    kafka.stop(home)
    stopped = kafka.status(home)
    assert not stopped["running"] and stopped["nodes"][0]["pid"] is None
    assert not (home / "kafka" / "node-1" / "kafka.pid").exists()

    restarted = kafka.start(brokers=1, port=port, home=home, timeout_s=90)
    assert restarted.cluster_id == cluster.cluster_id
    assert TOPIC in asyncio.run(_topics(restarted.bootstrap))


def test_a_different_layout_needs_fresh(home: Path) -> None:
    (home / "kafka").mkdir()
    (home / "kafka" / "cluster.json").write_text('{"cluster_id": "x", "brokers": 1, "port": 29500}')
    with pytest.raises(ConfigError, match="fresh"):
        kafka.start(brokers=3, port=29500, home=home)


def test_layout_spaces_ports_by_two() -> None:
    cluster = kafka.layout(Path("/h"), brokers=3, port=9092, cluster_id="id")
    assert [(n.port, n.controller_port) for n in cluster.nodes] == [(9092, 9093), (9094, 9095), (9096, 9097)]
    assert cluster.bootstrap == "127.0.0.1:9092,127.0.0.1:9094,127.0.0.1:9096"
    assert (cluster.replication_factor, cluster.min_insync_replicas) == (3, 2)
    single = kafka.layout(Path("/h"), brokers=1, port=9092, cluster_id="id")
    assert (single.replication_factor, single.min_insync_replicas) == (1, 1)


def test_three_node_config_has_the_quorum_and_replication() -> None:
    cluster = kafka.layout(Path("/h"), brokers=3, port=9092, cluster_id="id")
    config = dict(
        line.split("=", 1) for line in kafka.node_config(cluster, cluster.nodes[1]).splitlines() if "=" in line
    )
    assert config["node.id"] == "2"
    assert config["controller.quorum.voters"] == "1@127.0.0.1:9093,2@127.0.0.1:9095,3@127.0.0.1:9097"
    assert config["listeners"] == "PLAINTEXT://127.0.0.1:9094,CONTROLLER://127.0.0.1:9095"
    assert config["log.dirs"] == "/h/kafka/node-2/data"
    assert config["auto.create.topics.enable"] == "false"
    assert config["group.initial.rebalance.delay.ms"] == "0"
    for key in ("default.replication.factor", "offsets.topic.replication.factor"):
        assert config[key] == "3"
    for key in ("min.insync.replicas", "transaction.state.log.min.isr"):
        assert config[key] == "2"
