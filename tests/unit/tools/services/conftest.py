"""Fixtures for the emulated-WAN tests: a far service (an echo server) and a real toxiproxy-server, which fails
the test — never skips it — when it cannot start (``bash infra/toxiproxy/install.sh`` builds it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rlbus.errors import ServiceError
from rlbus_tools.services import toxiproxy
from tests.fixtures.tcp import echo_server


@pytest.fixture(scope="module")
def echo() -> Iterator[str]:
    with echo_server() as address:
        yield address


@pytest.fixture(scope="module")
def proxies() -> Iterator[toxiproxy.Toxiproxy]:
    try:
        with toxiproxy.running() as client:
            yield client
    except ServiceError as exc:
        pytest.fail(f"toxiproxy-server could not start: {exc}", pytrace=False)
