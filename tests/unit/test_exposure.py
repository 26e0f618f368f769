"""The bind guard and the bearer-token middleware every rlbus HTTP endpoint uses (rlbus/exposure.py)."""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from rlbus.errors import ConfigError
from rlbus.exposure import SERVICES, BearerAuth, check_bind, is_loopback, load_token

TOKEN = "exposure-token-0123456789"

LOOPBACK = ["127.0.0.1", "127.0.0.53", "127.255.255.254", "::1", "[::1]", "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1",
            "localhost", "LOCALHOST", "localhost."]
OFF_HOST = [
    "0.0.0.0",  # every IPv4 interface
    "::",  # every interface
    "",  # every interface (asyncio's meaning of an empty host)
    None,  # every interface (aiohttp's)
    "192.168.1.20", "10.0.0.5", "172.17.0.2",  # LAN / container networks
    "8.8.8.8", "2001:db8::1", "fe80::1%eth0", "::ffff:10.0.0.1",
    "example.com", "my-host", "localhost.example.com", "ip6-localhost",  # names: never resolved, off-host
    "127.1", "2130706433",  # shorthands getaddrinfo reads as 127.0.0.1: refused rather than guessed
    " 127.0.0.1",
]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_addresses_and_localhost_need_no_token(host: str) -> None:
    assert is_loopback(host)
    for service in SERVICES:
        check_bind(host, service=service, auth_configured=False)


@pytest.mark.parametrize("host", OFF_HOST)
def test_every_other_address_or_name_needs_authentication(host: str | None) -> None:
    assert not is_loopback(host)
    for service in SERVICES:
        check_bind(host, service=service, auth_configured=True)  # with a token: fine
        with pytest.raises(ConfigError) as caught:
            check_bind(host, service=service, auth_configured=False)
        assert caught.value.field == SERVICES[service].host_field
        assert SERVICES[service].token_env in str(caught.value) and "bind 127.0.0.1" in str(caught.value)


@pytest.mark.parametrize(("service", "field", "fix"), [
    ("dashboard", "dashboard.host", "RLBUS_DASHBOARD_TOKEN_FILE"),
    ("metrics", "run.metrics_host", "RLBUS_METRICS_TOKEN_FILE"),
    ("feedback", "feedback.host", "RLBUS_FEEDBACK_TOKEN_FILE"),
    ("serve", "serve.host", "RLBUS_SERVE_TOKEN_FILE"),
])
def test_the_error_names_the_field_and_the_fix(service: str, field: str, fix: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{field}'.*0\.0\.0\.0 \(every interface\).*{fix}.*bind 127\.0\.0\.1"):
        check_bind("0.0.0.0", service=service, auth_configured=False)
    with pytest.raises(ConfigError, match="a name"):
        check_bind("box.lan", service=service, auth_configured=False)
    with pytest.raises(ConfigError, match=r"'dashboard\.port'"):  # a caller may name its own field
        check_bind("::", service="dashboard", auth_configured=False, field="dashboard.port")


def test_an_unknown_service_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown service"):
        check_bind("127.0.0.1", service="nope", auth_configured=False)


def test_tokens_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text(f"  {TOKEN}\n")
    assert load_token("dashboard", environ={}) is None
    assert load_token("dashboard", environ={"RLBUS_DASHBOARD_TOKEN": TOKEN}) == TOKEN
    assert load_token("metrics", environ={"RLBUS_METRICS_TOKEN_FILE": str(secret)}) == TOKEN
    # the file wins over the variable; whitespace around the file's contents is not part of the token
    assert load_token("metrics", environ={"RLBUS_METRICS_TOKEN_FILE": str(secret), "RLBUS_METRICS_TOKEN": "x" * 20}
                      ) == TOKEN
    assert load_token("feedback", file=secret, environ={}) == TOKEN
    assert load_token("metrics", environ={"RLBUS_DASHBOARD_TOKEN": TOKEN}) is None  # one service's token only


def test_bad_tokens_are_config_errors_that_never_show_the_token(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'metrics\.token'.*at least 16") as short:
        load_token("metrics", environ={"RLBUS_METRICS_TOKEN": "short-secret"})
    assert "short-secret" not in str(short.value)
    with pytest.raises(ConfigError, match=r"'dashboard\.token': cannot read token file .*missing"):
        load_token("dashboard", environ={"RLBUS_DASHBOARD_TOKEN_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_token("dashboard", file=tmp_path / "empty", environ={})
    with pytest.raises(ValueError, match="load_tenants"):
        load_token("serve", environ={})
    with pytest.raises(ConfigError, match="at least 16"):
        BearerAuth("metrics", "short")


async def _client(auth: BearerAuth) -> TestClient[Any, Any]:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": True, "authenticated": auth.accepts(request)})

    app = web.Application(middlewares=[auth.middleware])
    app.router.add_get("/data", hello)
    app.router.add_get("/healthz", hello)
    return TestClient(TestServer(app))


def _basic(password: str, user: str = "me") -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


async def test_the_middleware_takes_the_bearer_token_only(caplog: pytest.LogCaptureFixture) -> None:
    auth = BearerAuth("metrics", TOKEN, open_paths={"/healthz"})
    async with await _client(auth) as client:
        for header, why in [(None, "no credentials"), (f"Bearer {TOKEN}x", "wrong token"),
                            ("Bearer wrong", "wrong token"), (TOKEN, "unsupported"),
                            (_basic(TOKEN), "unsupported"), ("Bearer ", "unsupported")]:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="rlbus.exposure"):
                response = await client.get("/data", headers={"Authorization": header} if header else {})
            assert response.status == 401, header
            assert response.headers["WWW-Authenticate"] == 'Bearer realm="rlbus-metrics"'
            assert "RLBUS_METRICS_TOKEN" in (await response.json())["error"]
            [record] = caplog.records
            assert record.levelno == logging.WARNING
            assert "metrics" in record.message and "'/data'" in record.message and "127.0.0.1" in record.message
            assert why in record.message and TOKEN not in record.message
        for header in (f"Bearer {TOKEN}", f"bearer   {TOKEN} "):
            response = await client.get("/data", headers={"Authorization": header})
            assert response.status == 200 and await response.json() == {"hello": True, "authenticated": True}
        response = await client.get("/healthz")  # an open path: served, and the handler knows who asks
        assert response.status == 200 and await response.json() == {"hello": True, "authenticated": False}
    assert auth.refused == 6


async def test_a_browser_signs_in_with_basic_and_the_token_as_password() -> None:
    auth = BearerAuth("dashboard", TOKEN, browser=True)
    async with await _client(auth) as client:
        response = await client.get("/data")
        assert response.status == 401
        assert response.headers.getall("WWW-Authenticate") == [
            'Basic realm="rlbus-dashboard", charset="UTF-8"', 'Bearer realm="rlbus-dashboard"']
        for header, status in [(_basic(TOKEN), 200), (_basic(TOKEN, user=""), 200), (_basic("nope"), 401),
                               ("Basic !!notbase64", 401), (f"Bearer {TOKEN}", 200)]:
            response = await client.get("/data", headers={"Authorization": header})
            assert response.status == status, header
