"""The ``rlbus`` application: every command module registered on one typer app, plus the commands other
installed packages add (the ``rlbus.cli`` entry points: ``rlbus bench``, ``sim``, ``kafka`` and ``up`` come from
``rlbus-tools``, the repository's tooling package, docs/architecture.md §8).

Commands are listed here, once: a module per command or command group (``rlbus/cli/<name>.py``), each
parsing its options and calling one library function. Heavy imports (torch, aiokafka) happen inside the
commands that need them, so ``rlbus --help`` stays fast.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from rlbus.cli import (
    blobs,
    codec,
    config,
    demo,
    dlq,
    env,
    evaluate,
    feedback,
    generate,
    models,
    observe,
    offline,
    pretrain,
    redis,
    replay,
    sandbox,
    secrets,
    serve,
    topics,
    train,
    worker,
)
from rlbus.cli.common import err, typer_app

#: The entry-point group where another package adds commands: a name and either a typer app (a command group)
#: or a function (one command).
PLUGIN_GROUP = "rlbus.cli"

#: Commands that live in the tooling package, and what to tell a user whose environment lacks it.
TOOLS = {
    "bench": "Benchmarks (rlbus bench NAME --json FILE).",
    "sim": "Simulate a fleet of any size.",
    "kafka": "Run a local Apache Kafka (KRaft) without Docker.",
    "up": "A whole distributed run on one machine.",
}

app = typer_app(help="rlbus: asynchronous, disaggregated RL for LLM agents on Apache Kafka.", no_args_is_help=True)

COMMANDS: dict[str, Callable[..., Any]] = {
    "demo": demo.demo,
    "pretrain": pretrain.pretrain,
    "generate": generate.generate,
    "serve": serve.serve,
    "eval": evaluate.eval_,
    "worker": worker.worker,
    "replay": replay.replay,
    "tail": replay.tail,
    "status": observe.status,
    "dashboard": observe.dashboard,
    "report": observe.report,
}
GROUPS: dict[str, typer.Typer] = {
    "topics": topics.app,
    "dlq": dlq.app,
    "blobs": blobs.app,
    "sandbox": sandbox.app,
    "feedback": feedback.app,
    "models": models.app,
    "codec": codec.app,
    "train": train.app,
    "offline": offline.app,
    "env": env.app,
    "config": config.app,
    "redis": redis.app,
    "secrets": secrets.app,
}


@app.callback()
def _logging(
    log_json: Annotated[
        bool, typer.Option("--log-json", envvar="RLBUS_LOG_JSON", help="Log one JSON object per line.")
    ] = False,
    log_level: Annotated[
        str, typer.Option("--log-level", envvar="RLBUS_LOG_LEVEL", help="DEBUG, INFO, WARNING or ERROR.")
    ] = "WARNING",
) -> None:
    """Global options: how every command logs (rlbus/observe/logs.py)."""
    from rlbus.observe.logs import setup_logging

    try:
        setup_logging(json=log_json, level=log_level)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--log-level") from None


def _missing_tool(name: str) -> Callable[..., None]:
    def command(args: Annotated[list[str] | None, typer.Argument(hidden=True)] = None) -> None:
        err.print(f"[red]error:[/red] `rlbus {name}` comes with rlbus-tools, the repository's tooling package, which "
                  "this environment lacks: in a checkout, `pip install -e tools` (make venv does it)")
        raise typer.Exit(2)

    command.__doc__ = f"{TOOLS[name]} (needs rlbus-tools: pip install -e tools)"
    return command


def plugins() -> dict[str, Any]:
    """The commands installed packages add (entry points of :data:`PLUGIN_GROUP`), by name; a name rlbus
    already has is refused."""
    found = {}
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        if entry.name in COMMANDS or entry.name in GROUPS:
            raise RuntimeError(f"entry point {entry.value} takes the rlbus command name {entry.name!r}")
        found[entry.name] = entry.load()
    return found


def _register() -> None:
    for name, function in COMMANDS.items():
        app.command(name)(function)
    for name, group in GROUPS.items():
        app.add_typer(group, name=name)
    added = plugins()
    for name, thing in sorted(added.items()):
        if isinstance(thing, typer.Typer):
            app.add_typer(thing, name=name)
        else:
            app.command(name)(thing)
    lenient = {"allow_extra_args": True, "ignore_unknown_options": True}
    for name in sorted(TOOLS.keys() - added.keys()):
        app.command(name, context_settings=lenient)(_missing_tool(name))


_register()


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (``MALLOC_ARENA_MAX``) for this process's threads.

    A worker runs episodes, encodes and steps on dozens of threads, and glibc gives each thread its own
    arena; tensors of a few MB freed on one thread stay in its arena, so RSS only grows. Measured on the
    SmolLM2 demo: +1.5 GB per RL step with the default (8 × cores arenas), flat at ~9 GB with 2 — and 20 %
    faster. Must run before the threads exist; a no-op off glibc or when the variable is set."""
    import ctypes

    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-8, arenas)  # M_ARENA_MAX


def main() -> None:  # pragma: no cover - console entry point
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    limit_malloc_arenas()
    app(sys.argv[1:])
