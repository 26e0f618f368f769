"""Blobs over HTTP: an aiohttp server for any BlobStore, a parallel ranged client, a regional relay.

Every request is signed: ``sig = HMAC-SHA256(secret, METHOD \\n key \\n expires)`` (hex), with ``expires``
a Unix time a short TTL ahead, so a leaked URL stops working within a minute and cannot be replayed for
another key or method. Keys are checked by :func:`rlbus.blobs.base.check_key` on the server too, so
``..`` or absolute paths never reach the disk. Reads honour ``Range: bytes=a-b``; the client fetches
large blobs as parallel ranges and retries transport errors and 5xx with exponential backoff.

Who may do what (least privilege, :mod:`rlbus.blobs.keys`): the server holds one *master* secret, and a
request signed with it may do anything — the trainer and operators may keep using it. Every other
process holds a *scoped key* minted from it (``rlbus blobs key --role worker``): a credential
``rbk1.<claims>.<derived>`` whose claims name a key id, permissions (read = GET/HEAD, write = PUT,
delete, list), a key prefix and an expiry, and whose ``derived = HMAC-SHA256(master, claims)``. Its
holder signs with ``derived`` as above and sends the claims as the ``claims`` query parameter; the
server re-derives the secret from its master and the claims (no state, no key list), checks the
signature with ``hmac.compare_digest``, then the permission, the prefix (the blob key, or LIST's
prefix, must lie under it; a scope always ends with ``/``) and the expiry. A refusal is a 403 whose
text (and ``X-Rlbus-Refusal`` header, as a HEAD has no body) says which check failed, never a secret,
logged at WARNING with the key id, method and blob key; the client raises it as
:class:`~rlbus.errors.BlobAuthError`. :class:`HttpStore` and :func:`rlbus.blobs.open.open_store` take
either kind of secret the same way (``secret=``, ``RLBUS_BLOB_SECRET``), told apart by the ``rbk1.``
prefix.

A relay (``rlbus blobs serve --upstream URL``) is the same server with a local cache in front of an
upstream client: the first request for a key downloads it once (concurrent requests wait on that one
download, which resumes range by range across an origin's restart or a cut link: :mod:`rlbus.blobs.relay`),
later requests are served from the region's disk. Chunks are immutable, so the cache never
needs invalidation; garbage collection upstream deletes old versions and the relay's own GC follows.
A relay has two secrets: its upstream client holds a read-only ``relay`` key minted from the origin's
master (``RLBUS_UPSTREAM_BLOB_SECRET``), which is all a pull-through cache needs, and the relay verifies
its own clients with a master of its own (``RLBUS_BLOB_SECRET``). That master may be the origin's — one
set of worker keys then works against the origin and every relay — or the region's own, whose worker
keys are minted from it and cannot touch the origin at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import random
import time
from collections import Counter
from typing import Any, NoReturn

import aiohttp
from aiohttp import web

from rlbus.blobs.base import BlobStore, check_key
from rlbus.blobs.keys import CLAIMS_PARAM, ScopedKey, is_scoped, verify_claims
from rlbus.blobs.relay import PATIENCE_S, UpstreamCount, fetch_resumable
from rlbus.errors import BlobAuthError, BlobNotFound, BlobStoreError, ConfigError

log = logging.getLogger("rlbus.blobs")

SIGNATURE_TTL_S = 60.0
#: The response header that repeats a 403's reason: a HEAD response has no body to carry it.
REFUSAL_HEADER = "X-Rlbus-Refusal"


def sign(secret: str, method: str, key: str, expires: int) -> str:
    message = f"{method.upper()}\n{key}\n{expires}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signed_params(secret: str, method: str, key: str, ttl_s: float = SIGNATURE_TTL_S) -> dict[str, str]:
    expires = int(time.time() + ttl_s)
    return {"expires": str(expires), "sig": sign(secret, method, key, expires)}


def signature_problem(secret: str, method: str, key: str, params: Any, now: float | None = None) -> str | None:
    """Why the request's ``expires``/``sig`` do not authorise ``method`` on ``key`` under ``secret``;
    None when they do."""
    try:
        expires = int(params.get("expires", ""))
    except ValueError:
        return "missing or malformed signature"
    if expires < (now or time.time()):
        return "signature expired"
    # bytes, so a non-ASCII "sig" is a bad signature rather than compare_digest's TypeError
    if not hmac.compare_digest(sign(secret, method, key, expires).encode(), str(params.get("sig", "")).encode()):
        return "bad signature"
    return None


def verify(secret: str, method: str, key: str, params: Any, now: float | None = None) -> None:
    problem = signature_problem(secret, method, key, params, now)
    if problem is not None:
        raise web.HTTPForbidden(text=problem)


def _header_safe(text: str) -> str:
    return text.encode("ascii", "backslashreplace").decode().replace("\r", " ").replace("\n", " ")[:1000]


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
    """The HTTP face of a BlobStore; with ``upstream`` it is a read-only pull-through relay.

    ``secret`` is the master secret this server verifies with: requests signed with it may do anything,
    scoped keys minted from it what their claims allow. A relay's ``upstream`` is any store — an
    :class:`HttpStore` holding a read-only ``relay`` key of the origin is enough, as the relay only reads
    from it; ``secret`` is then the origin's master (so the origin's worker keys work here too) or the
    relay's own (so its workers' keys are good for this region only)."""

    def __init__(
        self, store: BlobStore, *, secret: str, upstream: BlobStore | None = None, patience_s: float = PATIENCE_S
    ) -> None:
        if is_scoped(secret):
            raise ConfigError("blobs.secret", "a blob server verifies with the master secret, not a scoped key "
                              "(rbk1.…); a relay's upstream key goes in RLBUS_UPSTREAM_BLOB_SECRET")
        self.store = store
        self.secret = secret
        self.upstream = upstream
        self.patience_s = patience_s
        #: What this relay fetched from its origin (`rlbus.blobs.relay`).
        self.upstream_count = UpstreamCount()
        #: Body bytes served, by the listener port they left through: an origin with one listener per region
        #: (``rlbus bench regions``) counts each region's egress.
        self.served_bytes: Counter[int] = Counter()
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

    def _authorise(self, request: web.Request, method: str, key: str) -> None:
        """Let the request through, or refuse it with a 403 saying why.

        Without ``claims`` the signature must be the master's; with them, the signature must be made
        with the secret derived from this server's master and exactly those claims (which proves the
        master minted them), and the claims must allow ``method`` on ``key`` now."""
        encoded = request.query.get(CLAIMS_PARAM)
        if encoded is None:
            problem = signature_problem(self.secret, method, key, request.query)
            if problem is not None:
                self._refuse(problem, "master", method, key)
            return
        try:
            claims, derived = verify_claims(self.secret, encoded)
        except ValueError as exc:
            self._refuse(f"malformed key: {exc}", "?", method, key)
        problem = signature_problem(derived, method, key, request.query)
        if problem is None:
            problem = claims.refusal(method, key)
        if problem is not None:
            self._refuse(problem, claims.key_id, method, key)

    @staticmethod
    def _refuse(reason: str, key_id: str, method: str, key: str) -> NoReturn:
        log.warning("blob request refused: key %s, %s %s: %s", key_id, method, ascii(key), reason)
        raise web.HTTPForbidden(text=reason, headers={REFUSAL_HEADER: _header_safe(reason)})

    @property
    def upstream_fetches(self) -> int:
        """Blobs this relay downloaded from its origin (each at most once)."""
        return self.upstream_count.blobs

    def _served(self, request: web.Request, body: bytes) -> bytes:
        sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
        if sockname:
            self.served_bytes[int(sockname[1])] += len(body)
        return body

    async def _health(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {"ok": True, "relay": self.upstream is not None}
        if self.upstream is not None:
            body["upstream"] = dataclasses.asdict(self.upstream_count)
        return web.json_response(body)

    async def _ensure_local(self, key: str) -> None:
        """Relay: fetch a missing key from upstream exactly once, however many requests wait for it."""
        if self.upstream is None or await self.store.exists(key):
            return
        pending = self._inflight.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._inflight[key] = pending
            try:
                data = await fetch_resumable(self.upstream, key, self.upstream_count, patience_s=self.patience_s)
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
        except BlobAuthError as exc:
            # the relay's own upstream key is refused: retrying cannot help, so a 403 rather than a 5xx
            self._refuse(f"the relay's upstream refused it: {exc}", "relay-upstream", "GET", key)

    async def _head(self, request: web.Request) -> web.Response:
        key = self._key(request)
        self._authorise(request, "GET", key)
        size = await self._size(key)
        return web.Response(headers={"Content-Length": str(size), "Accept-Ranges": "bytes"})

    async def _get(self, request: web.Request) -> web.Response:
        key = self._key(request)
        self._authorise(request, "GET", key)
        size = await self._size(key)
        header = request.headers.get("Range")
        if header is None:
            body = self._served(request, await self.store.get(key))
            return web.Response(body=body, headers={"Accept-Ranges": "bytes"})
        start, stop = _parse_range(header, size)
        body = self._served(request, await self.store.get_range(key, start, stop))
        return web.Response(
            status=206, body=body, headers={"Content-Range": f"bytes {start}-{stop - 1}/{size}"}
        )

    async def _put(self, request: web.Request) -> web.Response:
        key = self._key(request)
        self._authorise(request, "PUT", key)
        if self.upstream is not None:
            raise web.HTTPMethodNotAllowed("PUT", ["GET", "HEAD"], text="a relay is read-only")
        await self.store.put(key, await request.read())
        return web.Response(status=201)

    async def _delete(self, request: web.Request) -> web.Response:
        key = self._key(request)
        self._authorise(request, "DELETE", key)
        await self.store.delete(key)
        return web.Response(status=204)

    async def _list(self, request: web.Request) -> web.Response:
        prefix = request.query.get("prefix", "")
        self._authorise(request, "LIST", prefix)
        return web.json_response(await self.store.list(prefix))


class HttpStore(BlobStore):
    """Client of a BlobServer: signed requests, parallel ranged reads, retries with backoff.

    ``secret`` is the server's master secret or a scoped key (``rbk1.…``, :mod:`rlbus.blobs.keys`); with a
    scoped key every request is signed with its derived secret and carries its claims, and what the key
    does not allow comes back as :class:`~rlbus.errors.BlobAuthError` naming the reason."""

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
        self.scoped: ScopedKey | None = None
        if is_scoped(secret):
            try:
                self.scoped = ScopedKey.parse(secret)
            except ValueError as exc:
                raise ConfigError("blobs.secret", f"not a valid scoped key: {exc}") from None
        self._signing_secret = secret if self.scoped is None else self.scoped.secret
        self._claims = {} if self.scoped is None else {CLAIMS_PARAM: self.scoped.claims.encode()}
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
            params = {
                **kwargs.pop("params", {}),
                **self._claims,
                **signed_params(self._signing_secret, sign_as or method, key),
            }
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
    def _check(status: int, key: str, body: bytes, headers: Any = None) -> None:
        if status == 404:
            raise BlobNotFound(f"blob {key!r} not found")
        if status == 403:
            reason = body.decode(errors="replace") or (headers or {}).get(REFUSAL_HEADER) or "refused"
            raise BlobAuthError(f"blob {key!r}: {reason}")
        if status >= 400:
            raise BlobStoreError(f"blob {key!r}: HTTP {status} {body[:200]!r}")

    async def put(self, key: str, data: bytes) -> None:
        status, body, _ = await self._request("PUT", key, data=data)
        self._check(status, key, body)

    async def size(self, key: str) -> int:
        status, body, headers = await self._request("HEAD", key, sign_as="GET")
        self._check(status, key, body, headers)
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
