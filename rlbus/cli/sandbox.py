"""``rlbus sandbox``: run untrusted programs as verifiers do."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlbus.cli.common import (
    typer_app,
)

app = typer_app(help="Run untrusted programs as verifiers do (bubblewrap + rlimits).", no_args_is_help=True)


@app.command("run")
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
