"""Run the system ``redis-server`` as a throwaway child process for tests and local runs.

The state store needs a real Redis in integration tests and CI, where no Docker engine may exist;
the Debian ``redis-server`` package is enough. The server listens on loopback only, keeps nothing on
disk (``--save ''``, no append-only file) and lives exactly as long as the :class:`RedisServer`
handle: use it as a context manager or call :meth:`RedisServer.stop`.

With ``persist=True`` it keeps an append-only file fsynced on every write (``appendfsync always``),
so a server killed with SIGKILL and started again on the same ``dir`` holds every write it
acknowledged — what the idempotency ledger needs to survive a crash (the chaos suite shows it).
``everysec``, Redis's default, would lose up to a second of ledger marks and let a redelivered
rollout be trained twice.

With ``tls`` (a server certificate and the CA that signed it, :mod:`rlbus.security.tls`) the server
listens with TLS only (``--port 0 --tls-port P``; Redis 6+ built with OpenSSL, as Debian's is) and its URL
is ``rediss://host:P/0?ssl_ca_certs=<ca>``: clients verify the server and its address, and authenticate
with their ACL user (:mod:`rlbus.security.redis_acl`) inside the tunnel.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from redis import Redis
from redis.exceptions import RedisError

from rlbus.errors import ServiceError
from rlbus.security.tls import Issued
from rlbus_tools.services import free_port

HOST = "127.0.0.1"
START_ATTEMPTS = 3


@dataclass
class RedisServer:
    """A running ``redis-server`` child process on ``HOST:port``."""

    port: int
    dir: Path
    process: subprocess.Popen[bytes]
    #: The CA file clients verify a TLS server with (None: plain TCP).
    ca_file: Path | None = None

    @property
    def url(self) -> str:
        if self.ca_file is not None:
            return f"rediss://{HOST}:{self.port}/0?ssl_ca_certs={self.ca_file}"
        return f"redis://{HOST}:{self.port}/0"

    @property
    def log_file(self) -> Path:
        return self.dir / "redis.log"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the server, killing it if it has not exited within ``timeout_s``."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_redis(
    port: int | None = None, *, dir: Path, timeout_s: float = 10.0, persist: bool = False,
    tls: tuple[Issued, Path] | None = None,
) -> RedisServer:
    """Start ``redis-server`` on ``port`` (a free one when None) with ``dir`` for its files; with
    ``persist`` an fsync-always append-only file there (reloaded when a server starts on that dir); with
    ``tls`` (the server's certificate, the CA file) TLS only.

    Returns once the server answers PING. Raises ServiceError when the binary is missing or the
    server does not come up; the message carries the end of its log. A relative ``dir`` counts
    from the caller's current directory (the server runs inside ``dir``, so it is given the absolute path).
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError("redis-server not found on PATH; install it (Debian: apt-get install -y redis-server)")
    dir = dir.absolute()
    dir.mkdir(parents=True, exist_ok=True)
    for _ in range(1 if port is not None else START_ATTEMPTS):
        server = _spawn(binary, port or free_port(HOST), dir, persist, tls)
        if _wait_ready(server, timeout_s):
            return server
        server.stop()
    raise ServiceError(f"redis-server on port {server.port} did not come up:\n{_tail(server.log_file)}")


def _spawn(
    binary: str, port: int, dir: Path, persist: bool = False, tls: tuple[Issued, Path] | None = None
) -> RedisServer:
    options = {
        "port": str(port),
        "bind": HOST,
        "dir": str(dir),
        "logfile": "redis.log",
        "save": "",
        "appendonly": "yes" if persist else "no",
        "daemonize": "no",
    }
    if persist:
        options["appendfsync"] = "always"
    if tls is not None:
        certificate, ca_file = tls
        options |= {
            "port": "0", "tls-port": str(port), "tls-cert-file": str(certificate.cert),
            "tls-key-file": str(certificate.key), "tls-ca-cert-file": str(ca_file),
            "tls-auth-clients": "no",  # clients prove who they are with their ACL user's password
        }
    command = [binary, *(arg for name, value in options.items() for arg in (f"--{name}", value))]
    process = subprocess.Popen(command, cwd=dir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return RedisServer(port=port, dir=dir, process=process, ca_file=None if tls is None else tls[1])


def _wait_ready(server: RedisServer, timeout_s: float) -> bool:
    """True once our process answers; False when it exits (port taken) or times out.

    The server's own pid is checked so that another Redis already on the port cannot pass for it.
    """
    client = Redis.from_url(server.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    try:
        while server.process.poll() is None and time.monotonic() < deadline:
            try:
                if client.info("server")["process_id"] == server.process.pid:
                    return True
            except RedisError:
                pass
            time.sleep(0.05)
        return False
    finally:
        client.close()


def _tail(path: Path, lines: int = 20) -> str:
    if not path.is_file():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
