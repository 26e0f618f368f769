"""The emulated WAN's regions against a real toxiproxy-server: each region reaches Redis and the blob origin
over its own link, and a cut takes down only the links between two regions. Echo servers stand for Redis and
the blob origin; the Kafka side is tests/integration/test_wan_kafka.py. About 3 s; fails without the server
(``bash infra/toxiproxy/install.sh``)."""

from __future__ import annotations

import socket

import pytest

from rlbus.errors import ConfigError
from rlbus_tools.services import toxiproxy, wan
from tests.fixtures.tcp import round_trips

TOPOLOGY = wan.Topology(
    home="eu-west",
    regions=("eu-west", "us-east", "ap-south"),
    links={
        ("eu-west", "us-east"): toxiproxy.Link(latency_ms=40),
        ("ap-south", "eu-west"): toxiproxy.Link(latency_ms=90, bandwidth_mbit=200),
    },
)


def _port(address: str | None) -> int:
    assert address is not None
    return int(address.rpartition(":")[2])


def test_each_region_reaches_the_home_services_over_its_link(proxies: toxiproxy.Toxiproxy, echo: str) -> None:
    made = wan.connect(proxies, TOPOLOGY, redis=echo, blobs=echo)
    try:
        assert made.regions["us-east"].bootstrap == ""
        home = round_trips(_port(made.regions["eu-west"].redis), count=3)
        us = round_trips(_port(made.regions["us-east"].redis), count=3)
        ap = round_trips(_port(made.regions["ap-south"].blobs), count=3)
        assert min(home) < 0.04, home
        assert 0.08 <= min(us) < 0.16, us
        assert min(ap) >= 0.18, ap

        made.cut("us-east", "eu-west")
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", _port(made.regions["us-east"].redis)), timeout=1).close()
        assert len(round_trips(_port(made.regions["ap-south"].redis), count=1)) == 1
        assert len(round_trips(_port(made.regions["eu-west"].redis), count=1)) == 1
        made.restore("us-east", "eu-west")
        assert len(round_trips(_port(made.regions["us-east"].redis), count=1)) == 1
    finally:
        proxies.close()


def test_a_topology_names_only_its_regions() -> None:
    assert TOPOLOGY.link("us-east", "eu-west").latency_ms == 40
    assert TOPOLOGY.link("us-east", "ap-south") == toxiproxy.Link()
    assert TOPOLOGY.link("ap-south", "ap-south") == toxiproxy.Link()
    with pytest.raises(ConfigError, match="home"):
        wan.Topology(home="mars", regions=("eu-west",))
    with pytest.raises(ConfigError, match="links"):
        wan.Topology(home="eu-west", regions=("eu-west",), links={("eu-west", "mars"): toxiproxy.Link()})


def test_region_ports_are_two_blocks_per_region() -> None:
    ports = wan.kafka_region_ports(("eu-west", "us-east"), brokers=3)
    (l1, a1), (l2, a2) = ports.values()
    assert (a1 - l1, l2 - l1, a2 - l2) == (3, 6, 3)
