"""``rlbus env``: coding-agent task corpora: generate, check, expert trajectories."""

from __future__ import annotations

import asyncio
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

app = typer_app(
    help="Coding-agent task corpora (env swe): generate, check, write expert trajectories.", no_args_is_help=True
)


TaskPaths = Annotated[
    list[Path], typer.Argument(help="Task directories, corpus directories or SWE-bench .jsonl files.")
]


@app.command("check")
def env_check(
    tasks: TaskPaths,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Grade each task's reference solution (must score 1) and its unchanged repository (must score 0),
    in the sandbox, with timings. Exit status 1 if any task fails either check."""
    from rlbus.envs.swe.commands import check

    try:
        results, code = check(tasks, as_json=as_json, log=err.print if as_json else console.print)
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(2) from None
    if not as_json:
        table = Table("task", "solution", "s", "unchanged", "s", "ok")
        for r in results:
            table.add_row(r.task_id, f"{r.solution_reward:g}", f"{r.solution_s:.2f}", f"{r.unchanged_reward:g}",
                          f"{r.unchanged_s:.2f}", "yes" if r.ok else f"[red]no[/red]: {r.problem[:80]}")
        console.print(table)
        console.print(f"{sum(r.ok for r in results)}/{len(results)} tasks valid")
    raise typer.Exit(code)


@app.command("trajectories")
def env_trajectories(
    tasks: TaskPaths,
    out: Annotated[Path, typer.Option("--out", help="JSONL file to write (chat rows for rlbus pretrain).")],
    model: Annotated[
        str | None,
        typer.Option(help="Cut each tool output to --max-observation-tokens of this model's tokens, as its "
                          "episodes will (a shipped model, directory or .gguf; default: outputs kept whole)."),
    ] = None,
    max_observation_tokens: Annotated[
        int, typer.Option(help="With --model: the env's max_observation_tokens (the swe default).")
    ] = 1024,
) -> None:
    """Replay each reference solution through the tools (view / str_replace / create, tests, submit) and
    write the sessions that score 1 as chat-format SFT rows with tool calls and results."""
    from rlbus.envs.swe.commands import trajectories
    from rlbus.envs.swe.trajectories import ObservationCut

    try:
        cut = None
        if model is not None:
            from rlbus.models.sources import parse_model

            if max_observation_tokens < 1:
                raise typer.BadParameter("--max-observation-tokens must be >= 1")
            cut = ObservationCut(parse_model(model, progress=err.print).chat, max_observation_tokens)
        summary = trajectories(tasks, out, log=console.print, cut=cut)
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(2) from None
    console.print(f"wrote {summary['written']} trajectories to {out}")
    raise typer.Exit(1 if summary["failed"] else 0)


@app.command("generate")
def env_generate(
    library: Annotated[
        list[str], typer.Option("--library", help="NAME==VERSION of a pure-Python library with tests (repeat).")
    ],
    tasks: Annotated[int, typer.Option("--tasks", min=1, help="Tasks to make in all, split over the libraries.")],
    out: Annotated[Path, typer.Option("--out", help="Corpus directory (task dirs, _bases/, manifest.json).")],
    seed: Annotated[int, typer.Option("--seed", help="One seed, one corpus.")] = 0,
    max_failing: Annotated[int, typer.Option(help="Reject bugs that break more tests than this.")] = 50,
    pass_to_pass: Annotated[int, typer.Option(help="PASS_TO_PASS tests sampled per task.")] = 25,
    test_timeout: Annotated[int, typer.Option(help="Seconds per sandboxed test run.")] = 120,
) -> None:
    """Make bug-fixing tasks from released libraries (SWE-smith style, rlbus/envs/swegen): inject a bug into a
    function the library's tests cover, keep the tests that now fail, validate each task in the sandbox.
    A library's earlier tasks in OUT are replaced; other libraries' tasks are kept."""
    from rlbus.envs.swegen.generate import GenerateOptions, generate

    options = GenerateOptions(
        libraries=library, tasks=tasks, seed=seed, out=out, max_failing=max_failing,
        pass_to_pass=pass_to_pass, test_timeout_s=test_timeout,
    )  # fmt: skip
    try:
        results = asyncio.run(
            generate(options, lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True))
        )
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    table = Table("library", "tests", "mutants", "kept", "rejected")
    for r in results:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(r.rejected.items())) or "-"
        table.add_row(r.library, str(r.baseline_tests), str(r.tried), str(r.made), reasons)
    console.print(table)
    made = sum(r.made for r in results)
    console.print(f"{made} tasks written to {out} (manifest.json)")
    if made < tasks:
        err.print(f"[yellow]made {made} of the {tasks} tasks asked for[/yellow]")
        raise typer.Exit(1)
