"""Toxiproxy as the WAN between regions on one machine: a proxy per link, latency, bandwidth, cuts.

Regions on one machine talk over loopback in microseconds; a real fleet's trainer reaches ap-south in
~90 ms over a few hundred Mbit/s and sometimes not at all. Toxiproxy (built by ``infra/toxiproxy/install.sh``
into ``<home>/bin``) is a TCP proxy whose "toxics" add exactly that. This module runs ``toxiproxy-server`` on a
loopback port and drives its HTTP API: :meth:`Toxiproxy.proxy` opens a listener in front of an upstream,
:meth:`Proxy.shape` gives it a :class:`Link` (one-way latency and jitter on both directions, a bandwidth cap),
:meth:`Proxy.cut` disables it (new connections are refused, open ones closed) until :meth:`Proxy.restore`.

Only loopback: every listen and upstream address, and the API's own, must be an IPv4 literal in 127.0.0.0/8,
so an emulated WAN can never forward to or expose anything off this machine. :func:`running` starts the
server, and on exit deletes every proxy it created and stops the server.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbus.errors import ConfigError, ServiceError
from rlbus_tools.services import free_port
from rlbus_tools.services.kafka_jars import default_home, tail

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
INSTALL_HINT = "build it with `bash infra/toxiproxy/install.sh` (go install, into $RLBUS_HOME/bin)"
READY_TIMEOUT_S = 10.0


def loopback_address(address: str, field: str) -> tuple[str, int]:
    """``"127.0.0.1:9092"`` → ``("127.0.0.1", 9092)``; a ConfigError for anything not in 127.0.0.0/8."""
    host, sep, port = address.rpartition(":")
    try:
        ip = ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ConfigError(field, f"{address!r} is not an IPv4 address and port (e.g. 127.0.0.1:9092)") from None
    if not sep or ip not in LOOPBACK or not 0 <= number <= 65535:
        raise ConfigError(
            field, f"{address!r} is not a loopback address: the emulated WAN only uses 127.0.0.0/8 (e.g. 127.0.0.1)"
        )
    return host, number


@dataclass(frozen=True)
class Link:
    """A WAN link as one direction sees it; applied to both directions, a round trip costs twice the latency."""

    #: One-way delay added to every chunk of data, in milliseconds.
    latency_ms: float = 0.0
    #: Uniform jitter around the delay (± this), in milliseconds.
    jitter_ms: float = 0.0
    #: Bandwidth cap per direction and connection, in Mbit/s (None: unlimited).
    bandwidth_mbit: float | None = None

    def toxics(self) -> list[dict[str, Any]]:
        """The Toxiproxy toxics that make this link, one per kind and direction."""
        made = []
        for stream in ("upstream", "downstream"):
            if self.latency_ms or self.jitter_ms:
                attributes = {"latency": round(self.latency_ms), "jitter": round(self.jitter_ms)}
                made.append({"name": f"latency_{stream}", "type": "latency", "stream": stream,
                             "attributes": attributes})
            if self.bandwidth_mbit is not None:
                rate_kb = max(1, round(self.bandwidth_mbit * 1_000_000 / 8 / 1000))  # Toxiproxy counts KB/s
                made.append({"name": f"bandwidth_{stream}", "type": "bandwidth", "stream": stream,
                             "attributes": {"rate": rate_kb}})
        return made


class Toxiproxy:
    """A client of one toxiproxy-server's HTTP API; remembers the proxies it made so :meth:`close` removes them."""

    def __init__(self, api: str, *, timeout_s: float = 5.0) -> None:
        host, port = loopback_address(api, "toxiproxy.api")
        self.url = f"http://{host}:{port}"
        self._timeout_s = timeout_s
        self._made: dict[str, Proxy] = {}

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One API call; the decoded JSON answer (None when empty). ServiceError with the server's words."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise ServiceError(f"toxiproxy {method} {path}: {exc.code} {exc.read().decode(errors='replace')}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ServiceError(f"toxiproxy at {self.url} unreachable: {exc}") from exc
        return json.loads(text) if text.strip() else None

    def version(self) -> str:
        request = urllib.request.Request(self.url + "/version")
        with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
            text: str = response.read().decode()
        try:
            return str(json.loads(text)["version"])
        except (ValueError, KeyError, TypeError):
            return text.strip()

    def proxy(self, name: str, listen: str, upstream: str) -> Proxy:
        """A new proxy listening on ``listen`` (loopback; port 0 lets the server pick) in front of ``upstream``."""
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ConfigError("toxiproxy.name", f"{name!r}: use letters, digits, '-', '_' and '.'")
        loopback_address(listen, "toxiproxy.listen")
        loopback_address(upstream, "toxiproxy.upstream")
        made = self.request("POST", "/proxies", {"name": name, "listen": listen, "upstream": upstream, "enabled": True})
        proxy = Proxy(self, name=name, listen=str(made["listen"]), upstream=upstream)
        self._made[name] = proxy
        return proxy

    def delete(self, name: str) -> None:
        self.request("DELETE", f"/proxies/{name}")
        self._made.pop(name, None)

    def proxies(self) -> dict[str, Any]:
        """Every proxy the server has, as it describes them."""
        listed: dict[str, Any] = self.request("GET", "/proxies")
        return listed

    def close(self) -> None:
        """Delete every proxy this client made (their toxics go with them)."""
        for name in list(self._made):
            try:
                self.delete(name)
            except ServiceError:
                self._made.pop(name, None)


@dataclass
class Proxy:
    """One proxy: clients connect to ``listen`` and reach ``upstream`` through the toxics."""

    client: Toxiproxy
    name: str
    listen: str
    upstream: str

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    def shape(self, link: Link) -> None:
        """Replace this proxy's toxics with ``link``'s."""
        self.clear()
        for toxic in link.toxics():
            self.client.request("POST", f"/proxies/{self.name}/toxics", {**toxic, "toxicity": 1.0})

    def add_toxic(self, name: str, kind: str, attributes: dict[str, Any], *, stream: str = "downstream") -> None:
        """Any other Toxiproxy toxic (``timeout``, ``limit_data``, ``reset_peer``, ``slicer``…)."""
        body = {"name": name, "type": kind, "stream": stream, "toxicity": 1.0, "attributes": attributes}
        self.client.request("POST", f"/proxies/{self.name}/toxics", body)

    def stall(self, timeout_ms: int = 0) -> None:
        """Data stops flowing; with ``timeout_ms`` > 0 the connection is closed after that long."""
        self.add_toxic("timeout", "timeout", {"timeout": timeout_ms})

    def clear(self) -> None:
        for toxic in self.client.request("GET", f"/proxies/{self.name}/toxics") or []:
            self.client.request("DELETE", f"/proxies/{self.name}/toxics/{toxic['name']}")

    def cut(self) -> None:
        """The link goes down: the listener closes and every open connection with it."""
        self.client.request("POST", f"/proxies/{self.name}", {"enabled": False})

    def restore(self) -> None:
        self.client.request("POST", f"/proxies/{self.name}", {"enabled": True})


def server_binary(home: Path | None = None) -> str:
    """``<home>/bin/toxiproxy-server``, the pinned release ``infra/toxiproxy/install.sh`` builds (not one on
    PATH: its API and toxics are the ones this module was written against)."""
    built = (home or default_home()) / "bin" / "toxiproxy-server"
    if not built.is_file():
        raise ServiceError(f"toxiproxy-server not found in {built.parent}; {INSTALL_HINT}")
    return str(built)


@contextmanager
def running(
    host: str = "127.0.0.1", port: int | None = None, *, log: Path | None = None, home: Path | None = None
) -> Iterator[Toxiproxy]:
    """A toxiproxy-server on ``host:port`` (loopback; a free port by default) and a client of it. On exit every
    proxy the client made is deleted and the server stopped."""
    port = port or free_port(host)
    loopback_address(f"{host}:{port}", "toxiproxy.api")
    command = [server_binary(home), "-host", host, "-port", str(port)]
    if log is None:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    else:
        with log.open("ab") as out:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    client = Toxiproxy(f"{host}:{port}")
    try:
        _wait_ready(client, proc, log)
        yield client
    finally:
        try:
            client.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(client: Toxiproxy, proc: subprocess.Popen[bytes], log: Path | None) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            said = tail(log.read_text(errors="replace")) if log and log.is_file() else "(no log kept)"
            raise ServiceError(f"toxiproxy-server exited with {proc.returncode} at start-up:\n{said}")
        try:
            client.version()
            return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                silent = f"toxiproxy-server not answering at {client.url} after {READY_TIMEOUT_S:.0f} s"
                raise ServiceError(silent) from None
            time.sleep(0.05)
