"""Racks and region listeners of the local Kafka cluster's nodes: defaults, validation, what each node's
server.properties says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbus.errors import ConfigError
from rlbus_tools.services import kafka


def _config(cluster: kafka.KafkaCluster, node: kafka.KafkaNode) -> dict[str, str]:
    lines = kafka.node_config(cluster, node).splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def test_three_nodes_default_to_three_regions() -> None:
    cluster = kafka.layout(Path("/h"), brokers=3, port=9092, cluster_id="id")
    assert cluster.racks == ("eu-west", "us-east", "ap-south")
    for node in cluster.nodes:
        config = _config(cluster, node)
        assert config["broker.rack"] == node.rack
        assert config["replica.selector.class"] == kafka.RACK_AWARE_SELECTOR


def test_a_single_node_has_no_rack() -> None:
    cluster = kafka.layout(Path("/h"), brokers=1, port=9092, cluster_id="id")
    assert cluster.racks is None
    assert "broker.rack" not in _config(cluster, cluster.nodes[0])


def test_racks_are_given_per_broker_or_not_at_all() -> None:
    cluster = kafka.layout(Path("/h"), brokers=3, port=9092, cluster_id="id", racks=("a", "a", "b"))
    assert cluster.racks == ("a", "a", "b")
    assert kafka.layout(Path("/h"), brokers=3, port=9092, cluster_id="id", racks=()).racks is None
    with pytest.raises(ConfigError, match="one per broker"):
        kafka.layout(Path("/h"), brokers=3, port=9092, cluster_id="id", racks=("a", "b"))
    with pytest.raises(ConfigError, match="not a rack name"):
        kafka.layout(Path("/h"), brokers=1, port=9092, cluster_id="id", racks=("eu west",))
    assert kafka.parse_racks("eu-west, us-east,,ap-south") == ("eu-west", "us-east", "ap-south")


def test_racks_go_with_the_secure_and_sasl_listeners() -> None:
    sasl = kafka.layout(Path("/h"), brokers=3, port=9092, cluster_id="id", sasl_port=9192)
    config = _config(sasl, sasl.nodes[2])
    assert config["broker.rack"] == "ap-south"
    assert "SASL_PLAINTEXT://127.0.0.1:9194" in config["listeners"]


def test_the_racks_are_kept_with_the_layout(tmp_path: Path) -> None:
    saved = {"cluster_id": "id", "brokers": 3, "port": 9092, "racks": ["x", "y", "z"]}
    (tmp_path / "kafka").mkdir()
    (tmp_path / "kafka" / "cluster.json").write_text(json.dumps(saved))
    loaded = kafka.load_cluster(tmp_path)
    assert loaded is not None and loaded.racks == ("x", "y", "z")
    del saved["racks"]  # a cluster formatted before racks existed keeps having none
    (tmp_path / "kafka" / "cluster.json").write_text(json.dumps(saved))
    loaded = kafka.load_cluster(tmp_path)
    assert loaded is not None and loaded.racks is None


def test_region_listeners_advertise_the_regions_proxies() -> None:
    ports = {"eu-west": (20000, 20003), "us-east": (20006, 20009)}
    cluster = kafka.layout(Path("/h"), brokers=3, port=9092, cluster_id="id", region_ports=ports)
    config = _config(cluster, cluster.nodes[1])
    assert config["listeners"] == (
        "PLAINTEXT://127.0.0.1:9094,CONTROLLER://127.0.0.1:9095,"
        "WAN_EU_WEST://127.0.0.1:20001,WAN_US_EAST://127.0.0.1:20007"
    )
    assert config["advertised.listeners"] == (
        "PLAINTEXT://127.0.0.1:9094,WAN_EU_WEST://127.0.0.1:20004,WAN_US_EAST://127.0.0.1:20010"
    )
    assert config["listener.security.protocol.map"].endswith(",WAN_EU_WEST:PLAINTEXT,WAN_US_EAST:PLAINTEXT")
    assert config["inter.broker.listener.name"] == "PLAINTEXT"
    assert cluster.region_bootstrap("us-east") == "127.0.0.1:20009,127.0.0.1:20010,127.0.0.1:20011"
    assert cluster.region_ports == ports
    with pytest.raises(ConfigError, match="secure"):
        kafka.layout(Path("/h"), brokers=3, port=9092, cluster_id="id", secure=True, region_ports=ports)
    with pytest.raises(ConfigError, match="no listener"):
        cluster.nodes[0].region_listener("ap-south")
