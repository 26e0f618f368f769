"""``rlbus replay`` and ``rlbus tail``: read any topic back, decoded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rlbus.cli.common import (
    Blobs,
    Bootstrap,
    ConfigFile,
    console,
    err,
    kafka_bus,
    resolved_claims,
    run_async,
)


def replay(
    topic: Annotated[str, typer.Option("--topic", "-t", help="Topic to read.")],
    start: Annotated[str | None, typer.Option("--from", help="Offset or ISO time (inclusive).")] = None,
    stop: Annotated[str | None, typer.Option("--to", help="Offset or ISO time (exclusive).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write JSONL here.")] = None,
    into: Annotated[str | None, typer.Option("--into", help="Re-produce into this topic.")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    blobs: Blobs = None,
) -> None:
    """Replay a window of a topic to a JSONL file or into another topic; never joins a group and
    stops at the end offsets seen when it started."""
    from rich.progress import Progress

    from rlbus.bus.replay import Bound, plan_window, replay_into, replay_to_file

    if (out is None) == (into is None):
        raise typer.BadParameter("give exactly one of --out FILE or --into TOPIC")
    try:
        low = Bound.parse(start) if start else None
        high = Bound.parse(stop) if stop else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    async def go() -> int:
        async with kafka_bus(bootstrap, config) as plain, resolved_claims(plain, blobs) as bus:
            window = await plan_window(bus, topic, low, high)
            with Progress(console=err) as progress:
                task = progress.add_task(f"replay {topic}", total=window.total or None)

                def advance(n: int) -> None:
                    progress.update(task, completed=n)

                if out is not None:
                    with out.open("wb") as fh:
                        return await replay_to_file(bus, topic, fh, low, high, advance)
                assert into is not None
                return await replay_into(bus, topic, into, low, high, advance)

    count = run_async(go)
    console.print(f"replayed {count} record(s) from {topic} to {out or into}")


def tail(
    topic: str,
    last: Annotated[int, typer.Option(help="Start this many records before the end of each partition.")] = 0,
    limit: Annotated[int | None, typer.Option(help="Stop after this many records.")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    blobs: Blobs = None,
) -> None:
    """Pretty-print live messages of a topic (decoded when rlbus knows its schema)."""
    from rlbus.bus.replay import record_to_json
    from rlbus.bus.replay import tail as follow

    async def go() -> None:
        async with kafka_bus(bootstrap, config) as plain, resolved_claims(plain, blobs) as bus:
            async for record in follow(bus, topic, last=last, limit=limit):
                data = record_to_json(record)
                console.rule(f"{record.where}  key={data['key']}  ts={record.timestamp_ms}")
                console.print_json(json.dumps(data.get("value", data), default=str)[:20000])

    try:
        run_async(go)
    except KeyboardInterrupt:
        pass
