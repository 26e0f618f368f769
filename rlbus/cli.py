"""The ``rlbus`` command line: one typer app; each command parses options and calls a library function.

Heavy imports (torch, aiokafka) happen inside the commands that need them, so ``rlbus --help`` is fast.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from rlbus.errors import RlbusError

if TYPE_CHECKING:
    from rlbus.bus.base import Bus

app = typer.Typer(help="rlbus: asynchronous, disaggregated RL for LLM agents on Apache Kafka.", no_args_is_help=True)
kafka_app = typer.Typer(help="Run a local Apache Kafka (KRaft) without Docker.", no_args_is_help=True)
topics_app = typer.Typer(help="Create and inspect rlbus topics (rlbus/bus/topics.py).", no_args_is_help=True)
dlq_app = typer.Typer(help="Inspect and redrive dead letters.", no_args_is_help=True)
app.add_typer(kafka_app, name="kafka")
app.add_typer(topics_app, name="topics")
blobs_app = typer.Typer(help="Serve weight chunks over HTTP (origin or regional relay).", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")
app.add_typer(blobs_app, name="blobs")
sandbox_app = typer.Typer(help="Run untrusted programs as verifiers do (bubblewrap + rlimits).", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")

console = Console()
err = Console(stderr=True)
T = TypeVar("T")

Bootstrap = Annotated[
    str,
    typer.Option("--bootstrap", "-b", envvar="RLBUS_KAFKA_BOOTSTRAP", help="Kafka bootstrap servers host:port[,…]."),
]
ConfigFile = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file whose [bus] table configures Kafka (SASL/TLS, region …)."),
]


def _bus(bootstrap: str, config: Path | None) -> Bus:
    import tomllib

    from rlbus.config import KafkaBusConfig, build_bus, parse

    data: dict[str, Any] = {"bootstrap": bootstrap}
    if config is not None:
        data.update(tomllib.loads(config.read_text()).get("bus", {}))
        data.pop("kind", None)
    return build_bus(parse(KafkaBusConfig, data, prefix="bus"))


def _run(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine; rlbus errors become one red line and exit status 1, not a traceback."""
    try:
        return asyncio.run(make())  # type: ignore[arg-type]
    except RlbusError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None


# --- demo ---------------------------------------------------------------------------------------
@app.command()
def demo(
    quick: Annotated[bool, typer.Option(help="A one-minute version (fewer steps, two workers).")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the run's figures here.")] = None,
    run_dir: Annotated[Path, typer.Option(help="Where blobs, summary.json and demo.png go.")] = Path("runs/demo"),
    steps: Annotated[int | None, typer.Option(help="RL steps (default: 60, or 15 with --quick).")] = None,
    workers: Annotated[int | None, typer.Option(help="Rollout workers (default 3, or 2 with --quick).")] = None,
    seed: int = 0,
) -> None:
    """Async RL end to end in one process: warm start, then prompts → rollout workers → rewards →
    GRPO trainer, weights flowing back as lossless deltas. Embedded bus, CPU, a few minutes."""
    import dataclasses

    import msgspec
    from rich.live import Live

    from rlbus.demo import Demo, DemoConfig
    from rlbus.demo_view import live_table, plot, summary_table

    config = DemoConfig.quick() if quick else DemoConfig()
    config = dataclasses.replace(
        config,
        seed=seed,
        rl_steps=config.rl_steps if steps is None else steps,
        workers=config.workers if workers is None else workers,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]rlbus demo[/bold]: {config.env} {config.env_config}, {config.workers} rollout workers, "
                  f"G={config.group_size}, {config.groups_per_step} groups/step, run dir {run_dir}")
    with Live(console=console, refresh_per_second=4) as live:
        runner = Demo(config, run_dir, on_update=lambda d: live.update(live_table(d)))
        result = asyncio.run(runner.run())
    console.print(summary_table(result))
    figures = result.figures()
    (run_dir / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(figures), indent=2))
    console.print(f"plot: {plot(result, run_dir / 'demo.png')}")
    if json_path is not None:
        json_path.write_bytes(msgspec.json.format(msgspec.json.encode(figures), indent=2))


@app.command()
def pretrain(
    data: Annotated[Path, typer.Argument(help='JSONL of {"prompt", "completion"} (text) or token-id pairs.')],
    out: Annotated[Path, typer.Option(help="Checkpoint directory to write.")],
    model: Annotated[str, typer.Option(help="tiny or bench.")] = "tiny",
    init: Annotated[Path | None, typer.Option(help="Start from this checkpoint directory.")] = None,
    steps: int = 200,
    lr: float = 1e-3,
    batch_size: int = 32,
    seed: int = 0,
) -> None:
    """Supervised warm start ("mid-training") on reference solutions, so RL starts from a policy that
    is sometimes right."""
    from rlbus.training.sft import main as sft_main

    if model not in ("tiny", "bench"):
        raise typer.BadParameter("--model must be tiny or bench")
    losses = sft_main(data, out, model=model, init=init, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                      log=console.print)
    console.print(f"done: loss {losses[0]:.3f} → {losses[-1]:.3f}; checkpoint in {out}")


# --- kafka ----------------------------------------------------------------------------------------
@kafka_app.command("start")
def kafka_start(
    brokers: Annotated[int, typer.Option(help="1, or 3 for a combined KRaft cluster on this machine.")] = 1,
    port: Annotated[int, typer.Option(help="Port of the first broker.")] = 9092,
    fresh: Annotated[bool, typer.Option(help="Wipe the data directories first.")] = False,
    home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME", help="State directory.")] = None,
) -> None:
    """Resolve the Kafka jars with Maven, format KRaft storage once, start the broker(s) and wait."""
    from rlbus.services import kafka

    if brokers not in (1, 3):
        raise typer.BadParameter("--brokers must be 1 or 3")
    try:
        with console.status(f"starting {brokers} Kafka broker(s)…"):
            cluster = kafka.start(brokers=brokers, port=port, fresh=fresh, home=home)
    except RlbusError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(f"Kafka is up: bootstrap [bold]{cluster.bootstrap}[/bold]")


@kafka_app.command("stop")
def kafka_stop(home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME")] = None) -> None:
    """Stop the local broker(s); data directories are kept."""
    from rlbus.services import kafka

    kafka.stop(home)
    console.print("Kafka stopped")


@kafka_app.command("status")
def kafka_status(
    home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show each local node: pid, ports, whether it is alive and listening."""
    from rlbus.services import kafka

    info = kafka.status(home)
    if as_json:
        console.print_json(json.dumps(info))
        return
    console.print(f"home {info['home']}  bootstrap {info.get('bootstrap')}  running {info['running']}")
    for node in info["nodes"]:
        console.print(f"  {node}")
    if not info["running"]:
        raise typer.Exit(1)


# --- topics ---------------------------------------------------------------------------------------
@topics_app.command("create")
def topics_create(
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    replication: Annotated[int, typer.Option(help="Replication factor (3 on a 3-broker cluster).")] = 1,
    partitions: Annotated[int | None, typer.Option(help="Override partitions of the data topics.")] = None,
) -> None:
    """Create every rlbus topic and its dead-letter topic (existing ones are left alone)."""
    from rlbus.bus.topics import topic_specs

    async def go() -> list[str]:
        async with _bus(bootstrap, config) as bus:
            return await bus.create_topics(topic_specs(replication=replication, partitions=partitions))

    created = _run(go)
    console.print(f"created {len(created)} topic(s)" + (": " + ", ".join(created) if created else ""))


@topics_app.command("list")
def topics_list(bootstrap: Bootstrap = "127.0.0.1:9092", config: ConfigFile = None) -> None:
    """List topics with partitions and total messages."""

    async def go() -> list[tuple[str, int, int]]:
        async with _bus(bootstrap, config) as bus:
            rows = []
            for name in await bus.list_topics():
                ends = await bus.end_offsets(name)
                rows.append((name, len(ends), sum(ends.values())))
            return rows

    table = Table("topic", "partitions", "end offsets (sum)")
    for name, parts, total in _run(go):
        table.add_row(name, str(parts), str(total))
    console.print(table)


@topics_app.command("describe")
def topics_describe(name: str, bootstrap: Bootstrap = "127.0.0.1:9092", config: ConfigFile = None) -> None:
    """Partitions, replication, non-default config and end offsets of one topic."""

    async def go() -> Any:
        async with _bus(bootstrap, config) as bus:
            return await bus.describe(name)

    info = _run(go)
    console.print_json(json.dumps(info.__dict__, default=str))


# --- dead letters ---------------------------------------------------------------------------------
@dlq_app.command("list")
def dlq_list(
    topic: Annotated[str, typer.Argument(help="Source topic (or its .dlq).")],
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    limit: int = 100,
) -> None:
    """Show dead letters: where they came from and why."""
    from rlbus.bus.dlq import read_dead_letters

    async def go() -> Any:
        async with _bus(bootstrap, config) as bus:
            return await read_dead_letters(bus, topic, limit=limit)

    table = Table("dlq offset", "source", "attempts", "error", "key")
    for d in _run(go):
        table.add_row(
            str(d.dlq_offset),
            f"{d.source_topic}[{d.source_partition}]@{d.source_offset}",
            str(d.attempts),
            f"{d.error_class}: {d.error[:80]}",
            repr(d.key),
        )
    console.print(table)


@dlq_app.command("redrive")
def dlq_redrive(
    topic: Annotated[str, typer.Argument(help="Source topic (or its .dlq).")],
    offset: Annotated[list[int] | None, typer.Option(help="DLQ offsets to redrive (default: all).")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
) -> None:
    """Send dead letters back to their source topic once the cause is fixed."""
    from rlbus.bus.dlq import redrive

    async def go() -> int:
        async with _bus(bootstrap, config) as bus:
            return await redrive(bus, topic, offsets=set(offset) if offset else None)

    console.print(f"redrove {_run(go)} message(s)")


# --- blobs ---------------------------------------------------------------------------------------
@blobs_app.command("serve")
def blobs_serve(
    root: Annotated[Path, typer.Option(help="Directory holding the blobs (the relay's cache with --upstream).")],
    secret: Annotated[str, typer.Option(envvar="RLBUS_BLOB_SECRET", help="Shared HMAC signing secret.")],
    host: str = "127.0.0.1",
    port: int = 8470,
    upstream: Annotated[
        str | None, typer.Option(help="Origin URL: serve as a read-only pull-through relay for a region.")
    ] = None,
    upstream_secret: Annotated[str | None, typer.Option(envvar="RLBUS_UPSTREAM_BLOB_SECRET")] = None,
) -> None:
    """Serve a blob directory over signed HTTP with range reads; with --upstream, relay an origin."""
    from rlbus.weights.http_store import BlobServer, HttpStore, serve
    from rlbus.weights.store import LocalStore

    async def go() -> None:
        origin = HttpStore(upstream, secret=upstream_secret or secret) if upstream else None
        server = BlobServer(LocalStore(root), secret=secret, upstream=origin)
        runner = await serve(server, host, port)
        role = f"relay of {upstream}" if upstream else "origin"
        console.print(f"serving {root} on http://{host}:{port} ({role}); Ctrl-C stops")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
            if origin is not None:
                await origin.close()

    try:
        _run(go)
    except KeyboardInterrupt:
        pass


# --- sandbox -------------------------------------------------------------------------------------
@sandbox_app.command("run")
def sandbox_run(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Python file to run.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Wall-clock limit in seconds.")] = 10.0,
) -> None:
    """Run one Python file in the sandbox and print the outcome as JSON (status, exit_code, reason,
    stdout, stderr, wall_s). Exit status: 0 ok, 2 refused (no sandbox here), 1 anything else."""
    from rlbus.envs.sandbox import run_file

    result = run_file(file, timeout)
    print(result.to_json())
    raise typer.Exit({"ok": 0, "refused": 2}.get(result.status, 1))


# --- replay / tail --------------------------------------------------------------------------------
@app.command()
def replay(
    topic: Annotated[str, typer.Option("--topic", "-t", help="Topic to read.")],
    start: Annotated[str | None, typer.Option("--from", help="Offset or ISO time (inclusive).")] = None,
    stop: Annotated[str | None, typer.Option("--to", help="Offset or ISO time (exclusive).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write JSONL here.")] = None,
    into: Annotated[str | None, typer.Option("--into", help="Re-produce into this topic.")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
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
        async with _bus(bootstrap, config) as bus:
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

    count = _run(go)
    console.print(f"replayed {count} record(s) from {topic} to {out or into}")


@app.command()
def tail(
    topic: str,
    last: Annotated[int, typer.Option(help="Start this many records before the end of each partition.")] = 0,
    limit: Annotated[int | None, typer.Option(help="Stop after this many records.")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
) -> None:
    """Pretty-print live messages of a topic (decoded when rlbus knows its schema)."""
    from rlbus.bus.replay import record_to_json
    from rlbus.bus.replay import tail as follow

    async def go() -> None:
        async with _bus(bootstrap, config) as bus:
            async for record in follow(bus, topic, last=last, limit=limit):
                data = record_to_json(record)
                console.rule(f"{record.where}  key={data['key']}  ts={record.timestamp_ms}")
                console.print_json(json.dumps(data.get("value", data), default=str)[:20000])

    try:
        _run(go)
    except KeyboardInterrupt:
        pass


# --- bench ----------------------------------------------------------------------------------------
BENCHMARKS = {
    "bus": "rlbus.bench.bus",
    "codec": "rlbus.bench.codec",
    "sync": "rlbus.bench.sync",
    "sandbox": "rlbus.bench.sandbox",
    "mismatch": "rlbus.bench.mismatch",
    "train": "rlbus.bench.train",
}


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help=f"One of: {', '.join(BENCHMARKS)}.")],
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
    quick: Annotated[bool, typer.Option(help="A CI-sized run of the same measurement.")] = False,
    bootstrap: Bootstrap = "127.0.0.1:9092",
) -> None:
    """Run a benchmark: prints a short table (with its same-run baseline) and optionally writes JSON."""
    if name not in BENCHMARKS:
        raise typer.BadParameter(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    module = importlib.import_module(BENCHMARKS[name])
    kwargs: dict[str, Any] = {"bootstrap": bootstrap} if name == "bus" else {}
    try:
        result = module.run(quick=quick, json_path=json_path, **kwargs)
    except RlbusError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    if name == "sandbox" and result["escapes_contained"] < result["escapes_tried"]:
        err.print("[red]an escape attempt was NOT contained[/red]")
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover - console entry point
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app(sys.argv[1:])
