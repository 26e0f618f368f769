"""Local services for development and CI: Apache Kafka and Redis, run from plain processes.

Developers and CI machines often have Java and the Debian packages but no Docker engine, so these
modules start the real servers directly: ``kafka`` runs a KRaft cluster from the Maven Central jars
pinned in ``infra/kafka/pom.xml``; ``redis`` runs the system ``redis-server``. Each raises
:class:`rlbus.errors.ServiceError` with the server's own words when something goes wrong.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it; another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 both free right now (a Kafka node's client and controller listeners)."""
    return free_port_run(2, host)


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A port p with p … p + count - 1 all free right now (a cluster's consecutive listeners)."""
    for _ in range(100):
        sockets = [socket.socket()]
        try:
            sockets[0].bind((host, 0))
            port: int = sockets[0].getsockname()[1]
            for offset in range(1, count):
                sockets.append(socket.socket())
                sockets[-1].bind((host, port + offset))
            return port
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} adjacent free ports")
