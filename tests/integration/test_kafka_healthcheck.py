"""The Kafka image's healthcheck (infra/kafka/healthcheck.py) against a real broker and against sockets
that are not one: an answered ApiVersions request is healthy; a bound port nobody accepts on (what a
starting broker's listener looks like), a server that hangs up, or nothing at all is not."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus

CHECK = Path(__file__).resolve().parents[2] / "infra/kafka/healthcheck.py"


def check(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK)], env={"KAFKA_HEALTHCHECK_PORT": str(port)},
                          capture_output=True, text=True, check=False, timeout=30)


async def test_a_broker_that_answers_is_healthy() -> None:
    await (await kafka_bus()).close()  # fails, never skips, without the suite's Kafka
    host, port = KAFKA_BOOTSTRAP.split(",")[0].rsplit(":", 1)
    assert host in ("127.0.0.1", "localhost")
    done = check(int(port))
    assert done.returncode == 0, done.stdout


def test_a_port_that_is_not_a_serving_broker_is_not() -> None:
    with socket.socket() as bound:  # listening, never accepting: the kernel completes the handshake anyway
        bound.bind(("127.0.0.1", 0))
        bound.listen(1)
        done = check(bound.getsockname()[1])
        assert done.returncode == 1 and "no answer" in done.stdout
    with socket.socket() as server:  # accepts, reads the request, hangs up without an answer
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def hang_up() -> None:
            connection, _ = server.accept()
            connection.recv(1024)
            connection.close()

        threading.Thread(target=hang_up, daemon=True).start()
        done = check(server.getsockname()[1])
        assert done.returncode == 1 and "closed before an answer" in done.stdout
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert check(port).returncode == 1  # nothing there
