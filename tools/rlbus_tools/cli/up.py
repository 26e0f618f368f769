"""``rlbus up``: a whole distributed run on one machine."""

from __future__ import annotations

from typing import Annotated

import typer

from rlbus.cli.common import (
    RunConfigFile,
    print_error,
    run_async,
)
from rlbus.errors import RlbusError


def up(
    config: RunConfigFile = None,
    rollout_workers: Annotated[int, typer.Option(min=1, help="Rollout worker processes (regions alternate).")] = 2,
    steps: Annotated[int | None, typer.Option(help="Stop once the trainer reaches this step.")] = None,
    namespace: Annotated[
        str | None, typer.Option(help="Run namespace (default: the config's, else a fresh up-<date>-<time>).")
    ] = None,
    grace: Annotated[float, typer.Option(help="Seconds a child may drain after SIGTERM before it is killed.")] = 30.0,
    serve: Annotated[bool, typer.Option(help="Also run the OpenAI-compatible gateway (the config's serve table).")
                     ] = False,
    secure: Annotated[bool, typer.Option(
        help="Run on a secure local Kafka (TLS, SCRAM, ACLs) with one credential per role for Kafka, Redis and "
             "the blob store; credentials under <run_dir>/credentials.")] = False,
    regions: Annotated[str | None, typer.Option(
        help="Comma-separated regions (e.g. eu-west,us-east,ap-south): rollout workers alternate over them and "
             "each region gets a pull-through blob relay its workers read through (the origin as fallback).")
    ] = None,
) -> None:
    """A local distributed run: Kafka and Redis (started if missing), topics, a blob server, the trainer,
    a reward worker, rollout workers and the prompt producer as processes. Ctrl-C stops them gracefully.

    The config's tables set each role: [task] the prompts, [model] the model, [trainer] the trainer,
    [rollout] the rollout workers, [reward] the reward worker, [serve] the gateway. Check it first with
    rlbus config check.

    Example: rlbus up --config run.toml --rollout-workers 4 --steps 100
    Regions: rlbus up --regions eu-west,us-east,ap-south --rollout-workers 6
    """
    from rlbus_tools.up.roles import parse_regions
    from rlbus_tools.up.run import up as run_up

    try:
        chosen = parse_regions(regions) if regions is not None else None
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(2) from None
    raise typer.Exit(run_async(lambda: run_up(config, rollout_workers=rollout_workers, steps=steps, namespace=namespace,
                                         grace_s=grace, serve=serve, secure=secure, regions=chosen)))
