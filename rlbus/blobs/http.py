"""Blobs over HTTP: an aiohttp server for any BlobStore, a parallel ranged client, a regional relay.

Every request is signed: ``sig = HMAC-SHA256(secret, METHOD \\n key \\n expires)`` (hex), with ``expires``
a Unix time a short TTL ahead, so a leaked URL stops working within a minute and cannot be replayed for
another key or method. Keys are checked by :func:`rlbus.blobs.base.check_key` on the server too, so
``..`` or absolute paths never reach the disk. Reads honour ``Range: bytes=a-b``; the client fetches
large blobs as parallel ranges and retries transport errors and 5xx with exponential backoff.

A relay (``rlbus blobs serve --upstream URL``) is the same server with a local cache in front of an
upstream client: the first request for a key downloads it once (concurrent requests wait on that one
download), later requests are served from the region's disk. Chunks are immutable, so the cache never
needs invalidation; garbage collection upstream deletes old versions and the relay's own GC follows.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random
import time
from typing import Any

import aiohttp
from aiohttp import web

from rlbus.blobs.base import BlobStore, check_key
from rlbus.errors import BlobAuthError, BlobNotFound, BlobStoreError

log = logging.getLogger("rlbus.blobs")

SIGNATURE_TTL_S = 60.0


def sign(secret: str, method: str, key: str, expires: int) -> str:
    message = f"{method.upper()}\n{key}\n{expires}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signed_params(secret: str, method: str, key: str, ttl_s: float = SIGNATURE_TTL_S) -> dict[str, str]:
    expires = int(time.time() + ttl_s)
    return {"expires": str(expires), "sig": sign(secret, method, key, expires)}


def verify(secret: str, method: str, key: str, params: Any, now: float | None = None) -> None:
    try:
        expires = int(params.get("expires", ""))
    except ValueError:
        raise web.HTTPForbidden(text="missing or malformed signature") from None
    if expires < (now or time.time()):
        raise web.HTTPForbidden(text="signature expired")
    if not hmac.compare_digest(sign(secret, method, key, expires), params.get("sig", "")):
        raise web.HTTPForbidden(text="bad signature")


def _parse_range(header: str, size: int) -> tuple[int, int]:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` → [start, stop); 416 when unsatisfiable."""
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":
            start, stop = max(0, size - int(last)), size
        else:
            start = int(first)
            stop = min(size, int(last) + 1) if last else size
    except ValueError:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"}) from None
    if start >= size or stop <= start:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    return start, stop


class BlobServer:
    """The HTTP face of a BlobStore; with ``upstream`` it is a read-only pull-through relay."""

    def __init__(self, store: BlobStore, *, secret: str, upstream: BlobStore | None = None) -> None:
        self.store = store
        self.secret = secret
        self.upstream = upstream
        self.upstream_fetches = 0
        self._inflight: dict[str, asyncio.Future[None]] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/v1/list", self._list)
        app.router.add_route("HEAD", "/v1/blobs/{key:.+}", self._head)
        app.router.add_get("/v1/blobs/{key:.+}", self._get, allow_head=False)
        app.router.add_put("/v1/blobs/{key:.+}", self._put)
        app.router.add_delete("/v1/blobs/{key:.+}", self._delete)
        return app

    def _key(self, request: web.Request) -> str:
        try:
            return check_key(request.match_info["key"])
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "relay": self.upstream is not None})

    async def _ensure_local(self, key: str) -> None:
        """Relay: fetch a missing key from upstream exactly once, however many requests wait for it."""
        if self.upstream is None or await self.store.exists(key):
            return
        pending = self._inflight.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._inflight[key] = pending
            try:
                self.upstream_fetches += 1
                data = await self.upstream.get(key)
                await self.store.put(key, data)
                pending.set_result(None)
            except BaseException as exc:
                pending.set_exception(exc)
                pending.exception()  # retrieved here; concurrent waiters re-raise it from their await
                raise
            finally:
                del self._inflight[key]
        else:
            await asyncio.shield(pending)

    async def _size(self, key: str) -> int:
        try:
            await self._ensure_local(key)
            return await self.store.size(key)
        except BlobNotFound:
            raise web.HTTPNotFound(text=f"no blob {key}") from None

    async def _head(self, request: web.Request) -> web.Response:
        key = self._key(request)
        verify(self.secret, "GET", key, request.query)
        size = await self._size(key)
        return web.Response(headers={"Content-Length": str(size), "Accept-Ranges": "bytes"})

    async def _get(self, request: web.Request) -> web.Response:
        key = self._key(request)
        verify(self.secret, "GET", key, request.query)
        size = await self._size(key)
        header = request.headers.get("Range")
        if header is None:
            return web.Response(body=await self.store.get(key), headers={"Accept-Ranges": "bytes"})
        start, stop = _parse_range(header, size)
        body = await self.store.get_range(key, start, stop)
        return web.Response(
            status=206, body=body, headers={"Content-Range": f"bytes {start}-{stop - 1}/{size}"}
        )

    async def _put(self, request: web.Request) -> web.Response:
        key = self._key(request)
        verify(self.secret, "PUT", key, request.query)
        if self.upstream is not None:
            raise web.HTTPMethodNotAllowed("PUT", ["GET", "HEAD"], text="a relay is read-only")
        await self.store.put(key, await request.read())
        return web.Response(status=201)

    async def _delete(self, request: web.Request) -> web.Response:
        key = self._key(request)
        verify(self.secret, "DELETE", key, request.query)
        await self.store.delete(key)
        return web.Response(status=204)

    async def _list(self, request: web.Request) -> web.Response:
        prefix = request.query.get("prefix", "")
        verify(self.secret, "LIST", prefix, request.query)
        return web.json_response(await self.store.list(prefix))


class HttpStore(BlobStore):
    """Client of a BlobServer: signed requests, parallel ranged reads, retries with backoff."""

    def __init__(
        self,
        url: str,
        *,
        secret: str,
        parallelism: int = 8,
        range_bytes: int = 1024 * 1024,
        retries: int = 5,
        backoff_s: float = 0.05,
        timeout_s: float = 30.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.secret = secret
        self.range_bytes = range_bytes
        self.retries = retries
        self.backoff_s = backoff_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._slots = asyncio.Semaphore(parallelism)
        self._session: aiohttp.ClientSession | None = None
        self.bytes_fetched = 0

    def __repr__(self) -> str:
        return f"HttpStore({self.url!r})"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _request(
        self, method: str, key: str, *, sign_as: str | None = None, path: str | None = None, **kwargs: Any
    ) -> tuple[int, bytes, Any]:
        url = f"{self.url}{path or '/v1/blobs/' + check_key(key)}"
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            params = {**kwargs.pop("params", {}), **signed_params(self.secret, sign_as or method, key)}
            try:
                async with self._slots, self._client().request(method, url, params=params, **kwargs) as response:
                    body = await response.read()
                    if response.status < 500:
                        return response.status, body, response.headers
                    last = BlobStoreError(f"{method} {url}: HTTP {response.status} {body[:200]!r}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = BlobStoreError(f"{method} {url}: {type(exc).__name__}: {exc}")
            if attempt < self.retries:
                await asyncio.sleep(self.backoff_s * 2**attempt * (0.5 + random.random()))
        assert last is not None
        raise last

    @staticmethod
    def _check(status: int, key: str, body: bytes) -> None:
        if status == 404:
            raise BlobNotFound(f"blob {key!r} not found")
        if status == 403:
            raise BlobAuthError(f"blob {key!r}: {body.decode(errors='replace')}")
        if status >= 400:
            raise BlobStoreError(f"blob {key!r}: HTTP {status} {body[:200]!r}")

    async def put(self, key: str, data: bytes) -> None:
        status, body, _ = await self._request("PUT", key, data=data)
        self._check(status, key, body)

    async def size(self, key: str) -> int:
        status, body, headers = await self._request("HEAD", key, sign_as="GET")
        self._check(status, key, body)
        return int(headers["Content-Length"])

    async def get_range(self, key: str, start: int, stop: int) -> bytes:
        status, body, _ = await self._request("GET", key, headers={"Range": f"bytes={start}-{stop - 1}"})
        self._check(status, key, body)
        if status != 206 or len(body) != stop - start:
            raise BlobStoreError(f"blob {key!r}: asked for {stop - start} bytes at {start}, got {len(body)}")
        self.bytes_fetched += len(body)
        return body

    async def get(self, key: str) -> bytes:
        size = await self.size(key)
        if size <= self.range_bytes:
            status, body, _ = await self._request("GET", key)
            self._check(status, key, body)
            self.bytes_fetched += len(body)
            return body
        starts = range(0, size, self.range_bytes)
        parts = await asyncio.gather(*(self.get_range(key, s, min(size, s + self.range_bytes)) for s in starts))
        return b"".join(parts)

    async def delete(self, key: str) -> None:
        status, body, _ = await self._request("DELETE", key)
        if status != 404:
            self._check(status, key, body)

    async def list(self, prefix: str = "") -> list[str]:
        status, body, _ = await self._request("GET", prefix, sign_as="LIST", path="/v1/list", params={"prefix": prefix})
        self._check(status, prefix, body)
        import json

        keys: list[str] = json.loads(body)
        return keys


async def serve(server: BlobServer, host: str, port: int) -> web.AppRunner:
    """Start the server; the caller keeps the runner and calls ``await runner.cleanup()`` to stop."""
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("blob server on http://%s:%d (%s)", host, port, "relay" if server.upstream else "origin")
    return runner
