"""The real HTTP servers behind their tokens (rlbus/exposure.py): the dashboard, a metrics endpoint, the
feedback API and the gateway, each on 127.0.0.1 with a token — 401 without it or with a wrong one, 200
with it — and each refusing 0.0.0.0 without a token with a ConfigError before anything binds. Then the
gateway's tenants: one tenant's token can neither read nor continue nor close another's session.

No Kafka or Redis: the feedback API and the gateway record to the in-memory bus.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy
from typer.testing import CliRunner

from rlbus.bus import MemoryBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.errors import ConfigError
from rlbus.metrics import serve_metrics
from rlbus.observe.dashboard import Dashboard, serving
from rlbus.producers.feedback import FeedbackServer, load_token
from rlbus.serve.auth import Tenants, load_tenants
from rlbus.serve.stack import ServeStack, serve_stack

TOKEN = "endpoint-token-0123456789abcdef"
TENANTS = {"acme": "acme-token-0123456789abcdef", "globex": "globex-token-0123456789abcd"}
NO_TOKENS: dict[str, str] = {}


@pytest.fixture
def binds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str | None, int | None]]]:
    """Every TCPSite that starts listening, so a test can show a refused server never bound."""
    started: list[tuple[str | None, int | None]] = []
    original = web.TCPSite.start

    async def start(site: web.TCPSite) -> None:
        started.append((site._host, site._port))
        await original(site)

    monkeypatch.setattr(web.TCPSite, "start", start)
    yield started


@pytest.fixture(autouse=True)
def no_configured_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens of the developer's shell must not leak into these tests."""
    for name in ("DASHBOARD", "METRICS", "FEEDBACK"):
        monkeypatch.delenv(f"RLBUS_{name}_TOKEN", raising=False)
        monkeypatch.delenv(f"RLBUS_{name}_TOKEN_FILE", raising=False)
    monkeypatch.delenv("RLBUS_SERVE_TOKENS", raising=False)
    monkeypatch.delenv("RLBUS_SERVE_TOKEN_FILE", raising=False)


async def get(url: str, token: str | None = None, **headers: str) -> tuple[int, str, CIMultiDictProxy[str]]:
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with http_session() as http, http.get(url, headers=headers) as response:
        return response.status, await response.text(), response.headers


def http_session(**kw: Any) -> aiohttp.ClientSession:
    """One connection per request, closed with it: no keep-alive outliving a test's server."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), **kw)


async def check_tokens(url: str, caplog: pytest.LogCaptureFixture, service: str, *, expect: str) -> None:
    """401 (logged, naming service, path and peer, never the token) without or with a wrong token; 200 with
    the right one."""
    for token in (None, "wrong-token-0123456789abcdef", TOKEN + "x"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            status, body, headers = await get(url, token)
        assert status == 401, (url, token)
        assert "WWW-Authenticate" in headers and "error" in json.loads(body)
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1 and service in refusals[0] and "127.0.0.1" in refusals[0]
        assert TOKEN not in refusals[0] and (token is None or token not in refusals[0])
    status, body, _ = await get(url, TOKEN)
    assert status == 200 and expect in body


# --- the dashboard --------------------------------------------------------------------------------
async def test_dashboard_needs_its_token_on_every_path(caplog: pytest.LogCaptureFixture) -> None:
    async with serving(lambda: {"now": 1.0, "counts": {}}, "127.0.0.1", 0, environ={"RLBUS_DASHBOARD_TOKEN": TOKEN}
                       ) as url:
        for path, expected in (("", "dashboard.js"), ("static/dashboard.js", "api/snapshot"),
                               ("api/snapshot", '"now"')):
            await check_tokens(url + path, caplog, "dashboard", expect=expected)
        status, _, headers = await get(url)
        assert status == 401 and headers.getall("WWW-Authenticate")[0].startswith('Basic realm="rlbus-dashboard"')
        # what a browser sends once its user typed the token into its prompt (any user name)
        basic = "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
        async with http_session() as http, http.get(url + "api/snapshot", headers={"Authorization": basic}) as response:
            assert response.status == 200 and (await response.json())["now"] == 1.0


async def test_dashboard_without_a_token_serves_loopback_only(binds: list[Any]) -> None:
    async with serving(lambda: {"now": 1.0}, "127.0.0.1", 0, environ=NO_TOKENS) as url:
        status, body, _ = await get(url + "api/snapshot")
        assert status == 200 and '"now"' in body
    binds.clear()
    for host in ("0.0.0.0", "::", "192.168.1.20", "dashboard.example.com"):
        with pytest.raises(ConfigError, match=r"'dashboard\.host'.*RLBUS_DASHBOARD_TOKEN.*bind 127\.0\.0\.1"):
            async with serving(lambda: {}, host, 0, environ=NO_TOKENS):
                pass
        with pytest.raises(ConfigError, match=r"'dashboard\.host'"):  # the CLI's object: refused as it is built
            Dashboard(bus=MemoryBus(), host=host, port=0, environ=NO_TOKENS)
    assert binds == []


def test_dashboard_cli_refuses_an_open_page_before_connecting(binds: list[Any]) -> None:
    from rlbus.cli.app import app

    # the bootstrap points nowhere: the refusal must come first, not a connection error
    result = CliRunner().invoke(app, ["dashboard", "--host", "0.0.0.0", "--port", "0", "--bootstrap", "127.0.0.1:9"])
    assert result.exit_code == 1 and "dashboard.host" in result.output and "RLBUS_DASHBOARD_TOKEN" in result.output
    assert binds == []


# --- metrics ------------------------------------------------------------------------------------------
async def test_metrics_need_the_token_when_one_is_configured(caplog: pytest.LogCaptureFixture) -> None:
    async with serve_metrics(0, "127.0.0.1", environ={"RLBUS_METRICS_TOKEN": TOKEN}) as server:
        assert server.authenticated
        await check_tokens(server.url, caplog, "metrics", expect="# HELP rlbus_")


async def test_metrics_token_from_a_file_serve_off_loopback_and_none_refuse_it(
    tmp_path: Path, binds: list[Any]
) -> None:
    secret = tmp_path / "metrics-token"
    secret.write_text(TOKEN + "\n")
    async with serve_metrics(0, "127.0.0.1", environ=NO_TOKENS) as server:  # loopback, no token: open as before
        assert not server.authenticated and (await get(server.url))[0] == 200
    binds.clear()
    for host in ("0.0.0.0", "::", "10.1.2.3", "prometheus-target"):
        with pytest.raises(ConfigError, match=r"'run\.metrics_host'.*RLBUS_METRICS_TOKEN.*credentials_file"):
            async with serve_metrics(0, host, environ=NO_TOKENS):
                pass
    assert binds == []
    # what a container does (RLBUS_METRICS_HOST=0.0.0.0 with a token): served, and only with the token
    async with serve_metrics(0, "0.0.0.0", environ={"RLBUS_METRICS_TOKEN_FILE": str(secret)}) as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        assert (await get(url))[0] == 401 and (await get(url, TOKEN))[0] == 200
        # the probe path of compose healthchecks and Kubernetes probes: open, and says only that it lives
        status, text, _ = await get(f"http://127.0.0.1:{server.port}/healthz")
        assert status == 200 and text == '{"ok": true}'
    assert binds == [("0.0.0.0", 0)]


# --- feedback -------------------------------------------------------------------------------------------
async def test_feedback_needs_its_token_and_health_reveals_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async with MemoryBus(topic_specs()) as bus:
        server = FeedbackServer(bus=bus, token=TOKEN)
        stop = asyncio.Event()
        task = asyncio.create_task(server.run(stop, "127.0.0.1", 0))
        try:
            await asyncio.wait_for(server.listening.wait(), 10)
            host, port = server.address or ("", 0)
            base = f"http://{host}:{port}"
            body = json.dumps({"rollout_id": "p/0", "signal": "up"})
            for token in (None, "wrong-token-0123456789abcdef"):
                headers = {"Content-Type": "application/json"}
                if token:
                    headers["Authorization"] = f"Bearer {token}"
                caplog.clear()
                with caplog.at_level(logging.WARNING):
                    async with http_session() as http, http.post(
                            f"{base}/v1/feedback", data=body, headers=headers) as response:
                        assert response.status == 401
                [record] = [r for r in caplog.records if "refused" in r.getMessage()]
                assert "feedback" in record.getMessage() and "/v1/feedback" in record.getMessage()
            async with http_session() as http, http.post(
                    f"{base}/v1/feedback", data=body,
                    headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}) as response:
                assert response.status == 202
            status, text, _ = await get(f"{base}/healthz")
            assert status == 200 and json.loads(text) == {"ok": True}
            status, text, _ = await get(f"{base}/healthz", TOKEN)
            assert status == 200 and json.loads(text) == {"ok": True, "published": 1}
        finally:
            stop.set()
            await task


def test_feedback_never_starts_without_a_token(binds: list[Any]) -> None:
    from rlbus.cli.app import app

    with pytest.raises(ConfigError, match=r"'feedback\.token'.*RLBUS_FEEDBACK_TOKEN"):
        load_token(env=NO_TOKENS)
    with pytest.raises(ConfigError, match=r"'feedback\.token'"):
        FeedbackServer(bus=MemoryBus(), token="")

    result = CliRunner().invoke(app, ["feedback", "serve", "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 1 and "feedback.token" in result.output
    assert binds == []


# --- the gateway -------------------------------------------------------------------------------------------
@pytest.fixture
async def gateway(tiny_hf_dir: Path) -> AsyncIterator[tuple[ServeStack, MemoryBus, str]]:
    from rlbus.models.hf_source import HFSource

    async with MemoryBus(topic_specs()) as bus:
        stack = serve_stack(bus=bus, source=HFSource(tiny_hf_dir), tenants=Tenants(TENANTS),
                            model_name="tiny", default_max_tokens=6)
        stack.gateway.metrics_token = TOKEN
        stop = asyncio.Event()
        task = asyncio.create_task(stack.gateway.run(stop, "127.0.0.1", 0))
        await asyncio.wait_for(stack.gateway.listening.wait(), 60)
        host, port = stack.gateway.address or ("", 0)
        try:
            yield stack, bus, f"http://{host}:{port}"
        finally:
            stop.set()
            await task


def test_the_gateway_never_starts_without_tenant_tokens(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'serve\.tokens'.*RLBUS_SERVE_TOKENS"):
        load_tenants(env=NO_TOKENS)
    with pytest.raises(ConfigError, match=r"'serve\.tokens'"):
        Tenants({})
    (tmp_path / "tokens").write_text("# nobody yet\n")
    with pytest.raises(ConfigError, match=r"'serve\.tokens'"):
        load_tenants(tmp_path / "tokens", env=NO_TOKENS)


async def test_gateway_operator_routes_take_the_metrics_token_not_a_tenant_token(
    gateway: tuple[ServeStack, MemoryBus, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, _, url = gateway
    await check_tokens(f"{url}/metrics", caplog, "serve", expect="rlbus_serve_requests_total")
    assert (await get(f"{url}/metrics", TENANTS["acme"]))[0] == 401
    status, text, _ = await get(f"{url}/healthz")
    assert status == 200 and json.loads(text) == {"ok": True}
    status, text, _ = await get(f"{url}/healthz", TENANTS["acme"])
    assert status == 200 and json.loads(text) == {"ok": True}
    status, text, _ = await get(f"{url}/healthz", TOKEN)
    assert status == 200 and json.loads(text)["model"] == "tiny"
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="not-a-tenant-token-0123", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            await c.models.list()


async def test_a_tenant_cannot_read_continue_or_close_another_tenants_session(
    gateway: tuple[ServeStack, MemoryBus, str],
) -> None:
    stack, bus, url = gateway
    acme = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TENANTS["acme"], max_retries=0)
    globex = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TENANTS["globex"], max_retries=0)
    try:
        await _cross_tenant(stack, bus, url, acme, globex)
    finally:
        await acme.close()
        await globex.close()


async def _cross_tenant(stack: ServeStack, bus: MemoryBus, url: str, acme: openai.AsyncOpenAI,
                        globex: openai.AsyncOpenAI) -> None:
    hi: Any = [{"role": "user", "content": "my secret plan"}]
    first = await acme.chat.completions.create(model="tiny", messages=hi, max_tokens=4,
                                               extra_headers={"X-RL-Session": "acme-s"})

    async def session_info(key: str) -> tuple[int, Any]:
        async with http_session() as http, http.get(
                f"{url}/rl/sessions/acme-s", headers={"Authorization": f"Bearer {key}"}) as response:
            return response.status, await response.json()

    status, own = await session_info(TENANTS["acme"])
    assert status == 200 and own["request_ids"] == [first.id]
    # another tenant reads: the same 404 as an unknown id, an OpenAI error body, nothing of the session
    status, body = await session_info(TENANTS["globex"])
    assert status == 404 and body["error"]["code"] == "session_not_found" and body["error"]["type"]
    assert first.id not in json.dumps(body) and "turns" not in body
    # ... continues it
    with pytest.raises(openai.NotFoundError) as caught:
        await globex.chat.completions.create(model="tiny", messages=hi, max_tokens=4,
                                             extra_headers={"X-RL-Session": "acme-s"})
    assert caught.value.code == "session_not_found"
    # ... closes it with a reward
    async with http_session() as http, http.post(
            f"{url}/rl/sessions/acme-s/reward", json={"reward": 0},
            headers={"Authorization": f"Bearer {TENANTS['globex']}"}) as response:
        assert response.status == 404 and (await response.json())["error"]["code"] == "session_not_found"
    session = stack.gateway.sessions.get("acme-s")
    assert session is not None and session.tenant == "acme" and session.request_ids == [first.id]  # untouched
    assert not any((await bus.end_offsets(ROLLOUTS.name)).values())
    assert not any((await bus.end_offsets(REWARDS.name)).values())
    # the owner still can
    async with http_session() as http, http.post(
            f"{url}/rl/sessions/acme-s/reward", json={"reward": 1},
            headers={"Authorization": f"Bearer {TENANTS['acme']}"}) as response:
        assert response.status == 202


async def test_gateway_off_loopback_without_a_metrics_token_closes_its_operator_routes(
    tiny_hf_dir: Path, binds: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    from rlbus.models.hf_source import HFSource

    async with MemoryBus(topic_specs()) as bus:
        stack = serve_stack(bus=bus, source=HFSource(tiny_hf_dir), tenants=Tenants(TENANTS), model_name="tiny")
        stop = asyncio.Event()
        with caplog.at_level(logging.WARNING):
            task = asyncio.create_task(stack.gateway.run(stop, "0.0.0.0", 0))  # tenant tokens: it may listen
            try:
                await asyncio.wait_for(stack.gateway.listening.wait(), 60)
                assert any("RLBUS_METRICS_TOKEN" in r.getMessage() for r in caplog.records)
                url = f"http://127.0.0.1:{(stack.gateway.address or ('', 0))[1]}"
                status, text, _ = await get(f"{url}/metrics")
                assert status == 401 and "RLBUS_METRICS_TOKEN" in text
                assert (await get(f"{url}/metrics", TENANTS["acme"]))[0] == 401
                status, text, _ = await get(f"{url}/healthz")
                assert status == 200 and json.loads(text) == {"ok": True}
                async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TENANTS["globex"], max_retries=0) as c:
                    models = await c.models.list()
                assert [m.id for m in models.data] == ["tiny"]
            finally:
                stop.set()
                await task
    assert [host for host, _ in binds] == ["0.0.0.0"]
