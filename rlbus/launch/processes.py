"""How rlbus starts itself as a child process: the ``rlbus`` command of this environment, of the environment an
engine runs in (vLLM's), and under torchrun.

Every launcher — ``rlbus up``, the chaos rig, a trainer that starts its own ranks — spawns roles with these
command lines, so a child always runs the same installation as its parent.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def rlbus_command() -> list[str]:
    """How to run ``rlbus`` as a child: the script beside this interpreter, else the one on PATH."""
    script = Path(sys.executable).with_name("rlbus")
    if script.exists():
        return [str(script)]
    found = shutil.which("rlbus")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from rlbus.cli.app import app; sys.argv[0] = 'rlbus'; app()"]


def engine_rlbus_command(engine: str) -> list[str] | None:
    """How to run ``rlbus`` in the Python environment the engine ``engine`` must run in
    (`rlbus.engines.kinds.EngineKind.python`: vLLM's ``.venv-vllm``), or None when any environment does (this
    one). ConfigError names ``rollout.engine`` for an unknown engine or a missing environment."""
    from rlbus.engines.kinds import engine_kind

    python = engine_kind(engine).python()
    return None if python is None else rlbus_command_in(python)


def rlbus_command_in(python: Path) -> list[str]:
    """``rlbus`` of the environment whose interpreter is ``python``: its script, else that python."""
    script = python.with_name("rlbus")
    if script.exists():
        return [str(script)]
    return [str(python), "-c", "import sys; from rlbus.cli.app import app; sys.argv[0] = 'rlbus'; app()"]


def torchrun_command(ranks: int) -> list[str]:
    """``rlbus worker`` on ``ranks`` local processes under torchrun (a free rendezvous port of its own): on
    SIGTERM torchrun passes the signal to every rank and waits for them."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "-m", "rlbus", "worker"]


def relaunch_ranks(world_size: int, *, config: Path | None, region: str | None, worker_id: str | None) -> None:
    """A trainer with ``world_size`` > 1 that torchrun did not start replaces itself with ``torchrun_command``:
    ``rlbus worker trainer`` then runs N ranks wherever it is the command (compose, Kubernetes, a shell).
    Returns (doing nothing) for one rank or under torchrun (``WORLD_SIZE`` set), where `join_ranks` checks
    that the launch matches."""
    if world_size <= 1 or "WORLD_SIZE" in os.environ:
        return
    argv = [*torchrun_command(world_size), "trainer", *(["--config", str(config)] if config else []),
            *(["--region", region] if region else []), *(["--worker-id", worker_id] if worker_id else [])]
    print(f"trainer: [trainer] world_size = {world_size}: starting {world_size} ranks under torch.distributed.run",
          file=sys.stderr, flush=True)
    os.execv(argv[0], argv)
