"""``rlbus demo``: async RL end to end in one process (embedded bus)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rlbus.errors import ConfigError, RlbusError

if TYPE_CHECKING:
    from rlbus.launch.config import RunConfig

from rlbus.cli.common import (
    console,
    err,
    print_error,
)


def demo(
    quick: Annotated[bool, typer.Option(help="A one-minute version (fewer steps, two workers).")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the run's figures here.")] = None,
    run_dir: Annotated[Path, typer.Option(help="Where blobs, summary.json and demo.png go.")] = Path("runs/demo"),
    steps: Annotated[int | None, typer.Option(help="RL steps (default: 60, or 15 with --quick).")] = None,
    time_budget: Annotated[
        float | None, typer.Option(help="Seconds of RL before the demo gives up (default 300, 60 with --quick); "
                                        "ending on it instead of the step count exits 1.")
    ] = None,
    workers: Annotated[int | None, typer.Option(help="Rollout workers (default 3, or 2 with --quick).")] = None,
    seed: Annotated[int | None, typer.Option(help="[task] seed (default 0, or the --config file's).")] = None,
    teacher_error: Annotated[
        float | None,
        typer.Option(help="Share of warm-start answers the sloppy teacher gets off by one (default 0.55; 0 = clean)."),
    ] = None,
    dashboard: Annotated[
        int | None, typer.Option("--dashboard", help="Serve the live dashboard on this port during the run.")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Train a real LLM instead of the in-house policy: smollm2-135m-instruct (the "
                                      "shipped run, ~15 min on 2 cores), or an HF model directory or .gguf file.")
    ] = None,
    engine: Annotated[
        str, typer.Option(help="Rollout engine: torch, vllm (an HF --model; the demo then runs under the vLLM "
                               "environment's python, `make vllm-env`, with one rollout worker by default), or a "
                               "registered engine of an installed package (`rlbus.engines` entry points).")
    ] = "torch",
    device: Annotated[
        str | None, typer.Option(help="Where the model runs: auto (CUDA when there is one), cuda, cuda:N or cpu "
                                      "(default: auto for --model, cpu for the in-house policy, the --config "
                                      "file's [model] device).")
    ] = None,
    config_file: Annotated[
        Path | None, typer.Option("--config", help="Run this run config (TOML, as `rlbus worker` takes) instead of "
                                                   "the demo's: its [task], [model], [trainer], [rollout], [reward] "
                                                   "on the embedded bus ([bus], [state], [store] not used). Not with "
                                                   "--model or --quick.")
    ] = None,
) -> None:
    """Async RL end to end in one process: warm start, then prompts → rollout workers → rewards →
    GRPO trainer, weights flowing back as lossless deltas. Embedded bus, CPU, a few minutes.

    Example: rlbus demo --config run.toml --steps 20 (your run config, no Kafka or Redis);
    rlbus demo --model smollm2-135m-instruct --device cuda (SmolLM2 on the GPU)
    """
    import msgspec

    from rlbus.demo import Demo, demo_config, embedded_note, headline
    from rlbus.demo_view import plot, summary_table, watch

    _in_engine_env(engine)
    try:
        run = _user_run(config_file) if config_file is not None else None
        if run is not None and engine == "torch":  # no --engine: the file's [rollout] engine
            _in_engine_env(run.rollout.engine)
        config = demo_config(quick=quick, model=model, run=run, engine=engine, steps=steps, time_budget_s=time_budget,
                             workers=workers, seed=seed, teacher_error=teacher_error, device=device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from None
    if run is not None:
        console.print(f"--config {config_file}: {embedded_note(run, run_dir)}", markup=False, highlight=False,
                      soft_wrap=True)  # one line, whatever the width: the URLs stay whole (copyable)
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(headline(config, run_dir), markup=False, highlight=False)
    result = watch(Demo(config, run_dir), console, dashboard=dashboard)
    console.print(summary_table(result))
    console.print(f"plot: {plot(result, run_dir / 'demo.png')}", soft_wrap=True)
    if json_path is not None:
        json_path.write_bytes(msgspec.json.format(msgspec.json.encode(result.figures()), indent=2))
    if not result.completed:
        err.print(f"[red]the demo did not do its job:[/red] it ended on its {config.time_budget_s:.0f} s time budget "
                  f"after {result.steps} of {result.steps_target} RL steps. Waiting for: {result.stalled}")
        raise typer.Exit(1)


def _user_run(config_file: Path) -> RunConfig:
    """``--config``: the user's run config, loaded and checked as every role loads it (errors exit 1)."""
    from rlbus.launch.check import check_before_run
    from rlbus.launch.config import load_config

    try:
        run = load_config(config_file)
        check_before_run(run)
    except (RlbusError, ValueError) as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    return run


def _in_engine_env(engine: str) -> None:
    """Re-run this command under the ``rlbus`` of the environment ``engine`` runs in (vLLM's) unless the engine
    runs here (the demo is one process, so its trainer runs there too). An unknown engine is a bad --engine."""
    from rlbus.engines.kinds import engine_kind
    from rlbus.launch.processes import rlbus_command_in

    try:
        kind = engine_kind(engine, field="--engine")
    except ConfigError as exc:
        raise typer.BadParameter(exc.problem, param_hint="--engine") from None
    if kind.available():
        return
    try:
        python = kind.python()
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    if python is None:
        err.print(f"[red]engine {engine!r} does not run in this environment[/red]")
        raise typer.Exit(1)
    command = rlbus_command_in(python)
    console.print(f"{engine} does not run in this environment: running under {command[0]}")
    os.execv(command[0], [*command, *sys.argv[1:]])
