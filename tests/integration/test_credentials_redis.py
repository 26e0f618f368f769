"""The Redis that docker-compose.secure.yml runs, on the host: ``redis-server`` with TLS only and the ACL file
`rlbus secrets issue` writes. Each role's URL (its user, over TLS, verifying the server with the CA) does its
job and no more; the default user is off; the health user may only PING. Fails, never skips, without
``redis-server``."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

from rlbus.security import credentials
from rlbus_tools.services import free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server not found on PATH (Debian: apt-get install -y redis-server)")
    out = tmp_path_factory.mktemp("secrets")
    credentials.issue(out)
    redis_dir, port = out / "redis", free_port()
    process = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-auth-clients", "no",
         "--tls-cert-file", str(redis_dir / "redis.pem"), "--tls-key-file", str(redis_dir / "redis.key"),
         "--tls-ca-cert-file", str(redis_dir / "ca.pem"), "--aclfile", str(redis_dir / "users.acl"),
         "--save", "", "--appendonly", "no", "--dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    health = (redis_dir / "health.password").read_text().strip()
    deadline = time.monotonic() + 15
    try:
        while True:
            try:
                client = Redis(port=port, ssl=True, ssl_ca_certs=str(redis_dir / "ca.pem"),
                               username=credentials.HEALTH_USER, password=health, socket_connect_timeout=1)
                client.ping()
                client.close()
                break
            except RedisError:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    pytest.fail(f"redis-server with the issued ACL file did not come up:\n{process.communicate()[0]}")
                time.sleep(0.2)
        yield out, port
    finally:
        process.terminate()
        process.communicate(timeout=10)


def _client(out: Path, port: int, role: str) -> Redis:
    url = (out / role / "redis.url").read_text().strip()
    url = url.replace("@redis:6379/", f"@127.0.0.1:{port}/").replace(str(credentials.MOUNT / "ca.pem"),
                                                                       str(out / role / "ca.pem"))
    return Redis.from_url(url, socket_connect_timeout=5)


def test_each_role_does_its_job_and_no_more(server: tuple[Path, int]) -> None:
    out, port = server
    trainer, rollout = _client(out, port, "trainer"), _client(out, port, "rollout")
    try:
        trainer.set("rlbus:once:trainer:r1", b"trained")  # the ledger is the trainer's
        rollout.set("rlbus:worker:rollout:w1", b"{}", px=10_000)  # a heartbeat is the rollout worker's
        with pytest.raises(NoPermissionError):
            rollout.set("rlbus:once:trainer:r1", b"forged")
        with pytest.raises(NoPermissionError):
            rollout.flushall()
        assert trainer.get("rlbus:once:trainer:r1") == b"trained"
    finally:
        trainer.close()
        rollout.close()


def test_the_default_user_is_off_and_health_may_only_ping(server: tuple[Path, int]) -> None:
    out, port = server
    ca = str(out / "redis/ca.pem")
    anonymous = Redis(port=port, ssl=True, ssl_ca_certs=ca, socket_connect_timeout=5)
    with pytest.raises((AuthenticationError, NoPermissionError)):
        anonymous.get("rlbus:ctr:trainer:steps")
    health = Redis(port=port, ssl=True, ssl_ca_certs=ca, username=credentials.HEALTH_USER,
                   password=(out / "redis/health.password").read_text().strip())
    assert health.ping()
    with pytest.raises(NoPermissionError):
        health.get("rlbus:once:trainer:r1")
    plain = Redis(port=port, socket_connect_timeout=2, socket_timeout=2)
    with pytest.raises(RedisError):
        plain.ping()
