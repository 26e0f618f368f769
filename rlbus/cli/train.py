"""``rlbus train``: offline stages before RL (SFT → DPO → quality gate)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from rlbus.cli.common import (
    RunConfigFile,
    console,
    err,
    print_error,
    typer_app,
)
from rlbus.errors import RlbusError

app = typer_app(help="Offline stages before RL (SFT → DPO → quality gate).", no_args_is_help=True)


@app.command("dpo")
def train_dpo(
    config: RunConfigFile = None,
    data: Annotated[Path | None, typer.Option(help="Preference JSONL (text, chat or token pairs); default: "
                                                   "[dpo] data, else pairs from the task.")] = None,
    eval_data: Annotated[Path | None, typer.Option(help="Held-out preference JSONL (default: a split).")] = None,
    steps: Annotated[int | None, typer.Option(help="DPO steps (default: [dpo.train] steps, or 100).")] = None,
    out: Annotated[Path, typer.Option(help="Checkpoint directory ([model] checkpoint of the RL run).")] = Path(
        "runs/dpo"),
    baseline_sft: Annotated[bool, typer.Option(help="Also train SFT on the chosen responses alone, same budget.")
                            ] = False,
    eval_size: Annotated[int, typer.Option(help="Held-out task prompts for the task accuracy.")] = 100,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the figures here (under summary).")] = None,
) -> None:
    """The offline stages of a run config: warm start (SFT), DPO, the quality gate; writes the checkpoint RL
    starts from. Without a config it trains the in-house policy on the demo's task (seconds). Exits 1 when
    the gate ([dpo] gate_accuracy) is missed.

    Example: rlbus train dpo --config run.toml --out runs/dpo
    """
    import msgspec
    from rich.progress import Progress

    from rlbus.launch.config import load_config
    from rlbus.launch.stages import run_dpo

    try:
        run = load_config(config)
        train = run.dpo.train
        changes: dict[str, Any] = {"train": msgspec.structs.replace(
            train, steps=steps if steps is not None else (train.steps or 100))}
        if data is not None:
            changes["data"] = str(data)
        if eval_data is not None:
            changes["eval_data"] = str(eval_data)
        run = msgspec.structs.replace(run, dpo=msgspec.structs.replace(run.dpo, **changes))
        with Progress(console=err, transient=True) as progress:
            bar = progress.add_task("DPO", total=run.dpo.train.steps)

            def step(s: Any) -> None:
                progress.update(bar, advance=1, description=f"DPO loss {s.loss:.3f} acc {s.accuracy:.2f}")

            figures = run_dpo(run, out=out, baseline_sft=baseline_sft, eval_size=eval_size, log=console.print,
                              on_step=step)
    except (RlbusError, ValueError, FileNotFoundError) as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    table = Table("figure", "value", title="rlbus train dpo")
    for key, value in figures.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    if json_path is not None:
        json_path.write_bytes(msgspec.json.format(msgspec.json.encode({"summary": figures}), indent=2) + b"\n")
    if not figures["gate_passed"]:
        err.print(f"[red]quality gate missed[/red]: held-out preference accuracy {figures['eval_pref_accuracy_end']}"
                  f" < {figures['gate_accuracy']}")
        raise typer.Exit(1)
