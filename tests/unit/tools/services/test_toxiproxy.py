"""The WAN emulator against a real toxiproxy-server: latency is added, a cut blocks traffic, only loopback.

Needs the pinned server from ``bash infra/toxiproxy/install.sh`` (``make test`` builds it); fails, never skips,
without it. A local echo server stands for the far region; each test measures through the proxy. About 3 s.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from rlbus.errors import ConfigError, RlbusError
from rlbus_tools.services import toxiproxy
from tests.fixtures.tcp import round_trips

INSTALL_SCRIPT = Path(__file__).resolve().parents[4] / "infra" / "toxiproxy" / "install.sh"


def test_the_server_is_the_pinned_release(proxies: toxiproxy.Toxiproxy) -> None:
    pin = re.search(r'^TOXIPROXY_VERSION="v([^"]+)"', INSTALL_SCRIPT.read_text(), re.MULTILINE)
    assert pin is not None
    assert proxies.version() == pin.group(1)


def test_a_link_adds_its_latency_both_ways(proxies: toxiproxy.Toxiproxy, echo: str) -> None:
    proxy = proxies.proxy("latency", "127.0.0.1:0", echo)
    try:
        assert min(round_trips(proxy.port)) < 0.05  # the minimum: a loaded machine adds delay, never removes it
        proxy.shape(toxiproxy.Link(latency_ms=40, jitter_ms=5))
        trips = round_trips(proxy.port)
        assert min(trips) >= 2 * (40 - 5) / 1000, trips
        assert sorted(trips)[len(trips) // 2] < 0.3, trips
        proxy.shape(toxiproxy.Link())
        assert min(round_trips(proxy.port)) < 0.05
    finally:
        proxies.delete("latency")


def test_a_link_caps_the_bandwidth(proxies: toxiproxy.Toxiproxy, echo: str) -> None:
    proxy = proxies.proxy("bandwidth", "127.0.0.1:0", echo)
    try:
        proxy.shape(toxiproxy.Link(bandwidth_mbit=2.0))  # 250 KB/s each way
        (took,) = round_trips(proxy.port, count=1, size=100_000)
        assert took >= 0.3, took  # 100 KB at 250 KB/s: 0.4 s
    finally:
        proxies.delete("bandwidth")


def test_a_cut_blocks_traffic_until_restored(proxies: toxiproxy.Toxiproxy, echo: str) -> None:
    proxy = proxies.proxy("cut", "127.0.0.1:0", echo)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as open_before:
            open_before.sendall(b"ping")
            assert open_before.recv(16) == b"ping"
            proxy.cut()
            assert open_before.recv(16) == b"", "an open connection is closed by the cut"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=2).close()
        proxy.restore()
        assert len(round_trips(proxy.port, count=1)) == 1
    finally:
        proxies.delete("cut")


def test_a_stall_holds_data(proxies: toxiproxy.Toxiproxy, echo: str) -> None:
    proxy = proxies.proxy("stall", "127.0.0.1:0", echo)
    try:
        proxy.stall()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=0.5) as sock:
            sock.sendall(b"ping")
            with pytest.raises(TimeoutError):
                sock.recv(16)
    finally:
        proxies.delete("stall")


@pytest.mark.parametrize(
    ("listen", "upstream"),
    [
        ("0.0.0.0:0", "127.0.0.1:9092"),
        ("127.0.0.1:0", "10.0.0.8:9092"),
        ("127.0.0.1:0", "example.org:443"),
        ("[::1]:0", "127.0.0.1:9092"),
        ("127.0.0.1:0", "192.168.1.1:6379"),
    ],
)
def test_anything_off_loopback_is_refused(proxies: toxiproxy.Toxiproxy, listen: str, upstream: str) -> None:
    with pytest.raises(ConfigError, match=r"loopback|IPv4"):
        proxies.proxy("refused", listen, upstream)
    assert "refused" not in proxies.proxies()


def test_the_api_itself_stays_on_loopback() -> None:
    with pytest.raises(ConfigError, match="loopback"):
        toxiproxy.Toxiproxy("0.0.0.0:8474")
    with pytest.raises(ConfigError, match="loopback"), toxiproxy.running(host="0.0.0.0"):
        pass


def test_everything_made_is_removed_on_exit(echo: str) -> None:
    with toxiproxy.running() as client:
        other = toxiproxy.Toxiproxy(client.url.removeprefix("http://"))
        other.proxy("made-by-other", "127.0.0.1:0", echo).shape(toxiproxy.Link(latency_ms=10))
        other.close()
        assert "made-by-other" not in client.proxies()
        proxy = client.proxy("left-behind", "127.0.0.1:0", echo)
        proxy.shape(toxiproxy.Link(latency_ms=10))
        url = client.url
    # The server is gone, and with it the proxy's listener.
    with pytest.raises(RlbusError):
        toxiproxy.Toxiproxy(url.removeprefix("http://")).proxies()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()


def test_link_toxics() -> None:
    link = toxiproxy.Link(latency_ms=90, jitter_ms=10, bandwidth_mbit=200)
    toxics = {t["name"]: t for t in link.toxics()}
    assert set(toxics) == {"latency_upstream", "latency_downstream", "bandwidth_upstream", "bandwidth_downstream"}
    assert toxics["latency_upstream"]["attributes"] == {"latency": 90, "jitter": 10}
    assert toxics["bandwidth_downstream"]["attributes"] == {"rate": 25_000}  # KB/s
    assert toxiproxy.Link().toxics() == []
