"""``rlbus topics``: create and inspect rlbus topics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from rlbus.cli.common import (
    Bootstrap,
    ConfigFile,
    console,
    kafka_bus,
    print_error,
    run_async,
    typer_app,
)
from rlbus.errors import ConfigError

app = typer_app(help="Create and inspect rlbus topics (rlbus/bus/topics.py).", no_args_is_help=True)


@app.command("create")
def topics_create(
    context: typer.Context,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    replication: Annotated[int, typer.Option(help="Replication factor (3 on a 3-broker cluster).")] = 1,
    partitions: Annotated[int | None, typer.Option(help="Override partitions of the data topics.")] = None,
    namespace: Annotated[str, typer.Option(help="A run's namespace: create <namespace>.rl.prompts.v1 …")] = "",
    acls: Annotated[
        bool,
        typer.Option(help="On the local secure cluster: also one SCRAM user per role and its ACLs (least privilege)."),
    ] = False,
    credentials: Annotated[
        Path | None, typer.Option(help="With --acls: where the roles' password files and [bus] snippets go.")
    ] = None,
    home: Annotated[
        Path | None, typer.Option(envvar="RLBUS_HOME", help="With --acls: the local cluster's home.")
    ] = None,
) -> None:
    """Create every rlbus topic and its dead-letter topic (existing ones are left alone).

    With --acls (a cluster from `rlbus kafka start --secure`, and --config its admin.bus.toml), also create
    the namespace's role users (trainer, rollout, reward, producer, gateway, operator) and grant each only
    what it does; each role's credential is written as <credentials>/<role>.bus.toml + <role>.password."""
    from rlbus.bus.namespace import namespaced
    from rlbus.bus.topics import topic_specs

    async def go() -> list[str]:
        prefix = f"{namespace}." if namespace else ""
        async with namespaced(kafka_bus(bootstrap, config), prefix) as bus:
            created = await bus.create_topics(topic_specs(replication=replication, partitions=partitions))
            return [prefix + name for name in created]

    created = run_async(go)
    console.print(f"created {len(created)} topic(s)" + (": " + ", ".join(created) if created else ""))
    if acls:
        _grant_roles(context, namespace, credentials, home)


def _grant_roles(context: typer.Context, namespace: str, credentials: Path | None, home: Path | None) -> None:
    """``rlbus kafka grant``, the local secure cluster's command (rlbus-tools), found through the CLI."""
    root: Any = context.find_root().command
    kafka = root.get_command(context, "kafka")
    grant = kafka.get_command(context, "grant") if hasattr(kafka, "get_command") else None
    if grant is None:
        print_error(ConfigError("acls", "--acls needs `rlbus kafka grant` from rlbus-tools (pip install -e tools)"))
        raise typer.Exit(1)
    grant.callback(namespace=namespace, credentials=credentials, home=home)


@app.command("list")
def topics_list(bootstrap: Bootstrap = "127.0.0.1:9092", config: ConfigFile = None) -> None:
    """List topics with partitions and total messages."""

    async def go() -> list[tuple[str, int, int]]:
        async with kafka_bus(bootstrap, config) as bus:
            rows = []
            for name in await bus.list_topics():
                ends = await bus.end_offsets(name)
                rows.append((name, len(ends), sum(ends.values())))
            return rows

    table = Table("topic", "partitions", "end offsets (sum)")
    for name, parts, total in run_async(go):
        table.add_row(name, str(parts), str(total))
    console.print(table)


@app.command("describe")
def topics_describe(name: str, bootstrap: Bootstrap = "127.0.0.1:9092", config: ConfigFile = None) -> None:
    """Partitions, replication, non-default config and end offsets of one topic."""

    async def go() -> Any:
        async with kafka_bus(bootstrap, config) as bus:
            return await bus.describe(name)

    info = run_async(go)
    console.print_json(json.dumps(info.__dict__, default=str))
