"""Scoped blob keys against a real BlobServer on a free loopback port: what each role's key may do, that a
refused write leaves nothing behind, prefix scope, expiry, the master secret keeping full access, and a relay
whose upstream client holds only a read-only key. Under a few seconds."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from rlbus.blobs.http import REFUSAL_HEADER, BlobServer, HttpStore, serve, signed_params
from rlbus.blobs.keys import CLAIMS_PARAM, KeyClaims, ScopedKey, mint, mint_for_role
from rlbus.blobs.local import LocalStore
from rlbus.errors import BlobAuthError, BlobNotFound
from rlbus.weights.layout import chunk_key, manifest_key
from rlbus_tools.services import free_port

MASTER = uuid.uuid4().hex
CHUNK = chunk_key("run7", 3, "delta", 0)  # run7/0000000003/delta-00000
OTHER = chunk_key("run8", 3, "delta", 0)


@pytest.fixture
async def origin(tmp_path: Path) -> AsyncIterator[str]:
    port = free_port()
    runner = await serve(BlobServer(LocalStore(tmp_path / "origin"), secret=MASTER), "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    async with HttpStore(url, secret=MASTER) as trainer:
        await trainer.put(CHUNK, b"delta chunk of run7")
        await trainer.put(OTHER, b"delta chunk of run8")
    yield url
    await runner.cleanup()


async def test_a_worker_key_reads_and_nothing_else(origin: str, caplog: pytest.LogCaptureFixture) -> None:
    worker_key = mint_for_role(MASTER, "worker", key_id="worker-eu-1")
    manifest = manifest_key("run7", 4, "delta")
    async with HttpStore(origin, secret=worker_key) as worker, HttpStore(origin, secret=MASTER) as trainer:
        assert await worker.get(CHUNK) == b"delta chunk of run7"
        assert await worker.size(CHUNK) == len(b"delta chunk of run7")  # HEAD
        assert await worker.get_range(CHUNK, 0, 5) == b"delta"
        with caplog.at_level(logging.WARNING, logger="rlbus.blobs"):
            with pytest.raises(BlobAuthError, match="lacks the write permission"):
                await worker.put(manifest, b"a forged manifest")
        assert "worker-eu-1" in caplog.text and "PUT" in caplog.text and manifest in caplog.text
        assert MASTER not in caplog.text
        with pytest.raises(BlobAuthError, match="lacks the delete permission"):
            await worker.delete(CHUNK)
        with pytest.raises(BlobAuthError, match="lacks the list permission"):
            await worker.list("run7/")
        # nothing was written or deleted
        assert not await trainer.exists(manifest)
        assert await trainer.get(CHUNK) == b"delta chunk of run7"
        assert await trainer.list("run7/") == [CHUNK]


async def test_a_refused_head_says_why(origin: str) -> None:
    """A HEAD has no body, so the reason rides a header; size() and exists() still name it."""
    key = mint_for_role(MASTER, "worker", prefix="run7/")
    async with HttpStore(origin, secret=key) as worker:
        with pytest.raises(BlobAuthError, match="scoped to prefix 'run7/'"):
            await worker.size(OTHER)
        with pytest.raises(BlobAuthError, match="outside"):
            await worker.exists(OTHER)


async def test_a_prefix_scoped_key_stays_in_its_prefix(origin: str) -> None:
    key = mint_for_role(MASTER, "operator", prefix="run7/")
    async with HttpStore(origin, secret=key) as operator, HttpStore(origin, secret=MASTER) as trainer:
        await trainer.put("run70/0000000001/delta-00000", b"a neighbour run")
        assert await operator.get(CHUNK) == b"delta chunk of run7"
        assert await operator.list("run7/") == [CHUNK]
        for outside in (OTHER, "run70/0000000001/delta-00000"):
            with pytest.raises(BlobAuthError, match="outside"):
                await operator.get(outside)
            with pytest.raises(BlobAuthError, match="outside"):
                await operator.delete(outside)
        for prefix in ("", "run", "run70/"):
            with pytest.raises(BlobAuthError, match="outside"):
                await operator.list(prefix)
        assert await trainer.get(OTHER) == b"delta chunk of run8"
    # a traversal that starts inside the prefix never gets past the key check
    async with aiohttp.ClientSession() as session:
        scoped = ScopedKey.parse(key)
        params = {CLAIMS_PARAM: scoped.claims.encode(), **signed_params(scoped.secret, "GET", "run7/../run8/x")}
        async with session.get(f"{origin}/v1/blobs/run7/..%2Frun8/0000000003/delta-00000", params=params) as r:
            assert r.status in (400, 403, 404) and b"delta chunk of run8" not in await r.read()


async def test_an_expired_key_is_refused(origin: str) -> None:
    expired = mint(MASTER, KeyClaims("worker-old", frozenset({"read"}), "", 1_000_000_000))
    async with HttpStore(origin, secret=expired) as worker:
        with pytest.raises(BlobAuthError, match="worker-old' expired at 2001-09-09"):
            await worker.get(CHUNK)


async def test_forged_claims_and_foreign_keys_are_refused(origin: str) -> None:
    worker_key = ScopedKey.parse(mint_for_role(MASTER, "worker"))
    trainer_claims = KeyClaims(worker_key.claims.key_id, frozenset({"read", "write", "delete", "list"}))
    forged = str(ScopedKey(trainer_claims, worker_key.secret))  # claims edited, derived secret kept
    foreign = mint_for_role("another-master", "trainer")
    for key in (forged, foreign):
        async with HttpStore(origin, secret=key) as client:
            with pytest.raises(BlobAuthError, match="bad signature"):
                await client.put(manifest_key("run7", 4, "delta"), b"x")
            with pytest.raises(BlobAuthError, match="bad signature"):
                await client.get(CHUNK)
    async with aiohttp.ClientSession() as session:
        params = {CLAIMS_PARAM: "bm90IGNsYWltcw", **signed_params(MASTER, "GET", CHUNK)}
        async with session.head(f"{origin}/v1/blobs/{CHUNK}", params=params) as response:
            assert response.status == 403 and "malformed key" in response.headers[REFUSAL_HEADER]


async def test_the_master_secret_still_does_everything(origin: str) -> None:
    async with HttpStore(origin, secret=MASTER) as trainer:
        await trainer.put("run9/0000000001/manifest.delta", b"manifest")
        assert await trainer.get("run9/0000000001/manifest.delta") == b"manifest"
        assert await trainer.size("run9/0000000001/manifest.delta") == 8
        assert await trainer.list("") == sorted([CHUNK, OTHER, "run9/0000000001/manifest.delta"])
        await trainer.delete("run9/0000000001/manifest.delta")
        with pytest.raises(BlobNotFound):
            await trainer.get("run9/0000000001/manifest.delta")
    # and a trainer key minted from it does the same
    async with HttpStore(origin, secret=mint_for_role(MASTER, "trainer", ttl="1h")) as trainer:
        await trainer.put("run9/0000000002/manifest.delta", b"m2")
        assert await trainer.list("run9/") == ["run9/0000000002/manifest.delta"]
        await trainer.delete("run9/0000000002/manifest.delta")


async def test_a_relay_with_a_read_only_upstream_key_serves_chunks(origin: str, tmp_path: Path) -> None:
    relay_master = uuid.uuid4().hex  # the region's own master: its workers' keys are no good at the origin
    upstream = HttpStore(origin, secret=mint_for_role(MASTER, "relay", prefix="run7/"))
    relay = BlobServer(LocalStore(tmp_path / "relay"), secret=relay_master, upstream=upstream)
    port = free_port()
    runner = await serve(relay, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    try:
        async with HttpStore(url, secret=mint_for_role(relay_master, "worker")) as worker:
            assert await worker.get(CHUNK) == b"delta chunk of run7"
            assert await worker.get(CHUNK) == b"delta chunk of run7"
            assert relay.upstream_fetches == 1
            with pytest.raises(BlobAuthError, match="lacks the write permission"):
                await worker.put("run7/0000000009/delta-00000", b"x")
            # the relay's upstream key is scoped to run7/: its refusal reaches the worker as a refusal
            with pytest.raises(BlobAuthError, match="upstream refused"):
                await worker.get(OTHER)
        async with HttpStore(origin, secret=mint_for_role(relay_master, "worker"), retries=0) as stray:
            with pytest.raises(BlobAuthError, match="bad signature"):
                await stray.get(CHUNK)
    finally:
        await upstream.close()
        await runner.cleanup()


def test_a_server_refuses_a_scoped_key_as_its_master(tmp_path: Path) -> None:
    from rlbus.errors import ConfigError

    with pytest.raises(ConfigError, match="master secret"):
        BlobServer(LocalStore(tmp_path), secret=mint_for_role(MASTER, "relay"))
