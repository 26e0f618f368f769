"""``start_redis`` with the directory forms callers pass: ``rlbus up`` gives a relative ``runs/…/redis``."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis import Redis

from rlbus_tools.services.redis import start_redis


def test_a_relative_dir_counts_from_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with start_redis(dir=Path("runs/x/redis")) as server:
        assert server.dir == tmp_path / "runs/x/redis"
        client = Redis.from_url(server.url)
        try:
            assert client.config_get("dir")["dir"] == str(tmp_path / "runs/x/redis")
        finally:
            client.close()
    assert (tmp_path / "runs/x/redis/redis.log").is_file()
    assert not (tmp_path / "runs/x/redis/runs").exists()


def test_a_throwaway_redis_leaves_no_snapshot_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``dump.rdb`` in the current directory (a checkout) nor in the server's own: persistence is off."""
    monkeypatch.chdir(tmp_path)
    with start_redis(dir=tmp_path / "redis") as server:
        client = Redis.from_url(server.url)
        try:
            assert client.config_get("save")["save"] == ""
            assert client.config_get("appendonly")["appendonly"] == "no"
            client.set("k", "v")
        finally:
            client.close()
    assert not list(tmp_path.rglob("dump.rdb"))
