"""Regions on one machine, joined by an emulated WAN: every region reaches Kafka, Redis and the blob origin
through Toxiproxy proxies shaped like its links.

A :class:`Topology` names the regions, the home region (where the trainer, Redis and the blob origin run) and a
:class:`~rlbus_tools.services.toxiproxy.Link` per pair of regions (a pair not named gets ``default``; a region to
itself gets none). :func:`connect` builds, for every region, one proxy per Kafka broker — in front of that
broker's listener for the region, shaped like the link from the region to the broker's rack — and one each in
front of Redis and the blob origin, shaped like the link to the home region. The brokers advertise these
proxies on their region listeners (:func:`kafka_region_ports` gives the ports to start the cluster with), so a
region's client that bootstraps from :attr:`Region.bootstrap` talks to every broker over its own links, and a
us-east consumer following its preferred read replica reads at loopback speed from the us-east broker while
the eu-west leader is 40 ms away. :meth:`Wan.cut` takes the links between two regions down.

Loopback only, like :mod:`rlbus_tools.services.toxiproxy`, which refuses anything else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rlbus.errors import ConfigError
from rlbus_tools.services import free_port_run
from rlbus_tools.services.kafka import HOST, KafkaCluster
from rlbus_tools.services.toxiproxy import Link, Proxy, Toxiproxy


@dataclass(frozen=True)
class Topology:
    """Regions and the links between them."""

    #: The trainer's region: Redis and the blob origin are there.
    home: str
    regions: tuple[str, ...]
    #: One link per unordered pair of regions, keyed ``(a, b)`` in either order.
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    #: The link for a pair ``links`` does not name.
    default: Link = field(default_factory=Link)

    def __post_init__(self) -> None:
        if self.home not in self.regions:
            raise ConfigError("wan.home", f"{self.home!r} is not one of the regions {self.regions}")
        for a, b in self.links:
            if a not in self.regions or b not in self.regions:
                raise ConfigError("wan.links", f"the link {a} <-> {b} names a region not in {self.regions}")

    def link(self, a: str, b: str) -> Link:
        if a == b:
            return Link()
        return self.links.get((a, b)) or self.links.get((b, a)) or self.default


@dataclass(frozen=True)
class Region:
    """Where a region's processes connect: each address a proxy in front of the real service."""

    name: str
    #: Kafka bootstrap (every broker, through this region's proxies); empty without Kafka.
    bootstrap: str
    #: ``host:port`` of Redis and of the blob origin through this region's proxies, when given.
    redis: str | None
    blobs: str | None


@dataclass
class Wan:
    """The proxies :func:`connect` made, by (region, what): ``kafka-<node id>``, ``redis``, ``blobs``."""

    topology: Topology
    regions: dict[str, Region]
    proxies: dict[tuple[str, str], Proxy]
    #: The region each service lives in, by the same names.
    located: dict[str, str]

    def between(self, a: str, b: str) -> list[Proxy]:
        """Every proxy that carries traffic between regions ``a`` and ``b``, both ways."""
        return [
            proxy for (region, what), proxy in self.proxies.items()
            if {region, self.located[what]} == {a, b} and a != b
        ]

    def cut(self, a: str, b: str) -> None:
        """The WAN between ``a`` and ``b`` goes down (open connections close, new ones are refused)."""
        for proxy in self.between(a, b):
            proxy.cut()

    def restore(self, a: str, b: str) -> None:
        for proxy in self.between(a, b):
            proxy.restore()


def kafka_region_ports(regions: Sequence[str], brokers: int) -> dict[str, tuple[int, int]]:
    """Free ports for a cluster's region listeners (``region_ports`` of :func:`rlbus_tools.services.kafka.start`):
    per region, the brokers' first listener port and the first proxy port they advertise."""
    first = free_port_run(2 * brokers * len(regions))
    return {
        region: (first + 2 * brokers * i, first + 2 * brokers * i + brokers) for i, region in enumerate(regions)
    }


def connect(
    toxiproxy: Toxiproxy,
    topology: Topology,
    *,
    kafka: KafkaCluster | None = None,
    redis: str | None = None,
    blobs: str | None = None,
) -> Wan:
    """Proxies from every region to the cluster's brokers (through its region listeners), to ``redis`` and to
    the blob origin ``blobs`` (``host:port`` on loopback, in the home region), each shaped like its link."""
    proxies: dict[tuple[str, str], Proxy] = {}
    located = {"redis": topology.home, "blobs": topology.home}
    regions = {}
    for region in topology.regions:
        bootstrap = []
        for node in kafka.nodes if kafka else ():
            listener = node.region_listener(region)
            what = f"kafka-{node.node_id}"
            located[what] = node.rack or topology.home
            proxy = toxiproxy.proxy(
                f"{region}-{what}", f"{HOST}:{listener.advertised_port}", f"{HOST}:{listener.port}"
            )
            proxy.shape(topology.link(region, located[what]))
            proxies[region, what] = proxy
            bootstrap.append(proxy.listen)
        for what, upstream in (("redis", redis), ("blobs", blobs)):
            if upstream is not None:
                proxy = toxiproxy.proxy(f"{region}-{what}", f"{HOST}:0", upstream)
                proxy.shape(topology.link(region, topology.home))
                proxies[region, what] = proxy
        regions[region] = Region(
            name=region,
            bootstrap=",".join(bootstrap),
            redis=proxies[region, "redis"].listen if redis else None,
            blobs=proxies[region, "blobs"].listen if blobs else None,
        )
    return Wan(topology=topology, regions=regions, proxies=proxies, located=located)
