"""``rlbus bench NAME``: a command group whose commands are the benchmarks' own ``main`` functions.

The group lists :data:`rlbus_tools.bench.BENCHMARKS` and imports a benchmark's module only to run it (or
show its ``--help``), so ``rlbus bench --help`` never loads torch.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup

from rlbus_tools.bench import BENCHMARKS


class BenchGroup(TyperGroup):
    """Commands resolved by name from the benchmark modules, on demand."""

    # Context and formatter types are click's, which typer vendors from 0.22 on: typed loosely to fit both.
    def list_commands(self, ctx: Any) -> list[str]:
        return list(BENCHMARKS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in BENCHMARKS:
            return None
        module = importlib.import_module(f"rlbus_tools.bench.{cmd_name.replace('-', '_')}")
        single = typer.Typer(rich_markup_mode=None, add_completion=False)
        single.command(cmd_name)(module.main)
        return typer.main.get_command(single)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        with formatter.section("Benchmarks"):
            formatter.write_dl(list(BENCHMARKS.items()))


app = typer.Typer(cls=BenchGroup, rich_markup_mode=None, no_args_is_help=True)


@app.callback()
def bench() -> None:
    """Run a benchmark: a short table with its same-run baseline; --json FILE writes the figures, --quick is a
    CI-sized run of the same measurement. `rlbus bench NAME --help` shows a benchmark's own options."""
