"""``rlbus dlq``: inspect and redrive dead letters."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from rlbus.cli.common import (
    Bootstrap,
    ConfigFile,
    console,
    kafka_bus,
    run_async,
    typer_app,
)

app = typer_app(help="Inspect and redrive dead letters.", no_args_is_help=True)


@app.command("list")
def dlq_list(
    topic: Annotated[str, typer.Argument(help="Source topic (or its .dlq).")],
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    limit: int = 100,
) -> None:
    """Show dead letters: where they came from and why."""
    from rlbus.bus.dlq import read_dead_letters

    async def go() -> Any:
        async with kafka_bus(bootstrap, config) as bus:
            return await read_dead_letters(bus, topic, limit=limit)

    table = Table("dlq offset", "source", "attempts", "error", "key")
    for d in run_async(go):
        table.add_row(
            str(d.dlq_offset),
            f"{d.source_topic}[{d.source_partition}]@{d.source_offset}",
            str(d.attempts),
            f"{d.error_class}: {d.error[:80]}",
            repr(d.key),
        )
    console.print(table)


@app.command("redrive")
def dlq_redrive(
    topic: Annotated[str, typer.Argument(help="Source topic (or its .dlq).")],
    offset: Annotated[list[int] | None, typer.Option(help="DLQ offsets to redrive (default: all).")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
) -> None:
    """Send dead letters back to their source topic once the cause is fixed."""
    from rlbus.bus.dlq import redrive

    async def go() -> int:
        async with kafka_bus(bootstrap, config) as bus:
            return await redrive(bus, topic, offsets=set(offset) if offset else None)

    console.print(f"redrove {run_async(go)} message(s)")
