"""``rlbus secrets``: a deployment's credentials, and a probe of what a role may not do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from rlbus.cli.common import (
    RunConfigFile,
    console,
    err,
    print_error,
    run_async,
    typer_app,
)
from rlbus.errors import RlbusError

app = typer_app(help="A deployment's credentials: issue one set per role, and probe what a role may not do.",
                     no_args_is_help=True)


@app.command("issue")
def secrets_issue(
    out: Annotated[Path, typer.Option(help="Where the directories go: one per consumer, each mounted by only it.")],
    broker: Annotated[list[str] | None, typer.Option(
        "--broker", metavar="HOST",
        help="A broker's host name as the containers reach it (repeat; default kafka).")] = None,
    redis: Annotated[str, typer.Option(help="Redis as the containers reach it (host:port).")] = "redis:6379",
    namespace: Annotated[str, typer.Option(envvar="RLBUS_NAMESPACE", help="The run's namespace (\"\": none).")] = "",
    chown: Annotated[bool, typer.Option(
        help="Give each directory to the uid of the image that reads it (as root, in docker-compose.secure.yml).")
    ] = False,
) -> None:
    """Issue a container deployment's credentials (rlbus/security/credentials.py): a CA, a certificate per broker,
    the administrator's certificate and the roles' SCRAM users and ACLs (for Kafka's Admin client), Redis's TLS
    certificate and ACL file, the blob master and one scoped blob key per role. A second run reissues nothing:
    the same CA, passwords and certificates; blob keys are minted again (they expire)."""
    from rlbus.security.credentials import issue

    try:
        written = issue(out, brokers=tuple(broker or ("kafka",)), redis=redis, namespace=namespace, chown=chown)
    except (RlbusError, ValueError) as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    for directory in written:
        names = ", ".join(sorted(p.name for p in directory.iterdir()))
        console.print(f"{directory.name:<9} {escape(str(directory))}: {names}", highlight=False, soft_wrap=True)


@app.command("probe")
def secrets_probe(
    config: RunConfigFile = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per attempt instead of the table.")] = False,
) -> None:
    """Try, with this process's own credentials (as `rlbus worker` reads them), what its role must not do:
    publish weights, join the trainer's group, create a topic, log in wrongly or in plain text, trust another CA,
    write the trainer's ledger, use Redis without a user or without TLS, upload a manifest (rlbus/security/probe.py).
    Exit status 1 when any attempt was allowed. Run it in a role's container: docker compose exec rollout
    rlbus secrets probe."""
    import dataclasses

    from rlbus.launch.config import load_config
    from rlbus.security.probe import probe

    outcomes = run_async(lambda: probe(load_config(config)))
    if json_out:
        for outcome in outcomes:
            print(json.dumps(dataclasses.asdict(outcome)))
    else:
        table = Table("who", "tried", "result", "error")
        for outcome in outcomes:
            row = outcome.row()
            table.add_row(*(escape(cell) for cell in row[:4]))
        console.print(table)
    if not all(outcome.refused for outcome in outcomes):
        err.print("[red]an attempt was allowed: this role's credentials are wider than its role[/red]")
        raise typer.Exit(1)
