"""What every command module shares: the typer app factory, the consoles, option types, error printing."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from rlbus.errors import RlbusError

if TYPE_CHECKING:
    from rlbus.bus.base import Bus


def typer_app(**options: Any) -> typer.Typer:
    """A typer app whose help is plain text: rich markup would eat ``[trainer]``, ``[dpo]`` … from every help
    text that names a config table."""
    return typer.Typer(rich_markup_mode=None, **options)


console = Console()

err = Console(stderr=True)

T = TypeVar("T")

SMOLLM2 = "smollm2-135m-instruct"

Bootstrap = Annotated[
    str,
    typer.Option("--bootstrap", "-b", envvar="RLBUS_KAFKA_BOOTSTRAP", help="Kafka bootstrap servers host:port[,…]."),
]

ConfigFile = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file whose [bus] table configures Kafka (SASL/TLS, region …)."),
]

RunConfigFile = Annotated[
    Path | None,
    typer.Option("--config", envvar="RLBUS_CONFIG", help="Run config (TOML; see rlbus/launch/config.py)."),
]



def kafka_bus(bootstrap: str, config: Path | None) -> Bus:
    import tomllib

    from rlbus.config import KafkaBusConfig, build_bus, parse

    data: dict[str, Any] = {"bootstrap": bootstrap}
    if config is not None:
        data.update(tomllib.loads(config.read_text()).get("bus", {}))
        data.pop("kind", None)
    return build_bus(parse(KafkaBusConfig, data, prefix="bus"))


def print_error(exc: BaseException, hint: str = "") -> None:
    """One red ``error:`` line on stderr; the message escaped, so ``[model]`` in it stays (rich markup), and
    never hard-wrapped: a path or a topic name in it stays whole for whoever copies it (the terminal wraps)."""
    err.print(f"[red]error:[/red] {escape(str(exc))}{hint}", soft_wrap=True)


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine; rlbus errors become one red line and exit status 1, not a traceback."""
    try:
        return asyncio.run(make())  # type: ignore[arg-type]
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None


Blobs = Annotated[
    str | None,
    typer.Option("--blobs", envvar="RLBUS_BLOBS",
                 help="Blob store (directory or http URL) to resolve claim-checked records; $RLBUS_BLOB_SECRET signs."),
]


@contextlib.asynccontextmanager
async def resolved_claims(bus: Bus, blobs: str | None) -> AsyncIterator[Bus]:
    """``bus``, or with a blob store a bus whose records come back with their claims resolved."""
    if blobs is None:
        yield bus
        return
    from rlbus.blobs.open import open_store
    from rlbus.bus.claimcheck import ClaimCheckBus

    async with open_store(blobs, secret=os.environ.get("RLBUS_BLOB_SECRET")) as store:
        yield ClaimCheckBus(bus, store)

