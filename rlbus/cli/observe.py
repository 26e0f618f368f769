"""``rlbus status``, ``rlbus dashboard``, ``rlbus report``: what a run is doing and did."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from rlbus.cli.common import (
    Bootstrap,
    ConfigFile,
    console,
    err,
    kafka_bus,
    print_error,
    run_async,
)
from rlbus.errors import RlbusError


def status(
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    redis: Annotated[
        str, typer.Option("--redis", envvar="RLBUS_REDIS_URL", help="Redis holding the worker registry.")
    ] = "redis://127.0.0.1:6379/0",
    redis_prefix: Annotated[str, typer.Option(help="Key prefix of the run's Redis keys.")] = "rlbus:",
    namespace: Annotated[
        str | None,
        typer.Option(envvar="RLBUS_NAMESPACE", help="The run namespace (run.namespace): its topics, groups, keys."),
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", help="A live view, refreshed until Ctrl-C.")] = False,
    every: Annotated[float, typer.Option(help="Seconds between refreshes with --watch.")] = 2.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the snapshot once as JSON.")] = False,
) -> None:
    """Workers by role and region, consumer-group lag, trainer step and version, recent swap pauses."""
    from redis.asyncio import Redis

    from rlbus.bus.namespace import namespaced
    from rlbus.observe.status import show
    from rlbus.state.redis import RedisStateStore

    try:
        client = Redis.from_url(redis, socket_connect_timeout=3, socket_timeout=10)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--redis") from None

    async def go() -> None:
        prefix = f"rlbus:{namespace}:" if namespace else redis_prefix
        async with RedisStateStore(client, key_prefix=prefix) as state:
            await state.workers()  # Redis first: it answers (or refuses) fastest
            bus = namespaced(kafka_bus(bootstrap, config), f"{namespace}." if namespace else "")
            try:
                await bus.start()
                await show(bus, state, console=console, as_json=as_json, watch=watch, every_s=every)
            finally:
                await bus.close()  # also after a failed start, so no half-started client is left behind

    # An unreachable broker is reported once, as the error line below, not also by aiokafka's logger.
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        run_async(go)
    except KeyboardInterrupt:
        pass
    finally:
        quiet.setLevel(level)


def dashboard(
    port: Annotated[int, typer.Option(help="Port to serve the page on.")] = 8480,
    host: Annotated[str, typer.Option(help=(
        "Interface to bind; any but loopback (e.g. 0.0.0.0 to share it) needs $RLBUS_DASHBOARD_TOKEN or "
        "$RLBUS_DASHBOARD_TOKEN_FILE."))] = "127.0.0.1",
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    redis: Annotated[
        str | None,
        typer.Option("--redis", envvar="RLBUS_REDIS_URL", help="Redis with the worker registry (omit: topics only)."),
    ] = None,
    redis_prefix: Annotated[str, typer.Option(help="Key prefix of the run's Redis keys.")] = "rlbus:",
    since: Annotated[str, typer.Option(help="Start reading at: 30m / 2h ago, all, an ISO time or an offset.")] = "30m",
    model_id: Annotated[str, typer.Option(help="The policy whose versions are charted.")] = "policy",
) -> None:
    """A web page with live charts of the run: reward by source, versions per worker, lag, staleness,
    delta bytes vs full size, swap pauses, mismatch KL. Reads the topics without joining any group."""
    from rlbus.launch.signals import GracefulStop
    from rlbus.observe.dashboard import Dashboard, dashboard_token, parse_since
    from rlbus.state import open_state_store

    try:
        start = parse_since(since)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from None

    async def go() -> None:
        token = dashboard_token(host=host)  # before connecting: no page open to other hosts without a token
        state = open_state_store(redis, key_prefix=redis_prefix) if redis else None
        try:
            if state is not None:
                await state.workers()  # fail now, with one line, if Redis is unreachable
            async with kafka_bus(bootstrap, config) as bus:
                board = Dashboard(bus=bus, state=state, start=start, model_id=model_id, host=host, port=port,
                                  token=token, on_ready=lambda url: console.print(
                                      f"dashboard on [bold]{url}[/bold]{' (token required)' if token else ''}; "
                                      "Ctrl-C stops"))
                with GracefulStop() as stopping:  # SIGTERM or Ctrl-C: stop serving, close cleanly
                    await board.run(stopping.stop)
        finally:
            if state is not None:
                await state.close()

    try:
        run_async(go)
    except OSError as exc:
        err.print(f"[red]error:[/red] cannot serve on {host}:{port}: {exc}", soft_wrap=True)
        raise typer.Exit(1) from None


def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory with a run log (steps.jsonl …).")],
    out: Annotated[Path | None, typer.Option(help="Write here instead of into RUN_DIR.")] = None,
) -> None:
    """PNG plots (reward, staleness, sync bytes, swap pauses, mismatch) and report.md of a run."""
    from rlbus.observe.report import write_report

    try:
        written = write_report(run_dir, out)
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    for path in written:
        console.print(str(path), soft_wrap=True)  # a path per line, whole
