"""Local services for development and CI: Apache Kafka and Redis, run from plain processes.

Developers and CI machines often have Java and the Debian packages but no Docker engine, so these
modules start the real servers directly: ``kafka`` runs a KRaft cluster from the Maven Central jars
pinned in ``infra/kafka/pom.xml``; ``redis`` runs the system ``redis-server``. Each raises
:class:`rlbus.errors.ServiceError` with the server's own words when something goes wrong.
"""

from __future__ import annotations

import random
import socket

from rlbus.errors import ServiceError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it; another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 both free right now (a Kafka node's client and controller listeners)."""
    return free_port_run(2, host)


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to outgoing connections and to ``bind(0)`` (Linux's
    ``ip_local_port_range``; IANA's 49152–65535 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 49152, 65535
    return low, high


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A port p with p … p + count - 1 all free right now (a cluster's consecutive listeners).

    The run is picked *below* the ephemeral range, so that no outgoing connection can take one of its ports
    in the seconds before its listener binds: a cluster's region proxies, say, are bound only after the
    brokers have started — tens of seconds in which their clients open connections from ephemeral ports
    (a CI run lost `rlbus bench regions` to exactly that: "bind: address already in use"). Nothing binds
    there by accident either, as ``bind(0)`` also draws from the ephemeral range."""
    low, _ = ephemeral_range()
    floor = 10_000
    for _ in range(200):
        port = random.randrange(floor, max(floor + 1, low - count))
        sockets: list[socket.socket] = []
        try:
            for offset in range(count):
                sockets.append(socket.socket())
                sockets[-1].bind((host, port + offset))
            return port
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise ServiceError(f"no {count} adjacent free ports on {host} between {floor} and {low}")
