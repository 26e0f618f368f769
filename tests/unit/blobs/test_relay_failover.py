"""A relay that resumes its download across an origin outage, and a worker that reads around a dead relay."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from rlbus.blobs.failover import FailoverStore
from rlbus.blobs.http import BlobServer, HttpStore, serve
from rlbus.blobs.local import LocalStore
from rlbus.blobs.relay import UpstreamCount, fetch_resumable
from rlbus.errors import BlobNotFound, BlobStoreError
from rlbus_tools.services import free_port

SECRET = "test-secret"
MIB = 1024 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _origin_with_outage(root: Path, *, ok_first: int, down_s: float) -> tuple[web.AppRunner, str, dict[str, int]]:
    """An origin that answers ``ok_first`` range reads, then fails every request for ``down_s`` seconds."""
    server = BlobServer(LocalStore(root), secret=SECRET)
    seen = {"ranges": 0, "refused": 0}
    down: dict[str, float] = {}

    @web.middleware
    async def outage(request: web.Request, handler: Handler) -> web.StreamResponse:
        if "Range" in request.headers:
            if "until" not in down and seen["ranges"] >= ok_first:
                down["until"] = time.monotonic() + down_s
            if down.get("until", 0.0) > time.monotonic():
                seen["refused"] += 1
                raise web.HTTPServiceUnavailable(text="origin restarting")
            seen["ranges"] += 1
        return await handler(request)

    app = server.app()
    app.middlewares.append(outage)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", seen


async def test_a_relay_resumes_after_the_origin_goes_away_mid_download(tmp_path: Path) -> None:
    data = os.urandom(6 * MIB + 123)
    await LocalStore(tmp_path / "origin").put("policy/3/c0", data)
    runner, url, seen = await _origin_with_outage(tmp_path / "origin", ok_first=3, down_s=1.5)
    count = UpstreamCount()
    try:
        async with HttpStore(url, secret=SECRET, retries=0) as upstream:
            got = await fetch_resumable(upstream, "policy/3/c0", count, range_bytes=MIB, backoff_s=0.05)
    finally:
        await runner.cleanup()
    assert got == data
    assert seen["refused"] > 0, "the outage never happened: the test proves nothing"
    assert count.retried_ranges > 0
    # the three ranges fetched before the outage were kept, not downloaded again
    assert count.bytes == len(data) and seen["ranges"] == 7
    assert count.blobs == 1 and count.abandoned == 0


async def test_a_relay_gives_up_after_its_patience_and_caches_nothing_partial(tmp_path: Path) -> None:
    data = os.urandom(3 * MIB)
    await LocalStore(tmp_path / "origin").put("policy/4/c0", data)
    runner, url, _ = await _origin_with_outage(tmp_path / "origin", ok_first=1, down_s=60)
    relay = BlobServer(LocalStore(tmp_path / "relay"), secret=SECRET,
                       upstream=HttpStore(url, secret=SECRET, retries=0), patience_s=0.5)
    port = free_port()
    relay_runner = await serve(relay, "127.0.0.1", port)
    try:
        async with HttpStore(f"http://127.0.0.1:{port}", secret=SECRET, retries=0) as worker:
            with pytest.raises(BlobStoreError):
                await worker.get("policy/4/c0")
        assert relay.upstream_count.abandoned == 1
        assert not await relay.store.exists("policy/4/c0"), "half a chunk must never be cached"
    finally:
        await relay.upstream.close()  # type: ignore[union-attr]
        await relay_runner.cleanup()
        await runner.cleanup()


async def test_a_worker_reads_from_the_origin_while_its_relay_is_gone_and_goes_back(tmp_path: Path) -> None:
    origin = BlobServer(LocalStore(tmp_path / "origin"), secret=SECRET)
    origin_port = free_port()
    origin_runner = await serve(origin, "127.0.0.1", origin_port)
    origin_url = f"http://127.0.0.1:{origin_port}"
    blobs = {f"policy/5/c{i}": os.urandom(1000 + i) for i in range(3)}
    for key, value in blobs.items():
        await origin.store.put(key, value)
    relay_port = free_port()

    async def start_relay() -> tuple[BlobServer, web.AppRunner]:
        relay = BlobServer(LocalStore(tmp_path / "relay"), secret=SECRET, upstream=HttpStore(origin_url, secret=SECRET))
        return relay, await serve(relay, "127.0.0.1", relay_port)

    relay, relay_runner = await start_relay()
    store = FailoverStore(HttpStore(f"http://127.0.0.1:{relay_port}", secret=SECRET, retries=1, backoff_s=0.01),
                          HttpStore(origin_url, secret=SECRET), retry_primary_s=0.3)
    try:
        assert await store.get("policy/5/c0") == blobs["policy/5/c0"]
        assert store.failovers == 0 and relay.upstream_fetches == 1
        await relay.upstream.close()  # type: ignore[union-attr]
        await relay_runner.cleanup()  # the relay dies
        assert await store.get("policy/5/c1") == blobs["policy/5/c1"]
        assert await store.get_range("policy/5/c2", 10, 20) == blobs["policy/5/c2"][10:20]
        assert store.failovers == 2
        with pytest.raises(BlobNotFound):  # an answer, not a failure: raised as it is
            await store.get("policy/5/missing")
        relay, relay_runner = await start_relay()  # back, on the same address
        await asyncio.sleep(0.35)
        assert await store.get("policy/5/c2") == blobs["policy/5/c2"]
        assert store.failovers == 3 and relay.upstream_fetches == 1, "the relay is read again once it is back"
        await store.put("claims/r1", b"a claim-checked payload")  # writes go to the origin: a relay is read-only
        assert await origin.store.get("claims/r1") == b"a claim-checked payload"
    finally:
        await store.close()
        await relay.upstream.close()  # type: ignore[union-attr]
        await relay_runner.cleanup()
        await origin_runner.cleanup()


async def test_an_origin_counts_what_each_listener_served(tmp_path: Path) -> None:
    server = BlobServer(LocalStore(tmp_path / "origin"), secret=SECRET)
    await server.store.put("policy/6/c0", b"x" * 5000)
    runner = await serve(server, "127.0.0.1", first := free_port())
    second = free_port()
    await web.TCPSite(runner, "127.0.0.1", second).start()
    try:
        for port, reads in ((first, 1), (second, 2)):
            async with HttpStore(f"http://127.0.0.1:{port}", secret=SECRET) as client:
                for _ in range(reads):
                    await client.get("policy/6/c0")
                await client.get_range("policy/6/c0", 0, 100)
    finally:
        await runner.cleanup()
    assert server.served_bytes == {first: 5100, second: 10100}
