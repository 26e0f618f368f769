"""``rlbus up``'s order: the run's name and environment, its services (:mod:`rlbus_tools.up.services`) on one exit
stack, the role processes (:mod:`rlbus_tools.up.roles`) last; then the wait for Ctrl-C, ``--steps`` or a child's
exit."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path

from rich.console import Console

from rlbus.aio import wait_event
from rlbus.errors import ConfigError
from rlbus.launch.check import check_before_run
from rlbus.launch.config import ENV_BLOB_SECRET, ENV_NAMESPACE, ENV_REDIS, ENV_RUN_DIR, RunConfig, load_config
from rlbus.launch.processes import engine_rlbus_command
from rlbus.launch.signals import GracefulStop
from rlbus_tools.up import services
from rlbus_tools.up.roles import REGIONS, worker_children
from rlbus_tools.up.supervisor import Child, Supervisor


async def up(
    config_path: Path | None,
    *,
    rollout_workers: int = 2,
    steps: int | None = None,
    namespace: str | None = None,
    grace_s: float = 30.0,
    console: Console | None = None,
    serve: bool = False,
    secure: bool = False,
    regions: Sequence[str] | None = None,
) -> int:
    """Run the local set until Ctrl-C, ``steps`` trainer steps, or a child's exit; returns the exit status.

    The run's namespace is ``namespace``, else the config's, else a fresh ``up-<date>-<time>``: a run of
    its own (topics, groups, Redis keys, run log under ``<run_dir>/<namespace>``), since the Redis this
    starts is empty while the topics of an earlier run would still hold its data. ``serve`` adds the
    OpenAI-compatible gateway (`rlbus serve`); without configured tokens it gets a fresh one, printed.
    ``secure`` runs it on the secure local Kafka with one credential per role for Kafka, Redis and the blob
    store (:mod:`rlbus_tools.up.secure`). ``regions``: the rollout workers alternate over these regions, and each
    region gets a pull-through relay of the blob origin (``rlbus blobs serve --upstream``) its workers read
    through, falling back to the origin when the relay fails (`rlbus.blobs.failover`).
    """
    if rollout_workers < 1:
        raise ValueError("rollout_workers must be ≥ 1")
    if regions is not None and secure:
        raise ConfigError("regions", "--regions and --secure together are not supported: the secure set issues "
                          "credentials per role, and a relay has none yet; run one of them")
    config, name, env = _named(config_path, namespace)
    if steps is not None and config.run_dir is None:
        raise ConfigError("run.run_dir", "--steps follows the trainer's run log: give the run a run_dir")
    check_before_run(config)  # the task, its prompts and their fit, before any process starts
    supervisor = Supervisor(console=console, grace_s=grace_s)
    local = services.Local(config=config, name=name, run_dir=config.run_dir or Path("runs") / name, env=env,
                           supervisor=supervisor, say=lambda line: supervisor.say("up", line, "bold white"))
    status = 0
    with GracefulStop(exit=supervisor.kill_now) as stopping:
        try:
            async with AsyncExitStack() as stack:
                await services.kafka(local, secure=secure)
                await stack.enter_async_context(services.redis(local))
                if not secure:
                    await services.topics(local, partitions=max(4, rollout_workers))
                await stack.enter_async_context(services.blob_origin(local))
                if serve:
                    services.gateway_token(local)
                relays = await stack.enter_async_context(services.relays(local, regions))
                children = await _roles(local, config_path, rollout_workers, serve=serve, relays=relays,
                                        regions=regions or REGIONS)
                await stack.enter_async_context(services.roles(local, children))
                local.say(f"{len(supervisor.children)} processes; run log in {local.run_dir}; Ctrl-C stops them")
                status = await _wait(supervisor, stopping, local.run_dir, steps, local.say)
        finally:
            await supervisor.stop()
            where = " --home <RLBUS_HOME>/secure-kafka" if secure else ""
            local.say(f"stopped (Kafka keeps running: `rlbus kafka stop{where}`)")
    failed = [c for c in supervisor.children if c not in local.servers and c.returncode not in (0, None)]
    return status or (1 if failed else 0)


def _named(config_path: Path | None, namespace: str | None) -> tuple[RunConfig, str, dict[str, str]]:
    """The run config as the roles will load it, the run's name, and the environment that makes them agree."""
    given = load_config(config_path)
    name = namespace or given.run.namespace or f"up-{time.strftime('%Y%m%d-%H%M%S')}"
    env: dict[str, str] = {"RLBUS_LOG_LEVEL": os.environ.get("RLBUS_LOG_LEVEL", "INFO"), ENV_NAMESPACE: name}
    if not given.run.namespace and given.run_dir is not None:
        env[ENV_RUN_DIR] = str(given.run_dir / name)
    return load_config(config_path, {**os.environ, **env}), name, env


async def _roles(
    local: services.Local, config_path: Path | None, rollout_workers: int, *, serve: bool,
    relays: dict[str, str] | None, regions: Sequence[str],
) -> list[Child]:
    """The role processes; on a secure run each with only its own role's credentials."""
    config = local.config
    rollout_command = engine_rlbus_command(config.rollout.engine)  # vLLM's environment for engine = "vllm"
    from rlbus.training.ranks import world_size_for

    children = worker_children(config_path, rollout_workers, local.env, regions, rollout_command=rollout_command,
                               serve=serve, trainer_ranks=world_size_for(config.trainer.world_size), relays=relays)
    if local.cluster is not None:
        from rlbus_tools.up.secure import prepare

        credentials = await prepare(
            config, local.name, local.run_dir, cluster=local.cluster, partitions=max(4, rollout_workers),
            redis_admin_url=local.env.get(ENV_REDIS, config.state.url), blob_master=local.env.get(ENV_BLOB_SECRET),
            say=local.say,
        )
        for child in children:
            child.env.update(credentials.env_for(child.name))
    return children


def _steps_logged(run_dir: Path) -> list[int]:
    """The step numbers in the trainer's run log, in order (the file may hold earlier runs' lines)."""
    from rlbus.observe.runlog import STEPS, read

    return [int(e.get("step", 0)) for e in read(run_dir, STEPS)]


async def _wait(
    supervisor: Supervisor, stopping: GracefulStop, run_dir: Path, steps: int | None, say: Callable[[str], None]
) -> int:
    earlier = len(_steps_logged(run_dir))
    while not stopping.stop.is_set():
        if await wait_event(supervisor.exited, 1.0):
            gone = [c.name for c in supervisor.children if c.returncode is not None]
            say(f"{', '.join(gone)} exited; stopping the rest")
            return 1
        if steps is not None and max(_steps_logged(run_dir)[earlier:], default=0) >= steps:
            say(f"the trainer reached step {steps}; stopping")
            return 0
    return 0
