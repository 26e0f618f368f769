"""`rlbus up`'s process handling: prefixed output, one SIGTERM then SIGKILL after the grace period, and
the role processes it starts."""

from __future__ import annotations

import asyncio
import io
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from rlbus.blobs.failover import FailoverStore
from rlbus.errors import ConfigError
from rlbus.launch.arguments import store_for
from rlbus.launch.config import load_config
from rlbus_tools.up.roles import parse_regions, relay_child, worker_children
from rlbus_tools.up.supervisor import Child, Supervisor

POLITE = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (print("draining", flush=True), sys.exit(0)))
print("hello", flush=True)
time.sleep(60)
"""
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, lambda *a: print("not stopping", flush=True))
print("hello", flush=True)
time.sleep(60)
"""


async def test_children_are_stopped_gracefully_then_killed() -> None:
    out = io.StringIO()
    supervisor = Supervisor(console=Console(file=out, width=200, color_system=None), grace_s=1.5)
    polite = await supervisor.start(Child("polite", [sys.executable, "-c", POLITE]))
    stubborn = await supervisor.start(Child("stubborn-one", [sys.executable, "-c", STUBBORN]))
    deadline = time.monotonic() + 30
    while out.getvalue().count("hello") < 2 and time.monotonic() < deadline:  # noqa: ASYNC110 - polls output
        await asyncio.sleep(0.05)
    started = time.monotonic()
    await supervisor.stop()
    assert polite.returncode == 0
    assert stubborn.returncode == -9  # SIGKILL after the grace period
    assert 1.4 < time.monotonic() - started < 15
    lines = out.getvalue().splitlines()
    assert "      polite │ hello" in lines and "stubborn-one │ not stopping" in lines
    assert "      polite │ draining" in lines and "      polite │ exited with status 0" in lines


def test_the_role_processes_of_a_run(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    children = worker_children(config, 3, {"RLBUS_REDIS_URL": "redis://x:1/0"})
    assert [c.name for c in children] == ["trainer", "reward", "rollout-0", "rollout-1", "rollout-2", "prompts"]
    rollouts = [c.argv for c in children if c.name.startswith("rollout")]
    regions = [argv[argv.index("--region") + 1] for argv in rollouts]
    assert regions == ["eu-west", "us-east", "ap-south"]
    for child in children:
        assert child.argv[child.argv.index("--config") + 1] == str(config)
        assert "worker" in child.argv and child.env == {"RLBUS_REDIS_URL": "redis://x:1/0"}
        assert not any("secret" in arg.lower() for arg in child.argv)  # secrets travel in the environment


def test_a_trainer_on_several_ranks_starts_under_torchrun(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    trainer, reward = worker_children(config, 1, {}, trainer_ranks=2)[:2]
    assert trainer.argv[:7] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2", "-m"]
    assert trainer.argv[7:] == ["rlbus", "worker", "trainer", "--config", str(config), "--worker-id", "trainer"]
    assert "torch.distributed.run" not in reward.argv
    assert "torch.distributed.run" not in worker_children(config, 1, {})[0].argv  # one rank: a plain worker


def test_regions_each_read_blobs_through_their_relay_with_the_origin_as_fallback(tmp_path: Path) -> None:
    regions = parse_regions(" eu-west,ap-south ")
    relays = {"eu-west": "http://127.0.0.1:1001", "ap-south": "http://127.0.0.1:1002"}
    env = {"RLBUS_BLOB_URL": "http://127.0.0.1:1000", "RLBUS_BLOB_SECRET": "s"}
    children = worker_children(tmp_path / "run.toml", 3, env, regions, relays=relays)
    rollouts = {c.name: c for c in children if c.name.startswith("rollout")}
    assert [c.argv[c.argv.index("--region") + 1] for c in rollouts.values()] == ["eu-west", "ap-south", "eu-west"]
    assert rollouts["rollout-1"].env["RLBUS_BLOB_URL"] == "http://127.0.0.1:1002"
    assert rollouts["rollout-2"].env["RLBUS_BLOB_URL"] == "http://127.0.0.1:1001"
    assert {c.env["RLBUS_BLOB_FALLBACK_URL"] for c in rollouts.values()} == {"http://127.0.0.1:1000"}
    trainer = children[0]
    assert trainer.env == env  # the trainer writes to the origin, never through a relay

    relay = relay_child("ap-south", "http://127.0.0.1:1000", "master", tmp_path / "relay", 1002)
    assert relay.argv[relay.argv.index("--upstream") + 1] == "http://127.0.0.1:1000"
    assert relay.env["RLBUS_BLOB_SECRET"] == "master"
    assert relay.env["RLBUS_UPSTREAM_BLOB_SECRET"].startswith("rbk1.")  # a read-only relay key, not the master

    config = load_config(None, {**env, "RLBUS_BLOB_URL": relays["ap-south"],
                                "RLBUS_BLOB_FALLBACK_URL": "http://127.0.0.1:1000"})
    store, url = store_for(config, env)
    assert isinstance(store, FailoverStore) and url == relays["ap-south"]


@pytest.mark.parametrize("text", ["", "eu-west,eu-west", "EU_West", "a b"])
def test_bad_regions_are_refused_naming_the_option(text: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_regions(text)
    assert raised.value.field == "regions"


def test_a_trainer_with_several_ranks_starts_them_itself_unless_torchrun_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rlbus worker trainer`` (compose's and Kubernetes' command) with world_size = 2 becomes torchrun over 2 ranks
    of itself; under torchrun (WORLD_SIZE set), or with one rank, it runs as it is."""
    import os

    from rlbus.launch.processes import relaunch_ranks

    execs: list[list[str]] = []
    monkeypatch.setattr(os, "execv", lambda path, argv: execs.append(list(argv)))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    relaunch_ranks(1, config=tmp_path / "run.toml", region=None, worker_id=None)
    assert execs == []
    relaunch_ranks(2, config=tmp_path / "run.toml", region="eu-west", worker_id="trainer")
    assert execs == [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                      "rlbus", "worker", "trainer", "--config", str(tmp_path / "run.toml"), "--region", "eu-west",
                      "--worker-id", "trainer"]]
    monkeypatch.setenv("WORLD_SIZE", "2")
    relaunch_ranks(2, config=None, region=None, worker_id=None)
    assert len(execs) == 1
