"""``rlbus config``: check a run config before it runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rlbus.cli.common import (
    err,
    typer_app,
)
from rlbus.errors import RlbusError

app = typer_app(help="Run configs: check one before it runs.", no_args_is_help=True)


@app.command("check")
def config_check(
    file: Annotated[Path, typer.Argument(help="The run config (TOML) to check.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the resolved config as JSON, not TOML.")] = False,
) -> None:
    """Check a run config without starting anything, then print it resolved (every table, defaults filled).

    Loads the file as every role does (environment overrides applied), builds the task's environment from
    env_config and draws prompts, resolves the model source without loading weights, and parses a judge's
    rubric. The first problem is printed naming its field (with the closest valid name for a misspelling)
    and exits 1.

    Example: rlbus config check infra/rlbus/run.toml
    """
    from rlbus.launch.check import check_config, render_toml, resolved_tables

    try:
        checked = check_config(file)
    except RlbusError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    tables = resolved_tables(checked.config)
    if as_json:
        for note in checked.notes:
            err.print(f"ok: {note}", markup=False, highlight=False, soft_wrap=True)
        typer.echo(json.dumps(tables, indent=2))
    else:
        typer.echo("".join(f"# ok: {note}\n" for note in checked.notes) + "\n" + render_toml(tables), nl=False)
