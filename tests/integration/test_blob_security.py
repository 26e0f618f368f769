"""The signed blob server against tampering the unit tests (tests/unit/weights/test_store.py: unsigned,
expired, wrong secret, a GET signature used for a PUT, path traversal) leave out, and the signing secret
coming from a file or the environment, never from the command line.

Real server on a free loopback port; under a second.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from typer.testing import CliRunner

from rlbus.blobs.http import BlobServer, HttpStore, serve, sign, signed_params
from rlbus.blobs.local import LocalStore
from rlbus_tools.services import free_port

SECRET = uuid.uuid4().hex


@pytest.fixture
async def origin(tmp_path: Path) -> AsyncIterator[str]:
    port = free_port()
    runner = await serve(BlobServer(LocalStore(tmp_path / "origin"), secret=SECRET), "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    async with HttpStore(url, secret=SECRET) as client:
        await client.put("m/1/a", b"chunk a")
        await client.put("m/1/b", b"chunk b")
    yield url
    await runner.cleanup()


async def test_a_signature_is_bound_to_its_key_expiry_and_method(origin: str) -> None:
    good = signed_params(SECRET, "GET", "m/1/a")
    later = str(int(good["expires"]) + 3600)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{origin}/v1/blobs/m/1/a", params=good) as response:
            assert response.status == 200 and await response.read() == b"chunk a"
        # The same signature for another key, a stretched expiry, another method: all refused.
        async with session.get(f"{origin}/v1/blobs/m/1/b", params=good) as response:
            assert response.status == 403 and b"chunk b" not in await response.read()
        async with session.get(f"{origin}/v1/blobs/m/1/a", params={**good, "expires": later}) as response:
            assert response.status == 403
        async with session.delete(f"{origin}/v1/blobs/m/1/a", params=good) as response:
            assert response.status == 403
        tampered = {**good, "sig": good["sig"][:-1] + ("0" if good["sig"][-1] != "0" else "1")}
        async with session.get(f"{origin}/v1/blobs/m/1/a", params=tampered) as response:
            assert response.status == 403
        # A listing signed for one prefix does not list another.
        listing = signed_params(SECRET, "LIST", "m/1/a")
        async with session.get(f"{origin}/v1/list", params={**listing, "prefix": "m/"}) as response:
            assert response.status == 403
        # Far-future expiry signed with the wrong secret.
        forever = int(time.time()) + 10**8
        forged = {"expires": str(forever), "sig": sign("guess", "GET", "m/1/a", forever)}
        async with session.get(f"{origin}/v1/blobs/m/1/a", params=forged) as response:
            assert response.status == 403
    async with HttpStore(origin, secret=SECRET) as client:
        assert await client.get("m/1/a") == b"chunk a"  # nothing above changed the blob


def test_blobs_serve_takes_its_secret_from_a_file_or_the_environment(tmp_path: Path) -> None:
    from rlbus.cli.app import app

    runner = CliRunner()
    help_text = runner.invoke(app, ["blobs", "serve", "--help"], env={"COLUMNS": "200"}).output
    assert "--secret-file" in help_text and "RLBUS_BLOB_SECRET" in help_text
    missing = runner.invoke(app, ["blobs", "serve", "--root", str(tmp_path)], env={"RLBUS_BLOB_SECRET": ""})
    assert missing.exit_code != 0 and "RLBUS_BLOB_SECRET" in missing.output
    empty = tmp_path / "empty"
    empty.write_text("")
    result = runner.invoke(app, ["blobs", "serve", "--root", str(tmp_path), "--secret-file", str(empty)],
                           env={"RLBUS_BLOB_SECRET": ""})
    assert result.exit_code == 1 and "is empty" in result.output
    assert SECRET not in result.output


def test_a_served_store_uses_the_secret_file_and_keeps_it_off_the_command_line(tmp_path: Path) -> None:
    import asyncio
    import os
    import signal
    import subprocess

    from rlbus.errors import BlobAuthError
    from rlbus.launch.processes import rlbus_command

    secret_file = tmp_path / "blob-secret"
    secret_file.write_text(SECRET + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_BLOB_SECRET")}
    env["RLBUS_BLOB_SECRET_FILE"] = str(secret_file)

    async def use() -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                try:
                    async with session.get(f"{url}/healthz") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)
        async with HttpStore(url, secret=SECRET) as client:
            await client.put("k/1", b"v")
            assert await client.get("k/1") == b"v"
        async with HttpStore(url, secret="not-it", retries=0) as client:
            with pytest.raises(BlobAuthError):
                await client.get("k/1")

    command = [*rlbus_command(), "blobs", "serve", "--root", str(tmp_path / "root"), "--port", str(port)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        asyncio.run(use())
        assert SECRET.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=20)[0]
    assert SECRET.encode() not in output
