"""Redis over TLS (``start_redis(tls=…)``, what ``rlbus up --secure`` starts): the state store works through
``rediss://`` with an ACL user, and a client that speaks plain TCP, or trusts another CA, is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import AuthenticationError, ConnectionError

from rlbus.security.redis_acl import apply_users, role_url, username
from rlbus.security.tls import LocalCA
from rlbus.state import open_state_store
from rlbus_tools.services.redis import RedisServer, start_redis


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    root = tmp_path_factory.mktemp("redis-tls")
    ca = LocalCA(root / "ca").ensure()
    server = start_redis(dir=root / "redis", tls=(ca.issue("redis", server=True, client=False), ca.cert))
    try:
        yield server, root
    finally:
        server.stop()


def test_the_url_is_rediss_with_the_ca(tls_redis: tuple[RedisServer, Path]) -> None:
    server, root = tls_redis
    assert server.url.startswith("rediss://127.0.0.1:") and f"ssl_ca_certs={root / 'ca' / 'ca.pem'}" in server.url
    assert Redis.from_url(server.url).ping()


def test_plain_tcp_is_refused(tls_redis: tuple[RedisServer, Path]) -> None:
    server, _ = tls_redis
    with pytest.raises(ConnectionError):
        Redis(host="127.0.0.1", port=server.port, socket_timeout=3).ping()


def test_a_client_trusting_another_ca_is_refused(tls_redis: tuple[RedisServer, Path]) -> None:
    server, root = tls_redis
    rogue = LocalCA(root / "rogue", common_name="not this server's CA").ensure()
    with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        Redis.from_url(f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={rogue.cert}", socket_timeout=3).ping()


async def test_the_state_store_runs_over_tls_as_an_acl_user(tls_redis: tuple[RedisServer, Path]) -> None:
    server, _ = tls_redis
    await apply_users(server.url, {"trainer": "trainer-password-0123456789"}, namespace="tls")
    url = role_url(server.url, username("trainer", "tls"), "trainer-password-0123456789")
    assert url.startswith("rediss://") and "ssl_ca_certs=" in url
    store = open_state_store(url, key_prefix="rlbus:tls:")
    try:
        assert await store.mark_once("trainer", "r1") is True  # the ledger's set-if-absent gate
        assert await store.mark_once("trainer", "r1") is False
    finally:
        await store.close()
    with pytest.raises(AuthenticationError):
        Redis.from_url(role_url(server.url, username("trainer", "tls"), "wrong-password-0123456789")).ping()
