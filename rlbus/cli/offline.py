"""``rlbus offline``: offline data from a run's log (DPO preference pairs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from rlbus.cli.common import (
    Blobs,
    Bootstrap,
    console,
    kafka_bus,
    resolved_claims,
    run_async,
    typer_app,
)

app = typer_app(help="Offline data from a run's log (DPO preference pairs).", no_args_is_help=True)


@app.command("pairs")
def offline_pairs(
    out: Annotated[Path, typer.Option("--out", help="Write the pairs here as token JSONL.")],
    rollouts_topic: Annotated[str, typer.Option("--from-topic", help="The rollouts topic.")] = "rl.rollouts.v1",
    rewards_topic: Annotated[str, typer.Option("--rewards", help="The rewards topic.")] = "rl.rewards.v1",
    namespace: Annotated[
        str | None,
        typer.Option(envvar="RLBUS_NAMESPACE", help="The run namespace (default: the config's run.namespace)."),
    ] = None,
    margin: Annotated[float, typer.Option(help="Keep a group only when best − worst reward exceeds this.")] = 0.0,
    source: Annotated[
        str | None, typer.Option("--source", help="Count only this reward source (default: sum every source).")
    ] = None,
    max_pairs: Annotated[int | None, typer.Option(help="Keep at most this many pairs (first groups first).")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: Annotated[
        Path | None,
        typer.Option("--config", help="TOML file: its bus table configures Kafka, run.namespace names the run."),
    ] = None,
    blobs: Blobs = None,
) -> None:
    """Mine preference pairs from a run's log: per prompt group, its best and worst rollout by reward
    (rlbus/training/pairs.py). Reads both topics to the end offsets seen at the start; joins no group."""
    import tomllib

    from rlbus.bus.namespace import check_prefix, namespaced
    from rlbus.training.pairs import mine_pairs
    from rlbus.training.preference import write_pairs

    if namespace is None and config is not None:
        namespace = str(tomllib.loads(config.read_text()).get("run", {}).get("namespace", ""))
    prefix = f"{namespace}." if namespace else ""
    try:
        if prefix:
            check_prefix(prefix)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--namespace") from None

    async def go() -> Any:
        async with kafka_bus(bootstrap, config) as plain, resolved_claims(plain, blobs) as resolved:
            bus = namespaced(resolved, prefix)
            return await mine_pairs(bus, rollouts_topic=rollouts_topic.removeprefix(prefix),
                                    rewards_topic=rewards_topic.removeprefix(prefix), reward_source=source,
                                    margin=margin, max_pairs=max_pairs)

    mined = run_async(go)
    write_pairs(out, mined.pairs)
    table = Table(title="offline pairs")
    table.add_column("")
    table.add_column("count", justify="right")
    for name, n in mined.summary().items():
        table.add_row(name, str(n))
    console.print(table)
    console.print(f"wrote {len(mined.pairs)} pair(s) to {out}")
