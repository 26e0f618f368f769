"""`rlbus up`'s process handling: prefixed output, one SIGTERM then SIGKILL after the grace period, and
the role processes it starts."""

from __future__ import annotations

import asyncio
import io
import sys
import time
from pathlib import Path

from rich.console import Console

from rlbus.launch.up import Child, Supervisor, worker_children

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
    assert trainer.argv[7:] == ["rlbus.cli", "worker", "trainer", "--config", str(config), "--worker-id", "trainer"]
    assert "torch.distributed.run" not in reward.argv
    assert "torch.distributed.run" not in worker_children(config, 1, {})[0].argv  # one rank: a plain worker
