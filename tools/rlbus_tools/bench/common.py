"""What every benchmark shares: run metadata, the printed table, the JSON file (percentiles are
`rlbus.observe.stats`), and the options and exit status of its command (``rlbus bench NAME``)."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Console
from rich.table import Table


def meta() -> dict[str, Any]:
    """git commit, date, CPU count, torch version and GPU name (if any) of this run."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip() or None
    except OSError:
        commit = None
    torch_version = gpu = None
    try:
        import torch

        torch_version = str(torch.__version__)
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return {
        "commit": commit,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch_version,
        "gpu": gpu,
    }


def print_table(title: str, columns: list[str], rows: list[list[Any]], *, width: int | None = None) -> None:
    """``width``: the console's, when the table is wider than a terminal's default 80 columns."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column != columns[0] else "left")
    for row in rows:
        table.add_row(*[f"{v:,.2f}" if isinstance(v, float) else str(v) for v in row])
    Console(width=width).print(table)


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        path.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")


JsonPath = Annotated[Path | None, typer.Option("--json", help="Write the figures here.")]
Device = Annotated[str, typer.Option(help="Where the models run: auto (CUDA when there is one), cuda, cuda:N, cpu.")]


def synchronize(device: Any) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU): around a timed region on a GPU."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
Quick = Annotated[bool, typer.Option(help="A CI-sized run of the same measurement.")]
Bootstrap = Annotated[
    str, typer.Option("--bootstrap", "-b", envvar="RLBUS_KAFKA_BOOTSTRAP", help="Kafka bootstrap servers host:port.")
]


def require(passed: bool, failure: str) -> None:
    """A benchmark's pass condition: when it fails, one red line on stderr and exit status 1."""
    if not passed:
        Console(stderr=True).print(f"[red]{failure}[/red]")
        raise typer.Exit(1)
