"""``rlbus dashboard``: one web page with live charts of a run, served by aiohttp.

The page (``static/index.html`` + ``dashboard.js`` + ``dashboard.css``, hand-written, drawn as SVG by
the page's own code — nothing is fetched from the internet) polls ``/api/snapshot`` every 1.5 s; the
snapshot is :meth:`rlbus.observe.collector.Collector.snapshot`. Polling instead of a push channel keeps
the server stateless: any number of browsers, reconnects for free, and a snapshot is cheap.

`Dashboard` serves a collector for a real run (Kafka + Redis, or any bus and state store).
`DemoFeed` serves the embedded ``rlbus demo``: it attaches a collector to the demo's in-memory bus once
the bus exists, and copies what only the demo process knows — trainer step metrics and every worker's
swap pauses — into it, as heartbeats carry them in a distributed run.

Access (`rlbus.exposure`): with ``$RLBUS_DASHBOARD_TOKEN`` (or a file named by
``$RLBUS_DASHBOARD_TOKEN_FILE``) set, every path — page, static files, ``/api/snapshot`` — needs it:
``Authorization: Bearer <token>``, or from a browser HTTP Basic with the token as the password (the
browser prompts; any user name). Without a token the dashboard binds only loopback: any other host is a
ConfigError (``dashboard.host``) before anything listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rlbus.aio import wait_event
from rlbus.bus.base import Bus
from rlbus.bus.replay import Bound
from rlbus.exposure import BearerAuth, check_bind, load_token
from rlbus.observe.collector import Collector
from rlbus.state.base import StateStore

if TYPE_CHECKING:
    from rlbus.demo import Demo, DemoResult

STATIC = Path(__file__).parent / "static"
DEFAULT_PORT = 8480

Snapshot = Callable[[], dict[str, Any]]


def make_app(snapshot: Snapshot, *, token: str | None = None) -> web.Application:
    """The page, its static files and ``/api/snapshot``; with ``token``, all of them need it."""

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    async def api_snapshot(request: web.Request) -> web.Response:
        return web.json_response(snapshot(), headers={"Cache-Control": "no-store"})

    auth = BearerAuth("dashboard", token, browser=True) if token is not None else None
    app = web.Application(middlewares=[auth.middleware] if auth is not None else [])
    app.router.add_get("/", index)
    app.router.add_get("/api/snapshot", api_snapshot)
    app.router.add_static("/static/", STATIC)
    return app


def dashboard_token(token: str | None = None, *, host: str | None,
                    environ: Mapping[str, str] = os.environ) -> str | None:
    """``token``, else the one configured in ``environ``; refuses (ConfigError) a host other than loopback
    without one."""
    token = token or load_token("dashboard", environ=environ)
    check_bind(host, service="dashboard", auth_configured=token is not None)
    return token


@contextlib.asynccontextmanager
async def serving(snapshot: Snapshot, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                  token: str | None = None, environ: Mapping[str, str] = os.environ) -> AsyncIterator[str]:
    """Serve the dashboard while the block runs; yields its URL (``port`` 0 picks a free port). ``token``
    (else ``$RLBUS_DASHBOARD_TOKEN`` / ``_FILE`` in ``environ``) protects every path; without one, a host
    other than loopback is a ConfigError before binding."""
    token = dashboard_token(token, host=host, environ=environ)
    runner = web.AppRunner(make_app(snapshot, token=token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        yield f"http://{host}:{bound}/"
    finally:
        await runner.cleanup()


class Dashboard:
    """Follows a run with a `Collector` and serves the page until ``stop`` is set."""

    def __init__(
        self,
        *,
        bus: Bus,
        state: StateStore | None = None,
        start: Bound | None = None,
        model_id: str = "policy",
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        on_ready: Callable[[str], None] | None = None,
        token: str | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        """``token``: see `serving`; resolved and checked against ``host`` here, so a dashboard that may
        not listen on ``host`` fails before it starts following the run."""
        self.token = dashboard_token(token, host=host, environ=environ)
        self.collector = Collector(bus=bus, state=state, start=start, model_id=model_id)
        self.host = host
        self.port = port
        self._on_ready = on_ready
        self._environ = environ

    async def run(self, stop: asyncio.Event) -> None:
        async with serving(self.collector.snapshot, self.host, self.port, token=self.token,
                           environ=self._environ) as url:
            if self._on_ready is not None:
                self._on_ready(url)
            await self.collector.run(stop)


class DemoFeed:
    """The dashboard's view of an embedded `rlbus.demo.Demo` running in the same event loop."""

    def __init__(self, demo: Demo, *, every_s: float = 0.5, clock: Callable[[], float] = time.time) -> None:
        self.demo = demo
        self.collector: Collector | None = None
        self._every_s = every_s
        self._clock = clock
        self._steps_copied = 0
        self._swaps_copied: dict[int, int] = {}

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = self.collector.snapshot() if self.collector is not None else {"now": self._clock()}
        snap["phase"] = self.demo.phase
        return snap

    async def run(self, stop: asyncio.Event) -> None:
        """Wait for the demo's bus (it exists once the warm start is done), then follow it."""
        while self.demo.bus is None:
            if stop.is_set():
                return
            await asyncio.sleep(0.2)
        self.collector = Collector(bus=self.demo.bus, state=self.demo.state, poll_s=0.5)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.collector.run(stop))
            while not stop.is_set():
                self.copy()
                await wait_event(stop, self._every_s)
            self.copy()

    def copy(self) -> None:
        """Move new step metrics and swap pauses from the demo's objects into the collector."""
        assert self.collector is not None
        now = self._clock()
        steps = self.demo.step_metrics
        for metrics in steps[self._steps_copied :]:
            self.collector.add_step(metrics, now)
        self._steps_copied = len(steps)
        for i, (worker, sync) in enumerate(zip(self.demo.rollout_workers, self.demo.syncs, strict=False)):
            history = sync.history
            done = self._swaps_copied.get(i, 0)
            for seq, stats in enumerate(history[done:], start=done):
                self.collector.add_swap(worker.worker_id, seq, stats.swap_pause_s, now, stats.version)
            self._swaps_copied[i] = len(history)


async def run_demo(demo: Demo, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                   on_ready: Callable[[str], None] | None = None, token: str | None = None) -> DemoResult:
    """Run ``demo`` while serving its dashboard (``rlbus demo --dashboard PORT``); the page goes away
    with the run. ``token``: see `serving`."""
    feed = DemoFeed(demo)
    stop = asyncio.Event()
    async with serving(feed.snapshot, host, port, token=token) as url:
        if on_ready is not None:
            on_ready(url)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(feed.run(stop))
            try:
                return await demo.run()
            finally:
                stop.set()


def parse_since(text: str, *, now: float | None = None) -> Bound | None:
    """Where the dashboard starts reading: ``all`` (the beginning), ``30m`` / ``2h`` / ``90s`` ago, an
    ISO-8601 time or an offset."""
    text = text.strip()
    if text == "all":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd])", text)
    if match:
        seconds = float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        return Bound(time_ms=int(((time.time() if now is None else now) - seconds) * 1000))
    return Bound.parse(text)
