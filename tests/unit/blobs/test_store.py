"""Blob stores: local directory, the signed HTTP server and client, and the regional relay."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from rlbus.blobs.base import check_key
from rlbus.blobs.http import BlobServer, HttpStore, serve, sign, signed_params
from rlbus.blobs.local import LocalStore
from rlbus.blobs.open import open_store
from rlbus.errors import BlobAuthError, BlobNotFound, BlobStoreError
from rlbus_tools.services import free_port

SECRET = "test-secret"


@pytest.fixture
async def origin(tmp_path: Path) -> AsyncIterator[tuple[str, BlobServer]]:
    server = BlobServer(LocalStore(tmp_path / "origin"), secret=SECRET)
    port = free_port()
    runner = await serve(server, "127.0.0.1", port)
    yield f"http://127.0.0.1:{port}", server
    await runner.cleanup()


@pytest.mark.parametrize("key", ["../etc/passwd", "/abs", "a/../../b", "a//b", ".hidden", "a/./b", "", "a b"])
def test_bad_keys_are_rejected(key: str) -> None:
    with pytest.raises(ValueError):
        check_key(key)


async def test_local_store_round_trip(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    await store.put("policy/3/chunk-000", b"abcdef")
    assert await store.get("policy/3/chunk-000") == b"abcdef"
    assert await store.get_range("policy/3/chunk-000", 2, 5) == b"cde"
    assert await store.size("policy/3/chunk-000") == 6
    assert await store.list("policy/") == ["policy/3/chunk-000"]
    await store.delete("policy/3/chunk-000")
    with pytest.raises(BlobNotFound):
        await store.get("policy/3/chunk-000")
    assert not [p for p in await asyncio.to_thread(lambda: list(tmp_path.rglob(".tmp-*")))]


async def test_http_round_trip_with_parallel_ranges(origin: tuple[str, BlobServer]) -> None:
    url, _ = origin
    data = os.urandom(5 * 1024 * 1024 + 17)
    async with HttpStore(url, secret=SECRET, range_bytes=512 * 1024) as client:
        await client.put("m/1/c0", data)
        assert await client.size("m/1/c0") == len(data)
        assert await client.get("m/1/c0") == data
        assert await client.get_range("m/1/c0", 100, 200) == data[100:200]
        assert await client.list("m/") == ["m/1/c0"]
        await client.delete("m/1/c0")
        with pytest.raises(BlobNotFound):
            await client.get("m/1/c0")


async def test_unsigned_expired_and_wrong_secret_are_refused(origin: tuple[str, BlobServer]) -> None:
    url, _ = origin
    async with HttpStore(url, secret=SECRET) as good:
        await good.put("k/1", b"x")
    async with HttpStore(url, secret="wrong") as bad:
        with pytest.raises(BlobAuthError):
            await bad.get("k/1")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/blobs/k/1") as response:
            assert response.status == 403
        expired = int(time.time()) - 1
        params = {"expires": str(expired), "sig": sign(SECRET, "GET", "k/1", expired)}
        async with session.get(f"{url}/v1/blobs/k/1", params=params) as response:
            assert response.status == 403 and "expired" in await response.text()
        # A valid GET signature does not authorise a PUT of the same key.
        async with session.put(f"{url}/v1/blobs/k/1", params=signed_params(SECRET, "GET", "k/1"), data=b"y") as r:
            assert r.status == 403


async def test_path_traversal_is_rejected_by_the_server(origin: tuple[str, BlobServer], tmp_path: Path) -> None:
    url, _ = origin
    (tmp_path / "secret.txt").write_text("do not serve")
    async with aiohttp.ClientSession() as session:
        for raw in ("..%2Fsecret.txt", "%2E%2E/secret.txt", "a/..%2F..%2Fsecret.txt"):
            key = raw.replace("%2F", "/").replace("%2E", ".")
            params = signed_params(SECRET, "GET", key)
            async with session.get(f"{url}/v1/blobs/{raw}", params=params) as response:
                assert response.status in (400, 403, 404)
                assert b"do not serve" not in await response.read()


async def test_client_retries_server_errors(tmp_path: Path) -> None:
    failures = {"left": 2}
    server = BlobServer(LocalStore(tmp_path), secret=SECRET)

    @web.middleware
    async def flaky(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.method == "GET" and failures["left"] > 0:
            failures["left"] -= 1
            return web.Response(status=503)
        return await handler(request)

    app = server.app()
    app.middlewares.append(flaky)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with HttpStore(f"http://127.0.0.1:{port}", secret=SECRET, backoff_s=0.01) as client:
            await client.put("r/1", b"payload")
            assert await client.get("r/1") == b"payload"
            failures["left"] = 100
            with pytest.raises(BlobStoreError):
                await HttpStore(f"http://127.0.0.1:{port}", secret=SECRET, retries=2, backoff_s=0.01).get("r/1")
    finally:
        await runner.cleanup()


async def test_relay_fetches_each_blob_once_for_many_workers(origin: tuple[str, BlobServer], tmp_path: Path) -> None:
    url, _ = origin
    data = os.urandom(3 * 1024 * 1024)
    async with HttpStore(url, secret=SECRET) as trainer:
        await trainer.put("policy/7/c0", data)
    relay = BlobServer(LocalStore(tmp_path / "relay"), secret=SECRET, upstream=HttpStore(url, secret=SECRET))
    port = free_port()
    runner = await serve(relay, "127.0.0.1", port)
    try:
        workers = [HttpStore(f"http://127.0.0.1:{port}", secret=SECRET) for _ in range(4)]
        results = await asyncio.gather(*(w.get("policy/7/c0") for w in workers))
        assert all(r == data for r in results)
        assert relay.upstream_fetches == 1
        with pytest.raises(BlobNotFound):
            await workers[0].get("policy/7/missing")
        with pytest.raises(BlobStoreError):
            await workers[0].put("policy/8/c0", b"relay is read-only")
        for w in workers:
            await w.close()
    finally:
        await relay.upstream.close()  # type: ignore[union-attr]
        await runner.cleanup()


def test_open_store(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert isinstance(open_store("http://127.0.0.1:1", secret="s"), HttpStore)
