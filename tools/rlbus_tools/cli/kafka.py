"""``rlbus kafka``: a local Apache Kafka (KRaft) without Docker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from rlbus.cli.common import (
    console,
    print_error,
    typer_app,
)
from rlbus.errors import ConfigError, RlbusError

app = typer_app(help="Run a local Apache Kafka (KRaft) without Docker.", no_args_is_help=True)


@app.command("start")
def kafka_start(
    brokers: Annotated[int, typer.Option(help="1, or 3 for a combined KRaft cluster on this machine.")] = 1,
    port: Annotated[int, typer.Option(help="Port of the first broker.")] = 9092,
    fresh: Annotated[bool, typer.Option(help="Wipe the data directories first.")] = False,
    home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME", help="State directory.")] = None,
    sasl_port: Annotated[int | None, typer.Option(help="Also listen with SASL_PLAINTEXT (SCRAM) from here.")] = None,
    scram_user: Annotated[
        str | None, typer.Option(help="Create this SCRAM-SHA-512 user; password from $RLBUS_SASL_PASSWORD.")
    ] = None,
    scram_password_file: Annotated[Path | None, typer.Option(help="File holding --scram-user's password.")] = None,
    secure: Annotated[
        bool,
        typer.Option(help="TLS on every listener (a local CA), SCRAM for clients, nothing allowed without an ACL."),
    ] = False,
    mtls: Annotated[bool, typer.Option(help="With --secure: clients must also present a certificate.")] = False,
    racks: Annotated[
        str | None,
        typer.Option(help="Each broker's rack (region), comma-separated; default eu-west,us-east,ap-south on 3."),
    ] = None,
) -> None:
    """Resolve the Kafka jars with Maven, format KRaft storage once, start the broker(s) and wait.

    With --secure there is no PLAINTEXT listener: clients use SASL_SSL with the printed CA file, the
    administrator a client certificate; `rlbus kafka grant` (or `rlbus topics create --acls`) then gives each
    role its credential."""
    from rlbus_tools.services import kafka

    if brokers not in (1, 3):
        raise typer.BadParameter("--brokers must be 1 or 3")
    try:
        users = kafka.scram_users_from(scram_user, scram_password_file)
        with console.status(f"starting {brokers} Kafka broker(s)…"):
            cluster = kafka.start(brokers=brokers, port=port, fresh=fresh, home=home, sasl_port=sasl_port,
                                  scram_users=users, secure=secure, mtls=mtls,
                                  racks=None if racks is None else kafka.parse_racks(racks))
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    console.print(f"Kafka is up: bootstrap [bold]{cluster.bootstrap}[/bold]")
    if cluster.racks:
        console.print(f"racks (node 1..{len(cluster.nodes)}): [bold]{','.join(cluster.racks)}[/bold]")
    if cluster.sasl_bootstrap:
        console.print(f"SASL_PLAINTEXT (SCRAM) listeners: [bold]{cluster.sasl_bootstrap}[/bold]")
    if cluster.secure:
        from rlbus_tools.services.kafka_secure import describe_secure

        console.print(describe_secure(cluster), highlight=False)


@app.command("acls")
def kafka_acls(home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME")] = None) -> None:
    """List every ACL of the local secure cluster (asked as its administrator)."""
    from rlbus_tools.services import kafka
    from rlbus_tools.services.kafka_admin import describe_acls

    cluster = kafka.load_cluster((home or kafka.default_home()).expanduser().resolve())
    if cluster is None or not cluster.secure:
        print_error(ConfigError("secure", "no secure local cluster here: start one with `rlbus kafka start --secure`"))
        raise typer.Exit(1)
    try:
        acls = describe_acls(kafka.admin_client_properties(cluster))
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    table = Table("principal", "permission", "operation", "resource", "name", "pattern")
    for acl in acls:
        table.add_row(acl.principal, acl.permission, acl.operation, acl.resource_type, acl.name, acl.pattern)
    console.print(table)


@app.command("stop")
def kafka_stop(home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME")] = None) -> None:
    """Stop the local broker(s); data directories are kept."""
    from rlbus_tools.services import kafka

    kafka.stop(home)
    console.print("Kafka stopped")


@app.command("status")
def kafka_status(
    home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show each local node: pid, ports, whether it is alive and listening."""
    from rlbus_tools.services import kafka

    info = kafka.status(home)
    if as_json:
        console.print_json(json.dumps(info))
        return
    console.print(f"home {info['home']}  bootstrap {info.get('bootstrap')}  running {info['running']}")
    for node in info["nodes"]:
        console.print(f"  {node}")
    if not info["running"]:
        raise typer.Exit(1)


@app.command("grant")
def kafka_grant(
    namespace: Annotated[str, typer.Option(help="The run's namespace (\"\": none).")] = "",
    credentials: Annotated[
        Path | None, typer.Option(help="Where the roles' password files and [bus] snippets go.")
    ] = None,
    home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME", help="The local cluster's home.")] = None,
) -> None:
    """On the local secure cluster (`rlbus kafka start --secure`): one SCRAM user per role of the namespace
    (trainer, rollout, reward, producer, gateway, operator), each granted only what it does; each role's
    credential is written as <credentials>/<role>.bus.toml + <role>.password."""
    from rlbus.security.kafka_acl import bindings
    from rlbus_tools.services import kafka
    from rlbus_tools.services.kafka_grant import grant

    cluster = kafka.load_cluster((home or kafka.default_home()).expanduser().resolve())
    if cluster is None or not cluster.secure:
        print_error(ConfigError("acls", "granting needs the local secure cluster (`rlbus kafka start --secure`, "
                                "--home)"))
        raise typer.Exit(1)
    out = credentials or cluster.home / "credentials" / (namespace or "default")
    try:
        with console.status("creating the roles' SCRAM users and ACLs (Kafka's Admin client)…"):
            granted = grant(cluster, namespace, out)
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    table = Table("role", "principal", "ACLs", "credential ([bus] table)")
    for cred in granted:
        count = len(bindings(namespace, [cred.role]))
        table.add_row(cred.role, f"User:{cred.user}", str(count), str(cred.bus_file))
    console.print(table)
