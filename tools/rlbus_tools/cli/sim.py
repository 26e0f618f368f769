"""``rlbus sim``: simulate a fleet of any size."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlbus.cli.common import (
    RunConfigFile,
    console,
    err,
    print_error,
)
from rlbus.errors import RlbusError


def sim(
    fleet: Annotated[Path, typer.Option(help="The fleet file (TOML; format: tools/rlbus_tools/sim/fleet.py, example "
                                              "infra/sim/composer2.toml).")],
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every scenario's figures here.")] = None,
    plots: Annotated[Path | None, typer.Option(help="Write PNG plots into this directory (default: next to "
                                                    "--json, else runs/sim).")] = None,
    what_if: Annotated[list[str] | None, typer.Option(
        "--what-if", help="Also simulate a what-if (repeatable): region-down, half-wan, g128, traffic-3x, no-relay, "
                          "or all.")] = None,
    seed: Annotated[int | None, typer.Option(help="Override [sim] seed.")] = None,
    config: RunConfigFile = None,
) -> None:
    """Simulate an rlbus run on a fleet of any size (SimPy): trained tokens/s, staleness, publish → every
    region swapped, WAN bytes per version, utilisation, drops, the async-vs-sync speedup, and what-ifs.

    With --config, the run config's settings (groups per step, G, publish_every, max_staleness, admission,
    lr, keyframe_every) replace the fleet file's.

    Example: rlbus sim --fleet infra/sim/composer2.toml --config run.toml --what-if all --json sim.json
    """
    import msgspec
    from msgspec.structs import replace

    from rlbus_tools.sim.fleet import load_fleet
    from rlbus_tools.sim.report import plot, print_tables
    from rlbus_tools.sim.scenarios import WHAT_IFS, run_scenarios

    try:
        spec = load_fleet(fleet)
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(2) from None
    if config is not None:  # the run's own settings: groups per step, G, max_staleness, admission, lr …
        from rlbus.launch.config import load_config
        from rlbus_tools.sim.calibrate import with_run_config

        try:
            spec = with_run_config(spec, load_config(config))
        except RlbusError as exc:
            print_error(exc)
            raise typer.Exit(2) from None
    if seed is not None:
        spec = replace(spec, sim=replace(spec.sim, seed=seed))
    names = list(WHAT_IFS) if what_if and "all" in what_if else list(what_if or [])
    unknown = [n for n in names if n not in WHAT_IFS]
    if unknown:
        raise typer.BadParameter(f"unknown what-if {unknown[0]!r}; choose from {', '.join(WHAT_IFS)}, all")
    result = run_scenarios(spec, names, progress=lambda name: err.print(f"simulating {name} …"))
    print_tables(result)
    out = plots or (json_path.parent / f"{json_path.stem}-plots" if json_path is not None else Path("runs/sim"))
    for path in plot(result["scenarios"], out):
        console.print(f"plot: {path}")
    if json_path is not None:
        json_path.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
