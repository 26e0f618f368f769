"""``rlbus worker ROLE``: one role of a distributed run."""

from __future__ import annotations

from typing import Annotated

import typer

from rlbus.cli.common import (
    RunConfigFile,
    print_error,
)
from rlbus.errors import RlbusError


def worker(
    role: Annotated[str, typer.Argument(help="prompts, rollout, reward, trainer or serve (the gateway).")],
    config: RunConfigFile = None,
    region: Annotated[
        str | None, typer.Option(envvar="RLBUS_REGION", help="Region: Kafka client-id suffix and client.rack.")
    ] = None,
    worker_id: Annotated[str | None, typer.Option(envvar="RLBUS_WORKER_ID", help="Default: role-host-pid.")] = None,
) -> None:
    """Run one role of a distributed run against Kafka and Redis. SIGTERM/Ctrl-C drains in-flight work,
    commits and exits 0; a second one exits at once (130/143). A trainer with [trainer] world_size = N starts
    its N ranks itself, under torch.distributed.run (one process per rank), unless torchrun started it.

    Example: rlbus worker rollout --config run.toml --region eu-west
    """
    from rlbus.launch.config import load_config
    from rlbus.launch.roles import ROLES, run_role

    if role not in ROLES:
        raise typer.BadParameter(f"choose one of {', '.join(ROLES)}", param_hint="ROLE")
    try:
        loaded = load_config(config)
        if role == "trainer":
            from rlbus.launch.processes import relaunch_ranks
            from rlbus.training.ranks import world_size_for

            relaunch_ranks(world_size_for(loaded.trainer.world_size), config=config, region=region,
                           worker_id=worker_id)
        run_role(role, loaded, region=region, worker_id=worker_id)
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
